"""Soak: N mixed requests at 16 concurrent against a mesh, then the mesh must
be exactly as it was.

The mix (seeded, so a run repeats): complete generations, client cancels
mid-stream (``Generate`` dropped after its first delta; ``GenerateStream``
``cancel``), stop strings, short deadlines (50-300 ms), and about two in a
hundred clients killed: a subprocess client SIGKILLed after its first delta.
Traffic goes through Envoy's ingress.

Resident memory (``VmRSS``) of every process of the mesh, Envoy included, is
read three times: at the start (the mesh SERVING, no request yet), after a
warm-up pass of 32 requests of the same mix (the first requests allocate
what every later one reuses: allocator arenas, gRPC and HTTP/2 buffers,
tokenizer and detokenizer caches, the model's first-forward workspaces), and
at the end. The limit is measured from the warm-up value, so that it sees
growth under traffic, not those one-time allocations; the table and the JSON
report all three, so what the warm-up took stays visible.

At the end (exit status 1 when one fails):

* KV pool idle on every engine: no running or waiting sequence, KV usage 0
  (free + cached blocks == total; ``GetLoad``), within 10 s;
* the RSS of each process (services and Envoy) within +50 MB of its value
  after the warm-up;
* every process still runs under the PID it had at the start (nothing died
  or restarted), the services SERVING and Envoy ready;
* 0 lost requests: every request ended with a final message, a status, or
  the client's own cancel or death;
* no INTERNAL / UNKNOWN / UNAVAILABLE status (nothing failed here).

Usage::

    python -m benchmarks.soak                      # starts a mesh, 10,000 requests
    python -m benchmarks.soak --requests 500 --json soak.json
    python -m benchmarks.soak --url 127.0.0.1:8080 --run-dir /tmp/llmesh-XXXX

With ``--url`` the mesh is one ``llmesh up`` started (its ``--run-dir`` holds
the port files with each service's PID and ports; Envoy is found by its
config path there). tests/e2e/test_mesh_soak.py runs :func:`soak` with 500
requests and the same checks.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from llmesh.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.e2e.hostile_checks import (
    Watched,
    problems,
    rss_growth,
    rss_mb,
    wait_kv_idle,
    watched,
    watched_from_run_dir,
)

KINDS = ("complete", "cancel", "stop", "deadline", "stream_cancel", "killed")
#: Share of each kind in the mix (killed clients are subprocesses: ~2 %).
WEIGHTS = (40, 15, 20, 10, 13, 2)
RSS_LIMIT_MB = 50.0
KV_IDLE_WITHIN_S = 10.0
#: A request that has not ended after this long is lost.
LOST_AFTER_S = 60.0
WARMUP_REQUESTS = 32
BAD_CODES = ("INTERNAL", "UNKNOWN", "UNAVAILABLE")

_PROMPTS = ["Tell me about the sea.", "List three colours:", "Count: one, two,",
            "Write a haiku about mountains.", "What is 2 + 2?", "Name a famous painter."]


@dataclass
class SoakReport:
    """What a soak measured, and its verdict.

    Attributes:
      requests: requests in the measured mix (the warm-up not counted).
      seconds: wall time of the measured mix.
      outcomes: ``kind:outcome`` → count.
      lost: requests that did not end within LOST_AFTER_S.
      rss_start: process name → resident MB with the mesh SERVING, before any request.
      rss_before: process name → resident MB after the warm-up (the limit's base).
      rss_after: process name → resident MB at the end.
      kv_idle: every engine's KV pool was idle at the end.
      kv_detail: the engines' loads when they were not.
      failures: one line per failed check (empty: PASS).
    """

    requests: int = 0
    seconds: float = 0.0
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    lost: int = 0
    rss_start: dict[str, float] = field(default_factory=dict)
    rss_before: dict[str, float] = field(default_factory=dict)
    rss_after: dict[str, float] = field(default_factory=dict)
    kv_idle: bool = False
    kv_detail: str = ""
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def table(self) -> str:
        """A plain-text table of the run (RSS in MB)."""
        lines = [f"{self.requests} requests in {self.seconds:.1f} s "
                 f"({self.requests / max(self.seconds, 1e-9):.1f} req/s)", "",
                 f"{'outcome':<34}{'count':>8}"]
        lines += [f"{k:<34}{v:>8}" for k, v in sorted(self.outcomes.items())]
        lines += ["", f"{'process':<16}{'RSS start':>11}{'warmed up':>11}{'end':>9}"
                      f"{'growth':>9}  (MB; growth = end - warmed up, limit +{RSS_LIMIT_MB:g})"]
        for name, grown in rss_growth(self.rss_before, self.rss_after).items():
            start = self.rss_start.get(name, float("nan"))
            lines.append(f"{name:<16}{start:>11.1f}{self.rss_before[name]:>11.1f}"
                         f"{self.rss_after[name]:>9.1f}{grown:>+9.1f}")
        lines += ["", f"lost requests: {self.lost}",
                  f"KV pool idle: {self.kv_idle} {self.kv_detail}",
                  "verdict: " + ("PASS" if self.ok else "FAIL: " + "; ".join(self.failures))]
        return "\n".join(lines)

    def as_dict(self) -> dict[str, object]:
        """The report as JSON-ready values (RSS in MB per process)."""
        return {
            "requests": self.requests, "seconds": round(self.seconds, 3),
            "outcomes": dict(sorted(self.outcomes.items())), "lost": self.lost,
            "rss_mb": {name: {"start": self.rss_start.get(name),
                              "after_warmup": self.rss_before[name],
                              "end": self.rss_after.get(name),
                              "growth": grown}
                       for name, grown in rss_growth(self.rss_before, self.rss_after).items()},
            "rss_limit_mb": RSS_LIMIT_MB,
            "kv_idle": self.kv_idle, "kv_detail": self.kv_detail,
            "ok": self.ok, "failures": list(self.failures),
        }


def _request(rng: random.Random, max_tokens: int, **sampling: object
             ) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        prompt=f"{rng.choice(_PROMPTS)} ({rng.randrange(10**6)})",
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, **sampling),
        bypass_cache=rng.random() < 0.5)


async def _complete(stub, rng: random.Random, kind: str) -> str:
    if kind == "stop":
        request = _request(rng, 16, stop=[" the", ".", "\n"], temperature=0.0)
    else:
        request = _request(rng, rng.randint(1, 8), temperature=rng.choice([0.0, 0.7]))
    timeout = rng.uniform(0.05, 0.3) if kind == "deadline" else LOST_AFTER_S
    final = None
    try:
        async for response in stub.Generate(request, timeout=timeout):
            if response.finish_reason:
                final = response
    except grpc.aio.AioRpcError as err:
        return err.code().name
    return "final" if final is not None else "LOST"


async def _cancel(stub, rng: random.Random) -> str:
    call = stub.Generate(_request(rng, 64, ignore_eos=True), timeout=LOST_AFTER_S)
    try:
        async for response in call:
            if response.token_ids or response.finish_reason:
                call.cancel()
                return "client_cancelled"
    except grpc.aio.AioRpcError as err:
        return "client_cancelled" if err.code() == grpc.StatusCode.CANCELLED else err.code().name
    return "final"


async def _stream_cancel(stub, rng: random.Random) -> str:
    requests: asyncio.Queue[generation_pb2.GenerateStreamRequest | None] = asyncio.Queue()

    async def outgoing():
        while (item := await requests.get()) is not None:
            yield item

    call = stub.GenerateStream(outgoing(), timeout=LOST_AFTER_S)
    await requests.put(generation_pb2.GenerateStreamRequest(start=_request(
        rng, 64, ignore_eos=True)))
    cancelled = False
    try:
        async for message in call:
            response = message.response
            if response.finish_reason:
                await requests.put(None)
                return ("stream_cancelled" if response.finish_reason
                        == common_pb2.FINISH_REASON_CANCELLED else "final")
            if not cancelled and rng.random() < 0.7:
                cancelled = True
                await requests.put(generation_pb2.GenerateStreamRequest(
                    cancel=generation_pb2.CancelGeneration()))
    except grpc.aio.AioRpcError as err:
        return err.code().name
    return "LOST"


async def _killed(ingress: str) -> str:
    """A subprocess client that starts a stream and is SIGKILLed after its first delta."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "benchmarks.soak", "--client", ingress,
        stdout=asyncio.subprocess.PIPE, cwd=str(Path(__file__).resolve().parents[1]))
    try:
        line = await asyncio.wait_for(process.stdout.readline(), LOST_AFTER_S)
    finally:
        process.send_signal(signal.SIGKILL)
        await process.wait()
    return "client_killed" if line.strip() == b"started" else "killed_before_start"


def _client(ingress: str) -> None:
    """``--client``: one long stream; prints "started" at its first delta, then reads on."""
    with grpc.insecure_channel(ingress) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        request = generation_pb2.GenerateRequest(
            prompt="Count from one to one hundred:", bypass_cache=True,
            sampling=common_pb2.SamplingParams(max_tokens=128, ignore_eos=True))
        for response in stub.Generate(request, timeout=LOST_AFTER_S):
            if response.token_ids:
                print("started", flush=True)


async def run_mix(ingress: str, requests: int, concurrency: int, seed: int
                  ) -> collections.Counter[str]:
    """Sends ``requests`` mixed requests, ``concurrency`` at a time; returns
    outcome counts (``kind:outcome``)."""
    rng = random.Random(seed)
    plan = rng.choices(KINDS, WEIGHTS, k=requests)
    outcomes: collections.Counter[str] = collections.Counter()
    next_index = 0
    async with grpc.aio.insecure_channel(ingress) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)

        async def one(kind: str, case_rng: random.Random) -> str:
            if kind == "cancel":
                return await _cancel(stub, case_rng)
            if kind == "stream_cancel":
                return await _stream_cancel(stub, case_rng)
            if kind == "killed":
                return await _killed(ingress)
            return await _complete(stub, case_rng, kind)

        async def worker() -> None:
            nonlocal next_index
            while next_index < len(plan):
                index = next_index
                next_index += 1
                kind = plan[index]
                try:
                    outcome = await asyncio.wait_for(
                        one(kind, random.Random(seed * 1_000_003 + index)), LOST_AFTER_S + 5)
                except TimeoutError:
                    outcome = "LOST"
                outcomes[f"{kind}:{outcome}"] += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes


def _rss(processes: list[Watched]) -> dict[str, float]:
    """Process name → resident MB, for those that still run."""
    found = {}
    for process in processes:
        try:
            found[process.name] = rss_mb(process.pid)
        except (OSError, RuntimeError):  # gone: problems() reports it
            pass
    return found


def soak(ingress: str, processes: list[Watched], engines: list[str], *, requests: int,
         concurrency: int = 16, seed: int = 1) -> SoakReport:
    """Records RSS, warms up, records RSS again, runs the mix, then checks KV,
    RSS, the processes, lost requests and error statuses (see the module doc).

    Args:
      ingress: Envoy's ingress ``host:port``.
      processes: every process of the mesh, Envoy included (:func:`watched`).
      engines: the engines' gRPC addresses (their KV pools are checked).
      requests: requests in the measured mix; concurrency: at once; seed: the mix's.
    """
    report = SoakReport(requests=requests)
    report.rss_start = _rss(processes)
    asyncio.run(run_mix(ingress, WARMUP_REQUESTS, concurrency, seed + 10_000))
    wait_kv_idle(engines, KV_IDLE_WITHIN_S)
    report.rss_before = _rss(processes)
    started = time.monotonic()
    report.outcomes = asyncio.run(run_mix(ingress, requests, concurrency, seed))
    report.seconds = time.monotonic() - started
    try:
        loads = wait_kv_idle(engines, KV_IDLE_WITHIN_S)
        report.kv_idle = True
        report.kv_detail = f"({len(loads)} engine(s): 0 running, 0 waiting, usage 0)"
    except AssertionError as err:
        report.kv_detail = str(err)
        report.failures.append(f"KV pool not idle: {err}")
    report.rss_after = _rss(processes)
    for name, grown in rss_growth(report.rss_before, report.rss_after).items():
        if grown > RSS_LIMIT_MB:
            report.failures.append(f"{name} RSS grew {grown:.1f} MB (> {RSS_LIMIT_MB:g})")
    report.failures.extend(problems(processes))
    report.lost = sum(v for k, v in report.outcomes.items() if k.endswith(":LOST"))
    if report.lost:
        report.failures.append(f"{report.lost} lost requests")
    bad = {k: v for k, v in report.outcomes.items() if k.split(":")[1] in BAD_CODES}
    if bad:
        report.failures.append(f"error statuses: {bad}")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--url", help="ingress host:port of a running mesh (with --run-dir)")
    parser.add_argument("--run-dir", type=Path, help="the running mesh's run directory")
    parser.add_argument("--json", type=Path, help="also write the report here as JSON")
    parser.add_argument("--client", help=argparse.SUPPRESS)  # the killed-client subprocess
    args = parser.parse_args(argv)
    if args.client:
        _client(args.client)
        return 0
    if args.url:
        if args.run_dir is None:
            parser.error("--url needs --run-dir (for the processes' PIDs and engine ports)")
        processes, engines = watched_from_run_dir(args.run_dir)
        if not any(p.name == "envoy" for p in processes):
            parser.error(f"no Envoy runs {args.run_dir / 'envoy.yaml'}")
        report = soak(args.url, processes, engines, requests=args.requests,
                      concurrency=args.concurrency, seed=args.seed)
    else:
        from services.cli.mesh import Mesh
        with Mesh(ingress_port=0, admin_port=0,
                  engine_args=["--max-model-len", "512"]) as mesh:
            report = soak(mesh.ingress_address, watched(mesh),
                          [e.grpc_address for e in mesh.engines], requests=args.requests,
                          concurrency=args.concurrency, seed=args.seed)
    print(report.table())
    if args.json is not None:
        args.json.write_text(json.dumps(report.as_dict(), indent=2) + "\n")
    return 0 if report.ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
