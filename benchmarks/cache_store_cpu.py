"""CPU per response-cache store, unary ``PutCachedResponse`` against the
router's stream (``PutCachedResponses`` through :class:`CacheClient`), or
with ``--lookups`` per lookup (misses: unary ``GetCachedResponse`` against
``GetCachedResponses``), on both sides: the cache service's process
(schedstat, ns) and this process (the router's side: ``time.process_time_ns``).

Starts ``python -m services.cache`` (embedded store) on a free port, then
interleaves rounds of ``--stores`` stores over each path, one after another
(each awaited before the next, as one stream's requests make them) and all
at once (a burst: the stream batches them), and prints the
median CPU microseconds per store over the rounds with [p25-p75], and the
load average. Not a test: numbers depend on the machine.

Usage: ``flock -x /tmp/llmesh-cpu.lock python benchmarks/cache_store_cpu.py
[--rounds 5] [--stores 300] [--lookups]``
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

from llmesh.v1 import cache_pb2
from services.cli.mesh import child_env
from services.common.grpc_util import request_id_metadata
from services.common.sampling import FinishReason, SamplingOptions
from services.common.wire.cache import CachedResponse, CacheKey
from services.router.clients import CacheClient

sys.path.insert(0, str(Path(__file__).resolve().parent))
from latency_attribution import cpu_ns  # noqa: E402

ANSWER = CachedResponse(tuple(range(128)), "x" * 600, FinishReason.LENGTH)


def _key(i: int) -> CacheKey:
    return CacheKey("bench-model", tuple(range(i, i + 41)), SamplingOptions(max_tokens=128))


async def _unary(client: CacheClient, i: int) -> bool:
    reply = await client.stub.PutCachedResponse(
        cache_pb2.PutCachedResponseRequest(key=_key(i).to_pb(), response=ANSWER.to_pb()),
        timeout=5, metadata=request_id_metadata(f"u{i}"))
    return reply.stored


async def _stream(client: CacheClient, i: int) -> bool:
    return await client.put(_key(i), ANSWER, request_id=f"s{i}")


async def _unary_get(client: CacheClient, i: int) -> bool:
    await client.stub.GetCachedResponse(
        cache_pb2.GetCachedResponseRequest(key=_key(i).to_pb()), timeout=5,
        metadata=request_id_metadata(f"u{i}"))
    return True


async def _stream_get(client: CacheClient, i: int) -> bool:
    await client.get(_key(i), request_id=f"s{i}", deadline=None)
    return True


async def _round(client: CacheClient, pid: int, path, base: int, n: int,
                 burst: bool) -> tuple[float, float]:
    """(cache µs, router µs) per store of ``n`` stores, one after another or
    (``burst``) all at once."""
    cache_before, mine_before = cpu_ns(pid), time.process_time_ns()
    if burst:
        assert all(await asyncio.gather(*(path(client, base + i) for i in range(n))))
    for i in range(0 if burst else n):
        assert await path(client, base + i)
    await asyncio.sleep(0.1)  # the cache's side of the last one
    return (cpu_ns(pid) - cache_before) / n / 1e3, (time.process_time_ns() - mine_before) / n / 1e3


def _quartiles(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return f"{statistics.median(values):7.1f} [{q[0]:.1f}-{q[2]:.1f}]"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--stores", type=int, default=300, help="operations a round")
    parser.add_argument("--lookups", action="store_true",
                        help="time lookups (misses) instead of stores")
    args = parser.parse_args()
    unary, stream = (_unary_get, _stream_get) if args.lookups else (_unary, _stream)
    port_file = Path(tempfile.mkdtemp(prefix="llmesh-store-bench-")) / "port"
    cache = subprocess.Popen(
        [sys.executable, "-m", "services.cache", "--port", "0", "--metrics-port", "0",
         "--port-file", str(port_file), "--log-level", "warning"], env=child_env())
    try:
        while not port_file.exists() or not port_file.read_text().strip():
            await asyncio.sleep(0.05)
        port = json.loads(port_file.read_text())["grpc_port"]
        client = CacheClient(f"127.0.0.1:{port}")
        await client.wait_until_serving(30)
        paths = {"unary, one at a time": (unary, False), "stream, one at a time": (stream, False),
                 "unary, all at once": (unary, True), "stream, all at once": (stream, True)}
        for path, burst in paths.values():  # warm each (the stream's call opens here)
            await _round(client, cache.pid, path, 10_000_000, 50, burst)
        load = os.getloadavg()
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
        for r in range(args.rounds):
            for j, (name, (path, burst)) in enumerate(paths.items()):
                base = (r * len(paths) + j) * args.stores
                results[name].append(await _round(client, cache.pid, path, base, args.stores,
                                                  burst))
        what = "lookup" if args.lookups else "store"
        print(f"CPU µs per {what}, rounds of {args.stores} x {args.rounds} interleaved, "
              f"median [p25-p75]; load {load} -> {os.getloadavg()}")
        for name, rows in results.items():
            print(f"  {name:<22} cache {_quartiles([c for c, _ in rows])}  "
                  f"router side {_quartiles([m for _, m in rows])}")
        await client.close()
    finally:
        cache.terminate()
        cache.wait(10)


if __name__ == "__main__":
    asyncio.run(main())
