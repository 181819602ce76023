#!/usr/bin/env bash
# Peer benchmark: llmesh against llama.cpp's llama-server on the same GGUF, the
# same prompts and the same machine (not run in CI; see docs/bench.md,
# "Peer benchmark: llama.cpp").
#
#   benchmarks/peer_llamacpp.sh [--skip-build] [--build-only] [--quick]
#       [--concurrency 1,8,16,32] [--prompt-len 512] [--output-len 128] [...]
#
# 1. Builds llama-server once into the cache (skipped when the binary is there):
#    the llama.cpp source vendored in the PyPI sdist of llama-cpp-python
#    (vendor/llama.cpp), CMake Release, native CPU flags, no curl/OpenSSL, no
#    downloaded web UI. About six minutes on 2 cores.
# 2. Serves the model GGUF (services.common.model_files.default_model_path())
#    with llama-server on a free loopback port and starts the llmesh mesh
#    (`llmesh up`, free ports, default engine settings).
# 3. Runs benchmarks/peer_llamacpp.py, which drives both with `llmesh bench`
#    in alternation and prints the table, the targets and the roofline.
# Everything it started is stopped on exit, error or Ctrl-C (only those PIDs).
#
# Environment:
#   LLMESH_CACHE_DIR           cache root (default ${XDG_CACHE_HOME:-~/.cache}/llmesh)
#   LLAMA_CPP_PYTHON_VERSION   the sdist whose vendored llama.cpp is built (default 0.3.36)
#   PEER_THREADS               llama-server threads (default: nproc)
#   PYTHON                     the Python with llmesh installed (default python3)
#   PEER_DRIVER                the driver run at step 3 (default benchmarks/peer_llamacpp.py;
#                              benchmarks/contention.py sets itself); it gets PEER_LLAMA_PID
#                              and PEER_MESH_RUN_DIR in its environment
# Every other flag goes to the driver (--help lists them).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE_ROOT="${LLMESH_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/llmesh}"
CACHE_DIR="$CACHE_ROOT/llama.cpp/llama-cpp-python-$LLAMA_CPP_PYTHON_VERSION"
LLAMA_SERVER="$CACHE_DIR/bin/llama-server"
THREADS="${PEER_THREADS:-$(nproc)}"
DRIVER="${PEER_DRIVER:-$REPO_ROOT/benchmarks/peer_llamacpp.py}"

SKIP_BUILD=0
BUILD_ONLY=0
PY_ARGS=()
while (($#)); do
    case "$1" in
        --skip-build) SKIP_BUILD=1 ;;
        --build-only) BUILD_ONLY=1 ;;
        -h|--help)
            sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
            echo "$(basename "$DRIVER") flags:"
            exec "$PYTHON" "$DRIVER" --help ;;
        *) PY_ARGS+=("$1") ;;
    esac
    shift
done

log() { printf 'peer_llamacpp: %s\n' "$*" >&2; }

# -- build -------------------------------------------------------------------

build_llama_server() {
    if ! command -v cc >/dev/null || ! command -v c++ >/dev/null; then
        if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
            log "no C/C++ compiler: apt-get install -y build-essential"
            apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq build-essential
        else
            log "no C/C++ compiler (cc, c++): install build-essential (or gcc and g++) first"
            return 1
        fi
    fi
    local cmake=cmake
    if ! command -v cmake >/dev/null; then
        log "no cmake: $PYTHON -m pip install cmake"
        "$PYTHON" -m pip install -q cmake
        cmake="$("$PYTHON" -c 'import cmake, os; print(os.path.join(cmake.CMAKE_BIN_DIR, "cmake"))')"
    fi
    local work="$CACHE_DIR/work"
    rm -rf "$work" && mkdir -p "$work"
    log "downloading the llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sdist (for vendor/llama.cpp)"
    "$PYTHON" -m pip download -q --no-deps --no-binary :all: \
        "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$work"
    tar -xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
    local src
    src="$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)"
    [[ -f "$src/CMakeLists.txt" ]] || { log "no vendor/llama.cpp in the sdist"; return 1; }
    log "building llama-server from $src with $(nproc) jobs (about 6 min on 2 cores)"
    # LLAMA_USE_PREBUILT_UI=OFF: no web UI download at build time (no network
    # needed); LLAMA_OPENSSL=OFF: plain HTTP on loopback; LLAMA_CURL is gone in
    # this version (model download is not used here). GGML_NATIVE: -march=native.
    "$cmake" -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release \
        -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
        -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
        -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF \
        >"$work/cmake-configure.log" 2>&1 \
        || { tail -30 "$work/cmake-configure.log" >&2; return 1; }
    "$cmake" --build "$work/build" --target llama-server -j "$(nproc)" \
        >"$work/cmake-build.log" 2>&1 \
        || { tail -30 "$work/cmake-build.log" >&2; return 1; }
    mkdir -p "$CACHE_DIR/bin"
    cp "$work/build/bin/llama-server" "$LLAMA_SERVER.tmp" && mv "$LLAMA_SERVER.tmp" "$LLAMA_SERVER"
    cp "$work/cmake-configure.log" "$work/cmake-build.log" "$CACHE_DIR/"
    rm -rf "$work"
    log "built $LLAMA_SERVER"
}

if [[ -x "$LLAMA_SERVER" ]]; then
    log "llama-server: $LLAMA_SERVER (cached)"
elif ((SKIP_BUILD)); then
    log "--skip-build, but there is no $LLAMA_SERVER"
    exit 1
else
    build_llama_server
fi
((BUILD_ONLY)) && exit 0

# -- launch ------------------------------------------------------------------

cd "$REPO_ROOT"
# The repository and its generated stubs (llmesh.v1) first, as the mesh does for its services.
export PYTHONPATH="$REPO_ROOT:$REPO_ROOT/services/gen${PYTHONPATH:+:$PYTHONPATH}"
# The run's shape as peer_llamacpp.py resolves the flags (--quick, --concurrency ...).
read -r MAX_CONCURRENCY PROMPT_LEN OUTPUT_LEN < <(
    "$PYTHON" "$DRIVER" --print-shape "${PY_ARGS[@]}")
GGUF="$("$PYTHON" -c 'from services.common.model_files import default_model_path as p; print(p())')"
[[ -f "$GGUF" ]] || { log "no model file at $GGUF"; exit 1; }
RUN_DIR="$(mktemp -d "${TMPDIR:-/tmp}/peer_llamacpp.XXXXXX")"

STARTED_PIDS=()
cleanup() {
    local code=$?
    trap - EXIT INT TERM
    local pid
    for pid in "${STARTED_PIDS[@]}"; do
        kill -TERM "$pid" 2>/dev/null || true
    done
    for pid in "${STARTED_PIDS[@]}"; do
        for _ in $(seq 100); do  # up to 10 s each; the mesh drains and stops its children
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        if kill -0 "$pid" 2>/dev/null; then
            log "pid $pid still alive: SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
    done
    ((${#STARTED_PIDS[@]})) && log "stopped pids ${STARTED_PIDS[*]} (logs in $RUN_DIR)"
    exit "$code"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_port() {
    "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# llama-server: every slot holds a whole request (prompt + output + margin).
LLAMA_PORT="$(free_port)"
CTX_SIZE=$((MAX_CONCURRENCY * (PROMPT_LEN + OUTPUT_LEN + 64)))
LLAMA_CMD=("$LLAMA_SERVER" --model "$GGUF" --alias SmolLM2-135M-Instruct
           --host 127.0.0.1 --port "$LLAMA_PORT"
           --parallel "$MAX_CONCURRENCY" --ctx-size "$CTX_SIZE"
           --threads "$THREADS" --threads-batch "$THREADS"
           --threads-http $((MAX_CONCURRENCY + 4)) --no-webui)
log "starting: ${LLAMA_CMD[*]}"
"${LLAMA_CMD[@]}" >"$RUN_DIR/llama-server.log" 2>&1 &
STARTED_PIDS+=($!)
LLAMA_PID=$!

# The mesh: free ports, default engine settings.
MESH_CMD=("$PYTHON" -m services.cli up --port 0 --admin-port 0 --run-dir "$RUN_DIR/mesh")
log "starting: ${MESH_CMD[*]}"
"${MESH_CMD[@]}" >"$RUN_DIR/mesh.log" 2>&1 &
STARTED_PIDS+=($!)
MESH_PID=$!

deadline=$((SECONDS + 600))
LLAMA_URL="http://127.0.0.1:$LLAMA_PORT"
until curl -sf "$LLAMA_URL/health" >/dev/null 2>&1; do
    kill -0 "$LLAMA_PID" 2>/dev/null || { log "llama-server exited:"; tail -20 "$RUN_DIR/llama-server.log" >&2; exit 1; }
    ((SECONDS < deadline)) || { log "llama-server not ready after 600 s"; exit 1; }
    sleep 0.5
done
log "llama-server ready on $LLAMA_URL (pid $LLAMA_PID)"
MESH_URL=""
until [[ -n "$MESH_URL" ]]; do
    MESH_URL="$(sed -n 's/^llmesh is up in .* on \([0-9.:]*\)$/\1/p' "$RUN_DIR/mesh.log" | head -1)"
    [[ -n "$MESH_URL" ]] && break
    kill -0 "$MESH_PID" 2>/dev/null || { log "llmesh up exited:"; tail -20 "$RUN_DIR/mesh.log" >&2; exit 1; }
    ((SECONDS < deadline)) || { log "the mesh is not up after 600 s"; exit 1; }
    sleep 0.5
done
log "llmesh ready on $MESH_URL (pid $MESH_PID)"

# In the background and waited for, so that a signal reaches the trap at once; the
# driver is first in line to be stopped (it stops its running `llmesh bench`).
PEER_LLAMA_PID="$LLAMA_PID" PEER_MESH_RUN_DIR="$RUN_DIR/mesh" \
    "$PYTHON" "$DRIVER" --llmesh-url "$MESH_URL" --llama-url "$LLAMA_URL" \
    --llama-command "${LLAMA_CMD[*]}" --llmesh-command "${MESH_CMD[*]}" "${PY_ARGS[@]}" &
DRIVER_PID=$!
STARTED_PIDS=("$DRIVER_PID" "${STARTED_PIDS[@]}")
wait "$DRIVER_PID"
