"""Slow-reader measurement (not CI): does one slow client hurt the others?

Starts a mesh (one engine, ``--max-model-len 2048``, router
``--client-write-timeout-s`` = ``--budget``), then:

1. baseline: 4 normal clients stream back to back for ``--seconds``; their
   median inter-token latency (ITL, client side: the gap before a
   token-carrying message shared by its tokens, see :func:`itl_per_token`)
   is recorded, and the median gap between messages beside it;
2. the same with one more client reading one message per second for
   ``--seconds`` (directly at the router, small receive window: see
   tests/e2e/slow_reader_client.py), plus one client that stops reading;
3. checks: normal clients' median ITL with the slow client within 1.2x of
   the baseline; each service's RSS growth < 50 MB over the run; the client
   that stopped reading was cancelled after the budget (its status is
   RESOURCE_EXHAUSTED) and the engine is idle afterwards (its blocks freed).

Usage::

    python -m benchmarks.slow_reader [--seconds 60] [--budget 5]

Prints a table and ``uptime``'s load average; exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import threading
import time

import grpc

from llmesh.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.e2e.hostile_checks import rss_by_service, rss_growth, wait_kv_idle
from tests.e2e.slow_reader_client import heavy_request, stalled_generate

NORMAL_CLIENTS = 4
ITL_RATIO_LIMIT = 1.2
RSS_LIMIT_MB = 50.0


async def _normal(stub, stop: float, gaps: list[tuple[float, int]]) -> None:
    request = generation_pb2.GenerateRequest(
        prompt="Write a long story about a lighthouse keeper.", bypass_cache=True,
        sampling=common_pb2.SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.0))
    while time.monotonic() < stop:
        last = None
        async for response in stub.Generate(request, timeout=120):
            if response.token_ids:
                now = time.monotonic()
                if last is not None:
                    gaps.append((now - last, len(response.token_ids)))
                last = now


async def normal_clients(ingress: str, seconds: float) -> list[tuple[float, int]]:
    """(gap in seconds, tokens in the message it ended) between token-carrying
    messages of NORMAL_CLIENTS clients streaming for ``seconds``."""
    gaps: list[tuple[float, int]] = []
    stop = time.monotonic() + seconds
    async with grpc.aio.insecure_channel(ingress) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        await asyncio.gather(*(_normal(stub, stop, gaps) for _ in range(NORMAL_CLIENTS)))
    return gaps


def itl_per_token(gaps: list[tuple[float, int]]) -> float:
    """Median inter-token latency (seconds): a message of ``k`` tokens after a
    gap ``g`` gives each of its tokens ``g / k`` (with speculative decoding a
    message carries every token a step accepted, so the gap between messages
    grows while the time per token falls; vLLM's TPOT divides the same way)."""
    return statistics.median(g / k for g, k in gaps for _ in range(k))


def slow_client(router: str, seconds: float, result: dict[str, object]) -> None:
    """Reads one message a second for ``seconds`` (a long answer, small window)."""
    channel = grpc.insecure_channel(router, options=[
        ("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)])
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    request = generation_pb2.GenerateRequest(
        prompt="Count slowly:", bypass_cache=True,
        sampling=common_pb2.SamplingParams(max_tokens=400, ignore_eos=True))
    stop = time.monotonic() + seconds
    read = 0
    code = "OK"
    try:
        while time.monotonic() < stop:
            for _ in stub.Generate(request, timeout=seconds + 60):
                read += 1
                time.sleep(1.0)
                if time.monotonic() >= stop:
                    break
    except grpc.RpcError as err:
        code = err.code().name
    finally:
        channel.close()
    result.update(read=read, code=code)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--budget", type=float, default=5.0,
                        help="the router's --client-write-timeout-s (seconds)")
    args = parser.parse_args(argv)
    from services.cli.mesh import Mesh
    with Mesh(ingress_port=0, admin_port=0,
              engine_args=["--max-model-len", "2048"],
              router_args=["--client-write-timeout-s", f"{args.budget:g}"]) as mesh:
        engines = [e.grpc_address for e in mesh.engines]
        asyncio.run(normal_clients(mesh.ingress_address, 3))  # warm-up
        rss_start = rss_by_service(mesh)
        baseline = asyncio.run(normal_clients(mesh.ingress_address, args.seconds))
        slow: dict[str, object] = {}
        reader = threading.Thread(target=slow_client,
                                  args=(mesh.router.grpc_address, args.seconds, slow))
        reader.start()
        stalled = stalled_generate(mesh.router.grpc_address, heavy_request(),
                                   timeout_s=args.seconds + 60)
        with_slow = asyncio.run(normal_clients(mesh.ingress_address, args.seconds))
        reader.join()
        _, stalled_code, stalled_details = stalled.resume()
        idle = True
        try:
            wait_kv_idle(engines, 10)
        except AssertionError:
            idle = False
        grown = rss_growth(rss_start, rss_by_service(mesh))
    base_itl, slow_itl = itl_per_token(baseline), itl_per_token(with_slow)
    ratio = slow_itl / base_itl
    base_gap = statistics.median(g for g, _ in baseline)
    slow_gap = statistics.median(g for g, _ in with_slow)
    load = os.getloadavg()
    print(f"normal clients: {NORMAL_CLIENTS}, {args.seconds:g} s per phase, budget "
          f"{args.budget:g} s")
    print(f"{'median ITL without slow client':<40}{base_itl * 1e3:>10.2f} ms per token "
          f"({sum(k for _, k in baseline)} tokens; median gap between messages "
          f"{base_gap * 1e3:.2f} ms, {len(baseline)} gaps)")
    print(f"{'median ITL with slow client':<40}{slow_itl * 1e3:>10.2f} ms per token "
          f"({sum(k for _, k in with_slow)} tokens; median gap between messages "
          f"{slow_gap * 1e3:.2f} ms, {len(with_slow)} gaps)")
    print(f"{'ratio (limit 1.2)':<40}{ratio:>10.3f}")
    print(f"slow client read {slow.get('read')} messages, ended {slow.get('code')}")
    print(f"stopped client ended {stalled_code.name}: {stalled_details[:120]}")
    print(f"engine idle afterwards: {idle}")
    for name, mb in grown.items():
        print(f"{'RSS growth ' + name:<40}{mb:>+10.1f} MB")
    print(f"load average (1, 5, 15 min): {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    failed = (ratio > ITL_RATIO_LIMIT or not idle
              or stalled_code != grpc.StatusCode.RESOURCE_EXHAUSTED
              or any(mb >= RSS_LIMIT_MB for mb in grown.values()))
    print("verdict:", "FAIL" if failed else "PASS")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
