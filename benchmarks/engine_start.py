"""Engine cold start: seconds from spawning ``python -m services.engine`` to gRPC
health SERVING, for one or more checkouts, interleaved (A, B, A, B, ...).

Every engine start of a mesh, a restart and each test-suite mesh pays it. Each
run spawns the engine of ``--repo`` (default: this checkout) with its own code
on ``PYTHONPATH``, free ports and ``--engine-arg``s, polls its health every
50 ms, reads its ``engine_ready`` log line (``load_s``: GGUF read, quantization
and model build; ``warmup_s``) and stops it (SIGTERM). Prints p50 / min / max per
checkout and the load average before and after.

Usage: ``python benchmarks/engine_start.py [--repo /work/main --repo .] [--runs 5]
[--engine-arg=--num-threads --engine-arg=1]``. Not a test: numbers depend on the
machine and its load (run it under ``flock -x /tmp/llmesh-cpu.lock`` when you
report them).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Start:
    """One start: seconds to SERVING, and the engine's own ``load_s``."""

    serving_s: float
    load_s: float


def start_once(repo: Path, engine_args: list[str], timeout_s: float = 300.0) -> Start:
    """Spawns the engine of ``repo``, waits until it serves, stops it.

    Raises:
      RuntimeError: it exited or did not serve within ``timeout_s`` (with its log tail).
    """
    with tempfile.TemporaryDirectory(prefix="engine-start-") as run:
        port_file, log_path = Path(run) / "engine.json", Path(run) / "engine.log"
        env = {**os.environ, "PYTHONPATH": f"{repo}:{repo / 'services' / 'gen'}"}
        argv = [sys.executable, "-m", "services.engine", "--host", "127.0.0.1", "--port", "0",
                "--metrics-port", "0", "--port-file", str(port_file), *engine_args]
        began = time.monotonic()
        with open(log_path, "wb") as log:
            process = subprocess.Popen(argv, cwd=repo, env=env, stdout=log,
                                       stderr=subprocess.STDOUT)
        try:
            serving_s = _wait_serving(process, port_file, began, timeout_s, log_path)
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        return Start(serving_s, _load_seconds(log_path))


def _wait_serving(process: subprocess.Popen[bytes], port_file: Path, began: float,
                  timeout_s: float, log_path: Path) -> float:
    channel: grpc.Channel | None = None
    try:
        while time.monotonic() - began < timeout_s:
            if process.poll() is not None:
                raise RuntimeError(f"the engine exited ({process.returncode}):\n"
                                   f"{log_path.read_text(errors='replace')[-2000:]}")
            if channel is None and port_file.exists():
                try:
                    port = json.loads(port_file.read_text())["grpc_port"]
                except (json.JSONDecodeError, KeyError):
                    port = None
                if port is not None:
                    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
            if channel is not None:
                try:
                    reply = health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(), timeout=1.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return time.monotonic() - began
                except grpc.RpcError:
                    pass
            time.sleep(0.05)
        raise RuntimeError(f"the engine did not serve within {timeout_s:.0f} s")
    finally:
        if channel is not None:
            channel.close()


def _load_seconds(log_path: Path) -> float:
    """``load_s`` of the ``engine_ready`` JSON log line (NaN without one)."""
    for line in log_path.read_text(errors="replace").splitlines():
        if '"engine_ready"' in line:
            try:
                return float(json.loads(line).get("load_s", "nan"))
            except ValueError:
                break
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", action="append", type=Path,
                        help="a checkout to start the engine from (repeat to compare; "
                             "default: this one)")
    parser.add_argument("--runs", type=int, default=5, help="starts per checkout")
    parser.add_argument("--engine-arg", action="append", default=[],
                        help="an argument for the engine (repeat; --engine-arg=--flag)")
    args = parser.parse_args()
    repos = [r.resolve() for r in args.repo or [REPO]]
    before = os.getloadavg()
    results: dict[Path, list[Start]] = {repo: [] for repo in repos}
    for run in range(args.runs):
        for repo in repos:
            start = start_once(repo, args.engine_arg)
            results[repo].append(start)
            print(f"run {run + 1} {repo}: SERVING after {start.serving_s:.2f} s "
                  f"(load_s {start.load_s:.2f})", flush=True)
    after = os.getloadavg()
    print(f"\nengine start to SERVING, {args.runs} interleaved runs each "
          f"(load average before {before[0]:.2f} {before[1]:.2f} {before[2]:.2f}, "
          f"after {after[0]:.2f} {after[1]:.2f} {after[2]:.2f}):")
    for repo, starts in results.items():
        serving = [s.serving_s for s in starts]
        loads = [s.load_s for s in starts]
        print(f"  {repo}: p50 {statistics.median(serving):.2f} s, min {min(serving):.2f}, "
              f"max {max(serving):.2f} (load_s p50 {statistics.median(loads):.2f})")


if __name__ == "__main__":
    main()
