"""Latency of GetCachedResponse / PutCachedResponse over gRPC on loopback.

Runs ``python -m services.cache`` as its own process (memory store, then Redis
on a throwaway server) and times sequential calls from one long-lived channel:

    python tests/cache/bench_latency.py [--calls 2000] [--runs 5]

Prints, per store and call, the median of the runs' medians and p99s in microseconds.
Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "services" / "gen")]

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from llmesh.v1 import cache_pb2, cache_pb2_grpc  # noqa: E402

from services.common.grpc_util import make_channel  # noqa: E402
from tests.cache.helpers import make_key, make_response  # noqa: E402
from tests.cache.redis_server import start_redis_server  # noqa: E402


def launch(flags: list[str], port_file: Path) -> tuple[subprocess.Popen, int]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "services/gen")]))
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cache", "--port", "0", "--metrics-port", "-1",
         "--log-level", "warning", "--port-file", str(port_file), *flags],
        cwd=ROOT, env=env, stderr=subprocess.DEVNULL)
    while not port_file.exists() or not port_file.read_text():
        time.sleep(0.02)
    return process, json.loads(port_file.read_text())["grpc_port"]


async def wait_serving(channel: grpc.aio.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    while (await health.Check(health_pb2.HealthCheckRequest())).status != \
            health_pb2.HealthCheckResponse.SERVING:
        await asyncio.sleep(0.02)


async def time_calls(call, requests: list) -> list[float]:
    samples = []
    for request in requests:
        started = time.perf_counter()
        await call(request)
        samples.append(time.perf_counter() - started)
    return samples


async def bench(port: int, calls: int, runs: int) -> dict[str, tuple[float, float]]:
    channel = make_channel(f"127.0.0.1:{port}")
    await wait_serving(channel)
    stub = cache_pb2_grpc.CacheServiceStub(channel)
    prompt = list(range(1000, 1512))  # a 512-token prompt
    response = make_response(list(range(128)), "x" * 600)
    results: dict[str, list[tuple[float, float]]] = {"put": [], "get_hit": [], "get_miss": []}
    for run in range(runs + 1):  # run 0 warms up
        keys = [make_key([run, i, *prompt], max_tokens=128) for i in range(calls)]
        puts = [cache_pb2.PutCachedResponseRequest(key=k, response=response) for k in keys]
        gets = [cache_pb2.GetCachedResponseRequest(key=k) for k in keys]
        misses = [cache_pb2.GetCachedResponseRequest(key=make_key([run, i, -1, *prompt]))
                  for i in range(calls)]
        timings = {
            "put": await time_calls(stub.PutCachedResponse, puts),
            "get_hit": await time_calls(stub.GetCachedResponse, gets),
            "get_miss": await time_calls(stub.GetCachedResponse, misses),
        }
        if run:
            for name, samples in timings.items():
                samples.sort()
                results[name].append((statistics.median(samples),
                                      samples[int(0.99 * len(samples)) - 1]))
    await channel.close()
    return {name: (statistics.median(m for m, _ in r), statistics.median(p for _, p in r))
            for name, r in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    redis_server = start_redis_server()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name, flags in (("memory", []), ("redis", ["--redis-url", redis_server.url])):
                process, port = launch(flags, Path(tmp) / f"{name}.json")
                try:
                    result = asyncio.run(bench(port, args.calls, args.runs))
                finally:
                    process.terminate()
                    process.wait(timeout=20)
                for call, (median, p99) in result.items():
                    print(f"{name:6} {call:8} median {median * 1e6:7.1f} us   "
                          f"p99 {p99 * 1e6:7.1f} us")
    finally:
        redis_server.stop()


if __name__ == "__main__":
    main()
