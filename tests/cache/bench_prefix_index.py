"""Latency of PrefixIndex.score, in process, for the memory store and Redis on loopback.

Scores a 2,000-token prompt (125 chained hashes at block size 16) against N
replicas of B entries each; replica i holds the prompt's first 125 // (i + 1)
blocks (the rest of its entries are other prompts' blocks), or, in the
``all`` rows, every replica holds all 125 (the most work a score can do):

    python tests/cache/bench_prefix_index.py [--calls 2000] [--runs 3]

Prints, per store and case, the median of the runs' p50s and p99s in
microseconds (for Redis also the script's own time per call, from ``INFO
commandstats``: the rest is the round trip and the client), and the load
average before and after. Redis is a throwaway
valkey server (tests/cache/redis_server.py). Not collected by pytest (no
``test_`` prefix).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "services" / "gen")]

import redis  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

from services.cache.metrics import CacheMetrics  # noqa: E402
from services.cache.prefix_index import (  # noqa: E402
    MemoryPrefixIndex,
    PrefixIndex,
    RedisPrefixIndex,
)
from services.common.block_hash import block_hash_seed, prompt_block_hashes  # noqa: E402
from tests.cache.redis_server import start_redis_server  # noqa: E402

PROMPT = prompt_block_hashes(block_hash_seed("bench"), list(range(2000)), 16)  # 125 hashes
#: (replicas, entries per replica, every replica holds the whole prompt)
CASES = ((2, 1000, False), (4, 2000, False), (8, 4000, False), (8, 4000, True))


async def fill(index: PrefixIndex, replicas: int, blocks: int, all_hold: bool) -> None:
    for replica in range(replicas):
        leading = PROMPT if all_hold else PROMPT[:len(PROMPT) // (replica + 1)]
        filler = prompt_block_hashes(block_hash_seed(f"filler-{replica}"),
                                     list(range(16 * (blocks - len(leading)))), 16)
        await index.register(f"r{replica}", 1, blocks)
        assert await index.replace(f"r{replica}", 1, [*leading, *filler])


async def time_scores(index: PrefixIndex, calls: int) -> tuple[float, float]:
    samples = []
    for _ in range(calls):
        started = time.perf_counter()
        await index.score(PROMPT)
        samples.append(time.perf_counter() - started)
    samples.sort()
    return statistics.median(samples), samples[int(0.99 * len(samples)) - 1]


async def bench(index: PrefixIndex, case: tuple[int, int, bool], calls: int,
                runs: int, server: redis.Redis) -> tuple[float, float]:
    await index.start()
    await fill(index, *case)
    await time_scores(index, calls // 4)  # warm-up
    server.config_resetstat()
    results = [await time_scores(index, calls) for _ in range(runs)]
    await index.close()
    return statistics.median(m for m, _ in results), statistics.median(p for _, p in results)


def make(kind: str, url: str, case: tuple[int, int, bool]) -> PrefixIndex:
    metrics = CacheMetrics.create(CollectorRegistry())
    if kind == "memory":
        return MemoryPrefixIndex(liveness_ttl_s=600, metrics=metrics)
    prefix = f"bench:{case[0]}x{case[1]}{'all' if case[2] else ''}:"
    return RedisPrefixIndex(url, key_prefix=prefix, liveness_ttl_s=600, metrics=metrics)


def describe(case: tuple[int, int, bool]) -> str:
    replicas, blocks, all_hold = case
    return f"{replicas} replicas x {blocks:4} blocks{' (all hold 125)' if all_hold else ' ' * 15}"


def script_time(kind: str, client: redis.Redis) -> str:
    """The Redis script's own time per call since the last reset ("" for memory)."""
    if kind != "redis":
        return ""
    stats = client.info("commandstats")["cmdstat_evalsha"]
    return f"   (script {stats['usec_per_call']:6.1f} us)"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    print("load average before: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    server = start_redis_server()
    client = redis.Redis.from_url(server.url)
    try:
        for kind in ("memory", "redis"):
            for case in CASES:
                median, p99 = asyncio.run(bench(make(kind, server.url, case), case,
                                                args.calls, args.runs, client))
                print(f"{kind:6} {describe(case)}  p50 {median * 1e6:7.1f} us   "
                      f"p99 {p99 * 1e6:7.1f} us{script_time(kind, client)}")
    finally:
        client.close()
        server.stop()
    print("load average after:  {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))


if __name__ == "__main__":
    main()
