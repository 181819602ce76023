"""llama-server alone beside a busy process: which of its settings fall off the cliff.

Issue 31 saw llama-server drop from 109 to 1.7 tok/s at one stream when one
busy process (``python3 -c "while True: pass"``) took a core of two;
``benchmarks/contention.py`` (llama-server beside an idle mesh, ``--threads 2``,
8 slots) measured 0.22-0.43 of its quiet speed instead. This runs
llama-server by itself for each setting given (``--threads N`` or its default,
``--poll`` level), one request at a time on ``/completion`` (greedy, EOS
ignored), quiet and then with busy processes started after the server, and
prints its own decode speed (``timings.predicted_per_second``: generation
only, no HTTP or prompt) for each, with the load average.

Usage (the llama-server that ``peer_llamacpp.sh`` built; alone on the machine)::

    python benchmarks/llama_contention.py --threads default,2 --poll 50,0

Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

from benchmarks.flags import integer, integers  # noqa: E402
from services.cli.mesh import free_port  # noqa: E402
from services.common.model_files import default_model_path  # noqa: E402

LLAMA_SERVER = (Path(os.environ.get("LLMESH_CACHE_DIR") or Path.home() / ".cache" / "llmesh")
                / "llama.cpp" / "llama-cpp-python-0.3.36" / "bin" / "llama-server")
BUSY = [sys.executable, "-c", "while True: pass"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", default="default,2",
                        help="comma list: N (--threads N --threads-batch N) or default")
    parser.add_argument("--poll", type=integers(0), default="50",
                        help="comma list of --poll levels (llama.cpp's default: 50)")
    parser.add_argument("--busy", type=integer(1), default=1, help="busy processes")
    parser.add_argument("--tokens", type=integer(2), default=32, help="tokens a request")
    parser.add_argument("--requests", type=integer(1), default=3,
                        help="requests per measurement (median reported)")
    parser.add_argument("--server", type=Path, default=LLAMA_SERVER)
    args = parser.parse_args()
    args.thread_settings = [t.strip() for t in args.threads.split(",") if t.strip()]
    for setting in args.thread_settings:
        if setting != "default" and not (setting.isdigit() and int(setting) >= 1):
            parser.error(f"argument --threads: expected N >= 1 or default, got {setting!r}")
    return args


class ServerFailed(RuntimeError):
    """llama-server did not start, or stopped answering."""


def complete(port: int, tokens: int) -> float:
    """One greedy request; llama-server's own decode tok/s.

    Raises:
      ServerFailed: the request failed (refused, reset, timed out).
    """
    body = json.dumps({"prompt": "Tell me about the history of bread.", "n_predict": tokens,
                       "temperature": 0, "ignore_eos": True, "cache_prompt": False}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body,
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as reply:
            return float(json.loads(reply.read())["timings"]["predicted_per_second"])
    except OSError as error:  # urllib.error.URLError included
        raise ServerFailed(f"llama-server on port {port}: {error}") from error


def wait_ready(port: int, server: subprocess.Popen[bytes]) -> None:
    """Returns once llama-server answers ``/health``.

    Raises:
      ServerFailed: it exited or was not ready within 120 s.
    """
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and server.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except (urllib.error.URLError, OSError):
            time.sleep(0.2)
    raise ServerFailed(f"llama-server did not become ready (exit {server.poll()})")


def measure(args: argparse.Namespace, threads: str, poll: int) -> tuple[float, float]:
    """Median decode tok/s quiet, then beside the busy processes."""
    port = free_port("127.0.0.1")
    command = [str(args.server), "--model", str(default_model_path()), "--host", "127.0.0.1",
               "--port", str(port), "--poll", str(poll), "--no-webui"]
    if threads != "default":
        command += ["--threads", threads, "--threads-batch", threads]
    try:
        server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError as error:
        raise ServerFailed(f"cannot start {args.server}: {error.strerror}") from error
    busy: list[subprocess.Popen[bytes]] = []
    try:
        wait_ready(port, server)
        complete(port, 4)  # warm-up
        quiet = statistics.median(complete(port, args.tokens) for _ in range(args.requests))
        busy = [subprocess.Popen(BUSY) for _ in range(args.busy)]  # after the server
        time.sleep(1.0)
        loaded = statistics.median(complete(port, args.tokens) for _ in range(args.requests))
        return quiet, loaded
    finally:
        for child in [*busy, server]:
            child.kill()
            child.wait()


def main() -> int:
    """Runs the measurements; 0 done, 1 llama-server failed (one line says how)."""
    args = parse_args()
    try:
        return run(args)
    except ServerFailed as error:
        print(f"llama_contention: {error}", file=sys.stderr)
        return 1


def run(args: argparse.Namespace) -> int:
    """Prints the table of quiet and busy speeds for every setting."""
    print(f"llama-server alone, {args.requests} requests of {args.tokens} tokens a "
          f"measurement, {args.busy} busy process(es) started after it, {os.cpu_count()} CPUs; "
          f"load {os.getloadavg()}", flush=True)
    print("| --threads | --poll | quiet tok/s | busy tok/s | busy / quiet | load 1 min |")
    print("|---|---:|---:|---:|---:|---:|")
    for threads in args.thread_settings:
        for poll in args.poll:
            quiet, loaded = measure(args, threads, poll)
            print(f"| {threads} | {poll} | {quiet:.1f} | {loaded:.1f} | {loaded / quiet:.2f} "
                  f"| {os.getloadavg()[0]:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
