"""What the mesh adds to latency and CPU: Envoy → router → engine vs the engine in process.

One run gives every number of the mesh's latency budget (docs/architecture.md
"What the mesh costs"), in one process, the two paths **interleaved**
(in-process, mesh, in-process, mesh …; the order flips every round so that
neither path always follows the other) for ``--rounds`` rounds each:

Both engines (the mesh's and the in-process one) get the same thread
settings: the thread governor (the engines' default) or, with
``--no-adaptive-threads``, ``--num-threads`` fixed step threads, so that
neither path runs with a governor the other lacks.

* **1 stream**: one greedy chat answer of ``--max-tokens`` tokens (EOS
  ignored, so every run has the same length) per round and path, each after
  ``--settle`` seconds of pause (an idle mesh, as a lone user meets it);
* **``--concurrency`` streams** (default 16): ``--num-requests`` distinct chat
  prompts, ``--concurrency`` at a time, per round and path, after an
  uncounted warm-up of each path at full batch; during each mesh round the
  router's, tokenizer's and Envoy's CPU seconds (user + system, from
  ``/proc/PID/stat``, :func:`mesh_cpu.cpu_seconds`) are read before and after.

* **``--attribute N``** (after the one-stream part): where a first token's
  time goes, per hop. N interleaved rounds of one max_tokens=1 request per
  path (in process, through Envoy, straight to the router, the engine over
  gRPC), each alone after ``--settle`` seconds. Per request: the client's
  TTFT; the engine's step time for it (the delta of the mesh engine's
  ``llmesh:engine_step_duration_seconds`` around the request, the in-process
  engine's from its step observer; requests that did not take exactly one
  step are counted in a note) and the threads it ran on; the router's own
  TTFT (the delta of its ``llmesh:time_to_first_token_seconds``). Prints per
  path, median [p25-p75] in ms, the columns of
  ``latency_attribution.COLUMNS``: client TTFT and its excess over in
  process in the same round, the step and its excess over in process's
  (``step_inflation``), client TTFT − step and its excess over in process's
  (``outside_overhead``: what the hops add, free of the step's spread),
  router TTFT − step, client TTFT − router TTFT; then CPU ms per request of
  the meshes' processes (the second mesh's as ``NAME[B]``;
  ``/proc/PID/task/*/schedstat``, ns) and of
  this one (``client``: ``time.process_time_ns``, the in-process engine's
  threads included), each less its idle rate measured over a few seconds
  first (in 6 windows: each cell is printed ± what the idle rate's
  standard error amounts to per request, and reads 0.00 where it came out
  below 0 within 2 standard errors). Helpers: ``latency_attribution.py``.

Paths: **in-process** is the torch backend called directly (no gRPC, prompt
ids from the tokenizer in this process); **mesh** is the same chat through
Envoy's ingress (with ``--session``, also **mesh session** in the one-stream
part: each request a ``start`` on one long-lived ``GenerateStream`` call
through Envoy) (``llmesh up`` started here on free ports, or ``--url`` of a
running mesh, then without CPU accounting), response cache bypassed.

Per run: TTFT (seconds from sending to the first token), TPOT ((e2e − TTFT) /
(tokens − 1)), ITL (mean gap between streamed messages) and output throughput
(tokens / e2e at 1 stream; all tokens / wall time of the round at N streams,
whose TTFT / TPOT / ITL are the round's medians). Prints, per path and
metric, the median over the rounds with the interquartile range (p25-p75)
beside it, the mesh's overhead (difference of the medians) against the
targets, CPU-s per 1,000 output tokens per process, and the load average
before and after.

Usage: ``flock -x /tmp/llmesh-cpu.lock python benchmarks/mesh_latency.py
[--rounds 5] [--max-tokens 128] [--concurrency 16 --num-requests 32]
[--hops] [--attribute 25] [--url HOST:PORT]
[--router-arg=--no-tokenize-in-router]`` (``--concurrency 1``: the
one-stream part only; the one-stream part's CPU per request is read from
schedstat too). The mesh's rounds begin once its router makes
prompt ids in process (its default; ``--router-arg`` passes router flags).
``--compare-router-from DIR`` / ``--compare-router-arg ARG`` start a second
mesh whose router runs another checkout's code / gets more flags, measured as
one more path in the same interleaved rounds (a router's before/after);
``--compare-engine-from DIR``, ``--compare-tokenizer-from DIR`` and
``--compare-cache-from DIR`` do the same for the engine, the tokenizer and
the cache service (given together, one second mesh runs each from its
checkout).
Not a test: numbers depend on the machine (2 cores here).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

sys.path[:0] = [str(Path(__file__).resolve().parent)]

from llmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc, generation_pb2, generation_pb2_grpc  # noqa: E402
from latency_attribution import (  # noqa: E402
    BASE, CLAMP_STDERRS, ROUTER_TTFT, EngineReading, IdleRate, Sample, cpu_ms_per_request,
    cpu_ns, engine_reading, format_hops, histogram_delta, histogram_sum_count, hop_rows,
    idle_rate, multi_step, path_order, quartiles, scrape, thread_mix)
from mesh_cpu import MESH_OVERHEAD, cpu_seconds  # noqa: E402
from services.cli.mesh import Mesh  # noqa: E402
from services.common.model_files import default_model_path  # noqa: E402
from services.common.sampling import SamplingOptions  # noqa: E402
from services.engine.config import EngineConfig  # noqa: E402
from services.engine.torch_backend.backend import TorchBackend  # noqa: E402
from services.engine.types import SequenceRequest, StepStats  # noqa: E402
from services.tokenizer.tokenizer import ChatMessage, Tokenizer  # noqa: E402

QUESTION = "Explain in a few sentences why the sky is blue."
#: Default pause before each run (seconds), so that no path starts on cores
#: still busy with the previous one (``--settle``).
SETTLE_SECONDS = 0.3
#: The budget (docs/architecture.md): mesh minus in-process, medians.
TARGETS = {"ttft_ms": 3.0, "tpot_ms": 0.3}
THROUGHPUT_TARGET = 0.95
CPU_TARGET = 0.2  # CPU-s per 1,000 output tokens, router + tokenizer + Envoy


@dataclass(frozen=True)
class Run:
    """One generation's timings (seconds) and token count."""

    ttft: float
    e2e: float
    tokens: int
    gaps: tuple[float, ...]

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / max(self.tokens - 1, 1)


def _run(start: float, stamps: list[float], tokens: int) -> Run:
    gaps = tuple(b - a for a, b in zip(stamps, stamps[1:]))
    return Run(ttft=stamps[0] - start, e2e=stamps[-1] - start, tokens=tokens, gaps=gaps)


async def run_in_process(backend: TorchBackend, prompt_ids: tuple[int, ...], n: int,
                         request_id: str) -> Run:
    request = SequenceRequest(request_id=request_id, prompt_token_ids=prompt_ids,
                              sampling=SamplingOptions(max_tokens=n, ignore_eos=True))
    start = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    async for delta in backend.generate(request):
        if delta.token_ids:
            stamps.append(time.perf_counter())
            tokens += len(delta.token_ids)
    return _run(start, stamps, tokens)


def _chat_request(question: str, n: int) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        chat=generation_pb2.Chat(messages=[common_pb2.ChatMessage(role="user", content=question)]),
        sampling=common_pb2.SamplingParams(max_tokens=n, ignore_eos=True), bypass_cache=True)


async def run_mesh(stub: generation_pb2_grpc.GenerationServiceStub,
                   request: generation_pb2.GenerateRequest) -> Run:
    start = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    async for response in stub.Generate(request, timeout=600):
        if response.token_ids:
            stamps.append(time.perf_counter())
            tokens += len(response.token_ids)
    return _run(start, stamps, tokens)


async def _run_mesh_path(stub: generation_pb2_grpc.GenerationServiceStub,
                         request: generation_pb2.GenerateRequest, request_id: str) -> Run:
    return await run_mesh(stub, request)


class StreamSession:
    """One long-lived ``GenerateStream`` call through Envoy, opened at its first
    run: each run is a ``start`` on it, read up to the message with a finish
    reason (a backend that holds one stream per worker pays no new call per
    request: no HTTP/2 stream set-up, headers or server call object)."""

    def __init__(self, stub: generation_pb2_grpc.GenerationServiceStub) -> None:
        self._stub = stub
        self._call: grpc.aio.StreamStreamCall | None = None

    async def run(self, request: generation_pb2.GenerateRequest, request_id: str) -> Run:
        if self._call is None:
            self._call = self._stub.GenerateStream(timeout=3600)
        start = time.perf_counter()
        stamps: list[float] = []
        tokens = 0
        await self._call.write(generation_pb2.GenerateStreamRequest(start=request))
        while True:
            message = await self._call.read()
            if message is grpc.aio.EOF:
                raise RuntimeError("the GenerateStream session ended under a run")
            if message.response.token_ids:
                stamps.append(time.perf_counter())
                tokens += len(message.response.token_ids)
            if message.response.finish_reason:
                return _run(start, stamps, tokens)

    def close(self) -> None:
        if self._call is not None:
            self._call.cancel()


async def run_engine_grpc(stub: engine_pb2_grpc.EngineServiceStub, prompt_ids: tuple[int, ...],
                          n: int, request_id: str) -> Run:
    """The engine alone over gRPC (its one-request ``Generate``): the engine hop's share."""
    start_msg = engine_pb2.EngineServiceGenerateRequest(start=engine_pb2.EngineRequest(
        request_id=request_id, prompt_token_ids=prompt_ids,
        sampling=SamplingOptions(max_tokens=n, ignore_eos=True).to_pb()))
    start = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    async for response in stub.Generate(iter([start_msg]), timeout=600):
        if response.token_ids:
            stamps.append(time.perf_counter())
            tokens += len(response.token_ids)
    return _run(start, stamps, tokens)


async def _bounded(concurrency: int, jobs: list[Callable[[], Awaitable[Run]]]
                   ) -> tuple[float, list[Run]]:
    """Runs the coroutine factories ``jobs``, ``concurrency`` at a time; returns
    (wall seconds, runs)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(job: Callable[[], Awaitable[Run]]) -> Run:
        async with gate:
            return await job()

    began = time.perf_counter()
    runs = await asyncio.gather(*(one(job) for job in jobs))
    return time.perf_counter() - began, list(runs)


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _print_table(title: str, rows: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    """Prints median [p25-p75] per path and metric; returns the medians."""
    print(title)
    medians: dict[str, dict[str, float]] = {}
    for name, metrics in rows.items():
        cells = []
        medians[name] = {}
        for metric, values in metrics.items():
            med, q1, q3 = quartiles(values)
            medians[name][metric] = med
            cells.append(f"{metric}={med:8.2f} [{q1:.2f}-{q3:.2f}]")
        print(f"  {name:<14} " + "  ".join(cells))
    return medians


def _print_overhead(medians: dict[str, dict[str, float]],
                    targets: dict[str, float]) -> None:
    """Prints each path's median minus in-process's, judged against ``targets``."""
    base = medians["in-process"]
    for name, row in medians.items():
        if name == "in-process":
            continue
        parts = []
        for metric in ("ttft_ms", "tpot_ms", "itl_ms"):
            over = row[metric] - base[metric]
            target = targets.get(metric)
            verdict = "" if target is None else (" ok" if over <= target else
                                                 f" MISSES <= {target}")
            parts.append(f"{metric}={over:+7.2f}{verdict}")
        ratio = row["tok_s"] / base["tok_s"]
        print(f"  overhead of {name:<14} " + "  ".join(parts) + f"  tok_s ratio={ratio:.3f}")


async def one_stream(backend: TorchBackend, prompt_ids: tuple[int, ...],
                     paths: dict[str, Callable[[str], Awaitable[Run]]],
                     pids: dict[str, dict[str, int]], *, rounds: int, max_tokens: int,
                     settle: float) -> None:
    """Interleaved single-stream runs of every path (one uncounted warm-up
    round), and each mesh process's CPU per request in the runs of the mesh
    paths through Envoy (``pids``: path → process name → PID)."""
    jobs: dict[str, Callable[[str], Awaitable[Run]]] = {
        "in-process": lambda rid: run_in_process(backend, prompt_ids, max_tokens, rid), **paths}
    results: dict[str, list[Run]] = {name: [] for name in jobs}
    cpu = {path: {name: [] for name in procs} for path, procs in pids.items()}
    load_before = _load()
    for i in range(rounds + 1):
        for name in path_order(list(jobs), i):
            time.sleep(settle)
            procs = pids.get(name, {})
            before = {n: cpu_ns(pid) for n, pid in procs.items()}
            run = await jobs[name](f"bench-1-{i}-{name}")
            if i:
                results[name].append(run)
                for n, pid in procs.items():
                    cpu[name][n].append((cpu_ns(pid) - before[n]) / 1e6)
    rows = {name: {"ttft_ms": [r.ttft * 1e3 for r in runs],
                   "tpot_ms": [r.tpot * 1e3 for r in runs],
                   "itl_ms": [statistics.fmean(r.gaps) * 1e3 for r in runs],
                   "tok_s": [r.tokens / r.e2e for r in runs]}
            for name, runs in results.items()}
    medians = _print_table(
        f"1 stream: {len(prompt_ids)}-token chat prompt, {max_tokens} greedy tokens, "
        f"{rounds} interleaved rounds, median [p25-p75]; load {load_before} -> {_load()}", rows)
    _print_overhead(medians, TARGETS)
    for path, per_process in cpu.items():
        print(f"  CPU-ms per request of the {path} runs (schedstat, idle included), "
              "median [p25-p75]: " + ", ".join(
                  f"{n} {quartiles(v)[0]:.1f} [{quartiles(v)[1]:.1f}-{quartiles(v)[2]:.1f}]"
                  for n, v in sorted(per_process.items())))


async def many_streams(backend: TorchBackend, tokenizer: Tokenizer,
                       stubs: dict[str, generation_pb2_grpc.GenerationServiceStub],
                       pids: dict[str, dict[str, int]], *, concurrency: int, num_requests: int,
                       max_tokens: int, rounds: int, settle: float) -> None:
    """Interleaved rounds of ``num_requests`` chats, ``concurrency`` at a time,
    in process and through each mesh of ``stubs`` (path → its ingress), with
    the mesh processes' CPU per 1,000 output tokens (``pids``: path → process
    name → PID)."""
    questions = [f"Question {i}: {QUESTION}" for i in range(num_requests)]
    prompts = [tuple(tokenizer.apply_chat_template(
        [ChatMessage(role="user", content=q)], add_generation_prompt=True).token_ids)
        for q in questions]
    requests = [_chat_request(q, max_tokens) for q in questions]
    # Warm every path at full batch first, uncounted.
    for stub in stubs.values():
        await _bounded(concurrency, [functools.partial(
            run_mesh, stub, _chat_request(f"Warm-up {i}: {QUESTION}", 8))
            for i in range(concurrency)])
    await _bounded(concurrency, [functools.partial(
        run_in_process, backend, prompts[i % len(prompts)], 8, f"warm-{i}")
        for i in range(concurrency)])
    rows: dict[str, dict[str, list[float]]] = {
        name: {"ttft_ms": [], "tpot_ms": [], "itl_ms": [], "tok_s": []}
        for name in ("in-process", *stubs)}
    cpu = {path: {name: [] for name in procs} for path, procs in pids.items()}
    load_before = _load()
    for r in range(rounds):
        for name in path_order(list(rows), r):
            time.sleep(settle)
            if name == "in-process":
                jobs = [functools.partial(run_in_process, backend, p, max_tokens, f"b-{r}-{i}")
                        for i, p in enumerate(prompts)]
                wall, runs = await _bounded(concurrency, jobs)
            else:
                procs = pids.get(name, {})
                before = {n: cpu_seconds(pid) for n, pid in procs.items()}
                wall, runs = await _bounded(
                    concurrency, [functools.partial(run_mesh, stubs[name], q) for q in requests])
                tokens = sum(run.tokens for run in runs)
                for n, pid in procs.items():
                    cpu[name][n].append((cpu_seconds(pid) - before[n]) / tokens * 1e3)
            row = rows[name]
            row["ttft_ms"].append(statistics.median(x.ttft for x in runs) * 1e3)
            row["tpot_ms"].append(statistics.median(x.tpot for x in runs) * 1e3)
            row["itl_ms"].append(statistics.median(statistics.fmean(x.gaps) for x in runs) * 1e3)
            row["tok_s"].append(sum(x.tokens for x in runs) / wall)
    medians = _print_table(
        f"{concurrency} streams: {num_requests} chats x {max_tokens} tokens per round, "
        f"{rounds} interleaved rounds (per round: median TTFT/TPOT/ITL, all tokens / wall), "
        f"median [p25-p75]; load {load_before} -> {_load()}", rows)
    _print_overhead(medians, {})
    for path in stubs:
        ratios = [m / i for m, i in zip(rows[path]["tok_s"], rows["in-process"]["tok_s"])]
        med, q1, q3 = quartiles(ratios)
        print(f"  {path} / in-process throughput per round: median {med:.3f} "
              f"[{q1:.3f}-{q3:.3f}] (target >= {THROUGHPUT_TARGET})")
    for path, per_process in cpu.items():
        print(f"  CPU-s per 1,000 output tokens in the {path} rounds, median [p25-p75]:")
        overhead = [sum(per_process[n][k] for n in MESH_OVERHEAD if n in per_process)
                    for k in range(rounds)]
        for n in sorted(per_process):
            med, q1, q3 = quartiles(per_process[n])
            print(f"    {n:<10} {med:6.3f} [{q1:.3f}-{q3:.3f}]")
        med, q1, q3 = quartiles(overhead)
        print(f"    {' + '.join(MESH_OVERHEAD)}: {med:.3f} [{q1:.3f}-{q3:.3f}] "
              f"(target <= {CPU_TARGET})")


#: Pause after each attribution request before its metrics and CPU are read
#: (seconds): the router's and engine's histograms are observed, and the
#: work after the answer (the response-cache write) done, by then.
AFTER_SECONDS = 0.1
#: The attribution's name for this process's own CPU (``time.process_time_ns``).
CLIENT = "client"
#: Seconds the mesh sits idle while its processes' idle CPU rate is measured,
#: in IDLE_WINDOWS windows one after the other (their spread gives the
#: rate's standard error).
IDLE_SECONDS = 3.0
IDLE_WINDOWS = 6


class StepTimes:
    """The in-process engine's steps as the mesh engine's /metrics show
    them: a step observer (called on the engine thread) and its running
    :class:`EngineReading`."""

    def __init__(self) -> None:
        self._reading = EngineReading(0.0, 0, 0)

    def observe(self, stats: StepStats) -> None:
        last = self._reading
        # Without the thread governor (--no-adaptive-threads) StepStats carries
        # no count (0): the step ran on torch's fixed intra-op threads.
        self._reading = EngineReading(last.step_s + stats.duration_s, last.steps + 1,
                                      stats.num_threads or torch.get_num_threads())

    def read(self) -> EngineReading:
        return self._reading


@dataclass(frozen=True)
class Probe:
    """One path of the attribution rounds: its request and what it reads.

    Attributes:
      run: sends one max_tokens=1 request (argument: its request id).
      read_engine: the engine's step counters now; None: no engine to read.
      read_router_ttft: the router's cumulative TTFT (seconds, count); None: no router.
    """

    run: Callable[[str], Awaitable[Run]]
    read_engine: Callable[[], EngineReading] | None = None
    read_router_ttft: Callable[[], tuple[float, int]] | None = None


def _read_engine(address: str) -> EngineReading:
    return engine_reading(scrape(address))


def _read_router_ttft(address: str) -> tuple[float, int]:
    return histogram_sum_count(scrape(address), ROUTER_TTFT)


def _router_path(path: str) -> str:
    """The name of the path straight to the router of the mesh ``path``."""
    return "router direct" + path.removeprefix("mesh (Envoy)").removeprefix("mesh")


def _probes(backend: TorchBackend, step_times: StepTimes, prompt_ids: tuple[int, ...],
            meshes: dict[str, Mesh],
            stubs: dict[str, generation_pb2_grpc.GenerationServiceStub],
            router_stubs: dict[str, generation_pb2_grpc.GenerationServiceStub],
            engine_stub: engine_pb2_grpc.EngineServiceStub | None) -> dict[str, Probe]:
    """The attribution's paths: in process, each mesh started here through
    Envoy and straight to its router (its first engine's steps, its router's
    TTFT), and the first mesh's engine over gRPC."""
    request = _chat_request(QUESTION, 1)
    probes = {BASE: Probe(functools.partial(run_in_process, backend, prompt_ids, 1),
                          step_times.read)}
    for path, mesh in meshes.items():
        steps = functools.partial(_read_engine, mesh.engines[0].metrics_address)
        ttft = functools.partial(_read_router_ttft, mesh.router.metrics_address)
        probes[path] = Probe(functools.partial(_run_mesh_path, stubs[path], request), steps, ttft)
        probes[_router_path(path)] = Probe(
            functools.partial(_run_mesh_path, router_stubs[path], request), steps, ttft)
    if engine_stub is not None:
        steps = functools.partial(_read_engine, meshes["mesh (Envoy)"].engines[0].metrics_address)
        probes["engine gRPC"] = Probe(
            functools.partial(run_engine_grpc, engine_stub, prompt_ids, 1), steps)
    return probes


def _cpu_window_start(pids: dict[str, int]) -> dict[str, int]:
    """CPU ns so far of each process of ``pids`` (name → PID), and of this
    one as ``client`` (``time.process_time_ns``), read last: the reads of
    /proc are this process's work, kept out of its own window."""
    return {**{n: cpu_ns(pid) for n, pid in pids.items()}, CLIENT: time.process_time_ns()}


def _cpu_window_end(pids: dict[str, int], start: dict[str, int]) -> dict[str, int]:
    """CPU ns since :func:`_cpu_window_start`, this process's read first."""
    client = time.process_time_ns() - start[CLIENT]
    return {**{n: cpu_ns(pid) - start[n] for n, pid in pids.items()}, CLIENT: client}


async def _idle_rates(pids: dict[str, int], seconds: float,
                      windows: int) -> dict[str, IdleRate]:
    """The idle CPU rate of each process (``pids``: name → PID; this one as
    ``client``) while nothing is sent (this process's event loop running,
    as in a request's window), over ``windows`` windows of ``seconds /
    windows`` each (:func:`latency_attribution.idle_rate`)."""
    measured: dict[str, list[tuple[int, float]]] = {}
    for _ in range(windows):
        start = _cpu_window_start(pids)
        began = time.perf_counter()
        await asyncio.sleep(seconds / windows)
        elapsed = time.perf_counter() - began
        for n, ns in _cpu_window_end(pids, start).items():
            measured.setdefault(n, []).append((ns, elapsed))
    return {n: idle_rate(each) for n, each in measured.items()}


async def _probe_once(probe: Probe, request_id: str, settle: float,
                      pids: dict[str, int]) -> tuple[Sample, dict[str, int], float]:
    """One request alone: (its sample, CPU ns per process in its window,
    the window's seconds). The window runs from just before sending to
    :data:`AFTER_SECONDS` after the last message; the metric reads and the
    settle pause are outside it."""
    engine0 = probe.read_engine() if probe.read_engine else None
    router0 = probe.read_router_ttft() if probe.read_router_ttft else (0.0, 0)
    time.sleep(settle)
    cpu0 = _cpu_window_start(pids)
    began = time.perf_counter()
    run = await probe.run(request_id)
    await asyncio.sleep(AFTER_SECONDS)
    window = time.perf_counter() - began
    cpu = _cpu_window_end(pids, cpu0)
    router = (histogram_delta(router0, probe.read_router_ttft())
              if probe.read_router_ttft else None)
    sample = Sample(client_ttft_s=run.ttft,
                    router_ttft_s=None if router is None else router[0])
    if probe.read_engine is not None and engine0 is not None:
        engine1 = probe.read_engine()
        sample = dataclasses.replace(sample, step_s=engine1.step_s - engine0.step_s,
                                     steps=engine1.steps - engine0.steps,
                                     threads=engine0.threads)
    return sample, cpu, window


async def attribute(probes: dict[str, Probe], pids: dict[str, int], *, rounds: int,
                    settle: float) -> None:
    """Where a first token's time goes, per hop: ``rounds`` interleaved
    rounds of one max_tokens=1 request per path of ``probes`` (one uncounted
    warm-up round), each alone after ``settle`` seconds; prints the per-hop
    table (:data:`latency_attribution.COLUMNS`, ms, median [p25-p75]) and CPU
    ms per request of each process in ``pids`` (name → PID) and of this one
    (``client``, the in-process engine included), idle rates subtracted."""
    idle = await _idle_rates(pids, IDLE_SECONDS, IDLE_WINDOWS)
    samples: dict[str, list[Sample]] = {name: [] for name in probes}
    used = {name: dict.fromkeys(idle, 0) for name in probes}
    elapsed = dict.fromkeys(probes, 0.0)
    load_before = _load()
    for i in range(rounds + 1):
        for name in path_order(list(probes), i):
            sample, cpu, window = await _probe_once(probes[name], f"attr-{i}-{name}", settle,
                                                    pids)
            if i:
                samples[name].append(sample)
                elapsed[name] += window
                for n, ns in cpu.items():
                    used[name][n] += ns
    print(f"Where the first token's time goes: 1 greedy token, {rounds} interleaved rounds, "
          f"ms, median [p25-p75]; load {load_before} -> {_load()}")
    print("\n".join(format_hops(hop_rows(samples))))
    print("  the request's step ran on N threads (N x requests): " + "; ".join(
        f"{path} " + ", ".join(f"{threads} x {n}" for threads, n in counts.items())
        for path, counts in thread_mix(samples).items()))
    for path, n in multi_step(samples).items():
        print(f"  note: {n} of {path}'s requests did not take exactly one engine step "
              "(step = the sum of the steps seen)")
    _print_cpu(used, idle, elapsed, rounds)


def _print_cpu(used: dict[str, dict[str, int]], idle: dict[str, IdleRate],
               elapsed: dict[str, float], rounds: int) -> None:
    """The attribution's CPU table: per path and process, CPU ms per
    request ± what the idle rate's standard error amounts to
    (:func:`latency_attribution.cpu_ms_per_request`), then each idle rate."""
    print(f"  CPU-ms per request ± the idle rate's standard error, mean over the rounds "
          f"(schedstat; each process's idle rate over {IDLE_SECONDS:.0f} s in "
          f"{IDLE_WINDOWS} windows subtracted; 0.00 where it came out below 0 within "
          f"{CLAMP_STDERRS:g} standard errors; client: this process, the in-process engine "
          "included):")
    names = sorted(idle)
    print(f"    {'':<14}" + "".join(f"{n:>14}" for n in names))
    for path in used:
        print(f"    {path:<14}" + "".join(
            f"{str(cpu_ms_per_request(used[path][n], idle[n], elapsed[path], rounds)):>14}"
            for n in names))
    print(f"    {'idle CPU-ms/s':<14}" + "".join(
        f"{f'{idle[n].ns_per_s / 1e6:.2f}±{idle[n].stderr_ns_per_s / 1e6:.2f}':>14}"
        for n in names))


def _command_from(where: Path, role: str) -> list[str]:
    """The command that runs service ``role`` from the checkout ``where``.
    ``-P``: the mesh starts its children in this checkout (their cwd), which
    ``python -m`` would put first on ``sys.path``, ahead of ``PYTHONPATH``:
    without it the "other" service ran this checkout's code with the other
    checkout's generated stubs."""
    root = where.resolve()
    return ["env", f"PYTHONPATH={root}:{root / 'services' / 'gen'}", sys.executable, "-P",
            "-m", f"services.{role}"]


def _attributed_pids(pids: dict[str, dict[str, int]]) -> dict[str, int]:
    """The processes whose CPU the attribution reads (name → PID): the first
    mesh's, and the second mesh's (``--compare-*``) as ``NAME[B]``."""
    first = "mesh (Envoy)"
    named = dict(pids.get(first, {}))
    for path, procs in pids.items():
        if path != first:
            named.update({f"{n}[B]": pid for n, pid in procs.items()})
    return named


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds per path (default: 5)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--url", default=None, help="a running mesh's ingress (default: start one)")
    parser.add_argument("--hops", action="store_true",
                        help="1 stream: also time the router without Envoy and the engine "
                             "over gRPC (each hop's share; only with a mesh started here)")
    parser.add_argument("--session", action="store_true",
                        help="1 stream: also time one long-lived GenerateStream call through "
                             "Envoy, each request a start on it (\"mesh session\": no new call "
                             "per request)")
    parser.add_argument("--concurrency", type=int, default=16,
                        help="streams at once for the throughput part; 1: skip it")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--adaptive-threads", action=argparse.BooleanOptionalAction,
                        default=True,
                        help="both engines size their step's threads to the cores they get "
                             "(the engines' default); --no-adaptive-threads: both run a fixed "
                             "--num-threads (steadier on an otherwise idle machine, worse "
                             "under outside load: a fixed OpenMP team spins against it)")
    parser.add_argument("--num-threads", type=int, default=os.cpu_count() or 1,
                        help="each engine's step threads (default: one per CPU)")
    parser.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                        help="extra router argument of the mesh started here, repeatable "
                             "(--router-arg=--no-tokenize-in-router: prompt ids from the "
                             "tokenizer service, the default before 2026-12-06)")
    parser.add_argument("--compare-router-arg", action="append", default=[], metavar="ARG",
                        help="also start a second mesh whose router gets these arguments "
                             "too (repeatable), measured as one more path interleaved with "
                             "the others: a before/after in one run")
    parser.add_argument("--compare-router-from", type=Path, default=None, metavar="DIR",
                        help="also start a second mesh whose router runs the code of the "
                             "checkout DIR (e.g. `git worktree add DIR main`; its "
                             "services/gen generated), with --compare-router-arg if given: "
                             "the router's before/after in one run")
    parser.add_argument("--compare-engine-from", type=Path, default=None, metavar="DIR",
                        help="also start a second mesh whose engine runs the code of the "
                             "checkout DIR (its services/gen generated; with "
                             "--compare-router-from, the same second mesh): the engine's "
                             "before/after in one run")
    for role in ("tokenizer", "cache"):
        parser.add_argument(f"--compare-{role}-from", type=Path, default=None, metavar="DIR",
                            help=f"also start a second mesh whose {role} runs the code of the "
                                 "checkout DIR (with the other --compare-*-from options, the "
                                 f"same second mesh): the {role}'s before/after in one run")
    parser.add_argument("--attribute", type=int, default=0, metavar="N",
                        help="after the 1-stream part, N interleaved rounds of 1-token requests "
                             "in process, through Envoy, straight to the router and to the "
                             "engine over gRPC: where a first token's time goes per hop (engine "
                             "step and router TTFT from their /metrics) and each process's "
                             "CPU per request (schedstat); only with a mesh started here "
                             "(default: 0, off)")
    parser.add_argument("--settle", type=float, default=SETTLE_SECONDS,
                        help="seconds of pause before each run (default: %(default)s); with 0, "
                             "a path may start while the previous one's threads still spin")
    args = parser.parse_args()
    if args.attribute < 0:
        parser.error(f"argument --attribute: must be >= 0, got {args.attribute}")
    if args.attribute and args.url is not None:
        parser.error("argument --attribute: reads the mesh's /metrics and /proc, so it needs "
                     "the mesh started here (no --url)")

    threads_args = ["--num-threads", str(args.num_threads),
                    "--adaptive-threads" if args.adaptive_threads else "--no-adaptive-threads"]
    variants: dict[str, tuple[list[str], dict[str, list[str]]]] = {
        "mesh (Envoy)": (list(args.router_arg), {})}
    compare_from = {role: getattr(args, f"compare_{role}_from")
                    for role in ("router", "engine", "tokenizer", "cache")}
    if args.compare_router_arg or any(where is not None for where in compare_from.values()):
        commands = {role: _command_from(where, role) for role, where in compare_from.items()
                    if where is not None}
        label = " ".join([*(f"{role} from {where}" for role, where in compare_from.items()
                            if where is not None),
                          *(f"router {arg}" for arg in args.compare_router_arg)])
        variants[f"mesh, {label}"] = ([*args.router_arg, *args.compare_router_arg], commands)
    meshes: dict[str, Mesh] = {}
    urls = {"mesh (Envoy)": args.url} if args.url is not None else {}
    pids: dict[str, dict[str, int]] = {}
    channels: list[grpc.aio.Channel] = []
    session: StreamSession | None = None
    try:
        for path, (router_args, commands) in (variants.items() if args.url is None else ()):
            started = Mesh(
                ingress_port=0, admin_port=0, run_dir=tempfile.mkdtemp(prefix="llmesh-bench-"),
                engine_args=threads_args, router_args=router_args, commands=commands)
            meshes[path] = started.start()
            urls[path], pids[path] = started.ingress_address, started.pids()
            print(f"{path}: llmesh up → SERVING (all services + Envoy ready): "
                  f"{started.startup_seconds:.1f} s")
            if "--no-tokenize-in-router" not in router_args:
                print(f"router's prompt ids in process {started.wait_prompts_in_router():.1f} "
                      "s later")
        tokenizer = Tokenizer.load(default_model_path())
        prompt_ids = tuple(tokenizer.apply_chat_template(
            [ChatMessage(role="user", content=QUESTION)], add_generation_prompt=True).token_ids)
        step_times = StepTimes()
        backend = TorchBackend(EngineConfig(num_threads=args.num_threads,
                                            adaptive_threads=args.adaptive_threads),
                               step_observer=step_times.observe)
        await backend.start()
        stubs = {}
        for path, url in urls.items():
            channels.append(grpc.aio.insecure_channel(url))
            stubs[path] = generation_pb2_grpc.GenerationServiceStub(channels[-1])
        router_stubs = {}
        for path, started_mesh in meshes.items():
            channels.append(grpc.aio.insecure_channel(started_mesh.router.grpc_address))
            router_stubs[path] = generation_pb2_grpc.GenerationServiceStub(channels[-1])
        mesh = meshes.get("mesh (Envoy)")
        engine_stub = None
        if mesh is not None:
            channels.append(grpc.aio.insecure_channel(mesh.engines[0].grpc_address))
            engine_stub = engine_pb2_grpc.EngineServiceStub(channels[-1])
        request = _chat_request(QUESTION, args.max_tokens)
        paths: dict[str, Callable[[str], Awaitable[Run]]] = {
            path: functools.partial(_run_mesh_path, stub, request) for path, stub in stubs.items()}
        for path, router_stub in router_stubs.items() if args.hops else ():
            paths[_router_path(path)] = functools.partial(_run_mesh_path, router_stub, request)
        session = StreamSession(stubs["mesh (Envoy)"]) if args.session else None
        if session is not None:
            paths["mesh session"] = functools.partial(session.run, request)
        if args.hops and engine_stub is not None:
            paths["engine gRPC"] = functools.partial(
                run_engine_grpc, engine_stub, prompt_ids, args.max_tokens)
        await one_stream(backend, prompt_ids, paths, pids, rounds=args.rounds,
                         max_tokens=args.max_tokens, settle=args.settle)
        if args.attribute:
            await attribute(
                _probes(backend, step_times, prompt_ids, meshes, stubs, router_stubs,
                        engine_stub),
                _attributed_pids(pids), rounds=args.attribute, settle=args.settle)
        if args.concurrency > 1:
            await many_streams(backend, tokenizer, stubs, pids, concurrency=args.concurrency,
                               num_requests=args.num_requests, max_tokens=args.max_tokens,
                               rounds=args.rounds, settle=args.settle)
        await backend.shutdown()
    finally:
        if session is not None:
            session.close()
        for channel in channels:
            await channel.close()
        for running in meshes.values():
            running.stop()


if __name__ == "__main__":
    asyncio.run(main())
