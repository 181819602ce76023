"""What the mesh adds to latency: Envoy → router → engine vs the engine in-process.

Runs, in one process and alternating, a greedy chat answer of ``--max-tokens``
tokens (EOS ignored, so every run has the same length):

* **in-process**: the torch backend called directly (no gRPC, no tokenizer hop);
* **mesh**: the same prompt through Envoy's ingress (``llmesh up`` started here,
  or ``--url`` of a running mesh), response cache bypassed.

The paths take turns in a rotating order, each after ``--settle`` seconds of
pause (an idle mesh, as a lone user meets it: every process wakes for the
request). Prints, per path, the median over ``--runs`` runs of TTFT (seconds from sending
to the first token), TPOT ((e2e − TTFT) / (tokens − 1)), mean ITL (gap between
streamed messages) and e2e, and the mesh's overhead. Also prints the time
``llmesh up`` took to reach SERVING when it starts the mesh itself.

With ``--concurrency N`` (N > 1) it measures throughput instead: the same
``--num-requests`` distinct chat prompts (``--max-tokens`` each, EOS ignored),
N at a time, once in process and once through Envoy (gRPC streams from this
process), alternating for ``--rounds`` rounds after an uncounted warm-up of
each path at full batch; it prints each path's aggregate
output tokens per second (all tokens / wall time from the first send to the
last token), the mesh's ratio to in-process, and the median TTFT / TPOT.

Usage: ``python benchmarks/mesh_latency.py [--runs 5] [--max-tokens 64] [--url HOST:PORT]
[--concurrency 16 --num-requests 64 --rounds 2]``
Not a test: numbers depend on the machine (2 cores here).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import tempfile
import time
from dataclasses import dataclass

import grpc

from llmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc, generation_pb2, generation_pb2_grpc
from services.cli.mesh import Mesh
from services.common.model_files import default_model_path
from services.common.sampling import SamplingOptions
from services.engine.config import EngineConfig
from services.engine.torch_backend.backend import TorchBackend
from services.engine.types import SequenceRequest
from services.tokenizer.tokenizer import ChatMessage, Tokenizer

QUESTION = "Explain in a few sentences why the sky is blue."
#: Default pause before each run (seconds), so that no path starts on cores
#: still busy with the previous one (``--settle``).
SETTLE_SECONDS = 0.3


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


async def run_in_process(backend: TorchBackend, prompt_ids: tuple[int, ...], n: int, i: int) -> Run:
    request = SequenceRequest(request_id=f"bench-{i}", prompt_token_ids=prompt_ids,
                              sampling=SamplingOptions(max_tokens=n, ignore_eos=True))
    start = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    async for delta in backend.generate(request):
        if delta.token_ids:
            stamps.append(time.perf_counter())
            tokens += len(delta.token_ids)
    return _run(start, stamps, tokens)


def run_mesh(stub: generation_pb2_grpc.GenerationServiceStub, n: int) -> Run:
    request = generation_pb2.GenerateRequest(
        chat=generation_pb2.Chat(messages=[common_pb2.ChatMessage(role="user", content=QUESTION)]),
        sampling=common_pb2.SamplingParams(max_tokens=n, ignore_eos=True), bypass_cache=True)
    start = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    for response in stub.Generate(request, timeout=300):
        if response.token_ids:
            stamps.append(time.perf_counter())
            tokens += len(response.token_ids)
    return _run(start, stamps, tokens)


def run_engine_grpc(stub: engine_pb2_grpc.EngineServiceStub, prompt_ids: tuple[int, ...],
                    n: int, i: int) -> Run:
    start_msg = engine_pb2.EngineServiceGenerateRequest(start=engine_pb2.EngineRequest(
        request_id=f"bench-grpc-{i}", prompt_token_ids=prompt_ids,
        sampling=SamplingOptions(max_tokens=n, ignore_eos=True).to_pb()))
    start = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    for response in stub.Generate(iter([start_msg]), timeout=300):
        if response.token_ids:
            stamps.append(time.perf_counter())
            tokens += len(response.token_ids)
    return _run(start, stamps, tokens)


def _chat_request(question: str, n: int) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        chat=generation_pb2.Chat(messages=[common_pb2.ChatMessage(role="user", content=question)]),
        sampling=common_pb2.SamplingParams(max_tokens=n, ignore_eos=True), bypass_cache=True)


async def _mesh_stream(stub: generation_pb2_grpc.GenerationServiceStub,
                       request: generation_pb2.GenerateRequest) -> Run:
    start = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    async for response in stub.Generate(request, timeout=600):
        if response.token_ids:
            stamps.append(time.perf_counter())
            tokens += len(response.token_ids)
    return _run(start, stamps, tokens)


async def _bounded(concurrency: int, jobs: list) -> tuple[float, list[Run]]:
    """Runs the coroutine factories ``jobs``, ``concurrency`` at a time; returns
    (wall seconds, runs)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(job) -> Run:
        async with gate:
            return await job()

    began = time.perf_counter()
    runs = await asyncio.gather(*(one(job) for job in jobs))
    return time.perf_counter() - began, list(runs)


async def throughput(backend: TorchBackend, tokenizer: Tokenizer, url: str, *,
                     concurrency: int, num_requests: int, max_tokens: int, rounds: int) -> None:
    """Prints in-process vs mesh aggregate output throughput at ``concurrency``."""
    questions = [f"Question {i}: {QUESTION}" for i in range(num_requests)]
    prompts = [tuple(tokenizer.apply_chat_template(
        [ChatMessage(role="user", content=q)], add_generation_prompt=True).token_ids)
        for q in questions]
    requests = [_chat_request(q, max_tokens) for q in questions]
    async with grpc.aio.insecure_channel(url) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        # Warm both paths at full batch first (allocations and kernel plans for a
        # batch of ``concurrency``), uncounted.
        await _bounded(concurrency, [functools.partial(
            _mesh_stream, stub, _chat_request(f"Warm-up {i}: {QUESTION}", 8))
            for i in range(concurrency)])
        await _bounded(concurrency, [functools.partial(
            run_in_process, backend, prompts[i % len(prompts)], 8, -1 - i)
            for i in range(concurrency)])
        results: dict[str, list[tuple[float, list[Run]]]] = {"in-process": [], "mesh": []}
        for r in range(rounds):
            for name in (("in-process", "mesh") if r % 2 == 0 else ("mesh", "in-process")):
                time.sleep(SETTLE_SECONDS)
                if name == "in-process":
                    jobs = [functools.partial(run_in_process, backend, p, max_tokens, r * 1000 + i)
                            for i, p in enumerate(prompts)]
                else:
                    jobs = [functools.partial(_mesh_stream, stub, q) for q in requests]
                results[name].append(await _bounded(concurrency, jobs))
    load = " ".join(open("/proc/loadavg").read().split()[:3])
    print(f"c{concurrency}: {num_requests} requests x {max_tokens} tokens, {rounds} rounds "
          f"alternating; load {load}")
    rates: dict[str, list[float]] = {}
    for name, outcomes in results.items():
        rates[name] = [sum(run.tokens for run in runs) / wall for wall, runs in outcomes]
        every = [run for _, runs in outcomes for run in runs]
        print(f"{name:<11} output_tok_s=" + ", ".join(f"{x:.1f}" for x in rates[name])
              + f"  ttft_p50_ms={statistics.median(x.ttft for x in every) * 1e3:.1f}"
              f"  tpot_p50_ms={statistics.median(x.tpot for x in every) * 1e3:.2f}")
    ratios = [m / i for m, i in zip(rates["mesh"], rates["in-process"])]
    print("mesh / in-process throughput: " + ", ".join(f"{x:.3f}" for x in ratios)
          + f" (median {statistics.median(ratios):.3f}; target >= 0.95)")


def _run(start: float, stamps: list[float], tokens: int) -> Run:
    gaps = tuple(b - a for a, b in zip(stamps, stamps[1:]))
    return Run(ttft=stamps[0] - start, e2e=stamps[-1] - start, tokens=tokens, gaps=gaps)


def summarize(name: str, runs: list[Run]) -> dict[str, float]:
    row = {
        "ttft_ms": statistics.median(r.ttft for r in runs) * 1e3,
        "tpot_ms": statistics.median(r.tpot for r in runs) * 1e3,
        "itl_ms": statistics.median(statistics.fmean(r.gaps) for r in runs) * 1e3,
        "e2e_ms": statistics.median(r.e2e for r in runs) * 1e3,
        "tokens": statistics.median(r.tokens for r in runs),
    }
    print(f"{name:<14} " + "  ".join(f"{k}={v:8.2f}" for k, v in row.items()))
    return row


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--url", default=None, help="a running mesh's ingress (default: start one)")
    parser.add_argument("--router", default=None, help="the router's address, to time it without Envoy")
    parser.add_argument("--engine", default=None, help="an engine's address, to time it over gRPC")
    parser.add_argument("--concurrency", type=int, default=1,
                        help="streams at once; above 1, measure throughput (see above)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--settle", type=float, default=SETTLE_SECONDS,
                        help="seconds of pause before each run (default: %(default)s); with 0, "
                             "a path may start while the previous one's threads still spin")
    args = parser.parse_args()

    mesh = None
    url = args.url
    if url is None:
        mesh = Mesh(ingress_port=0, admin_port=0, run_dir=tempfile.mkdtemp(prefix="llmesh-bench-"))
        mesh.start()
        url = mesh.ingress_address
        args.router = mesh.router.grpc_address
        args.engine = mesh.engines[0].grpc_address
        print(f"llmesh up → SERVING (all services + Envoy ready): {mesh.startup_seconds:.1f} s")
    try:
        tokenizer = Tokenizer.load(default_model_path())
        prompt_ids = tuple(tokenizer.apply_chat_template(
            [ChatMessage(role="user", content=QUESTION)], add_generation_prompt=True).token_ids)
        backend = TorchBackend(EngineConfig())
        await backend.start()
        if args.concurrency > 1:
            await throughput(backend, tokenizer, url, concurrency=args.concurrency,
                             num_requests=args.num_requests, max_tokens=args.max_tokens,
                             rounds=args.rounds)
            await backend.shutdown()
            return
        channels = [grpc.insecure_channel(url)]
        paths: dict[str, object] = {
            "mesh (Envoy)": functools.partial(
                run_mesh, generation_pb2_grpc.GenerationServiceStub(channels[0]), args.max_tokens)}
        if args.router:
            channels.append(grpc.insecure_channel(args.router))
            paths["router direct"] = functools.partial(
                run_mesh, generation_pb2_grpc.GenerationServiceStub(channels[-1]), args.max_tokens)
        if args.engine:
            channels.append(grpc.insecure_channel(args.engine))
            engine_stub = engine_pb2_grpc.EngineServiceStub(channels[-1])
            paths["engine gRPC"] = lambda i: run_engine_grpc(
                engine_stub, prompt_ids, args.max_tokens, i)
        await run_in_process(backend, prompt_ids, 4, -1)  # warm every path once
        results: dict[str, list[Run]] = {"in-process": [], **{name: [] for name in paths}}
        order = ["in-process", *paths]
        for i in range(args.runs + 1):
            # The paths take turns in a rotating order, each after a pause: the
            # previous one's threads (OpenMP spins after a step) must not take
            # the cores from the next one's first token.
            for name in order[i % len(order):] + order[:i % len(order)]:
                time.sleep(args.settle)
                if name == "in-process":
                    run = await run_in_process(backend, prompt_ids, args.max_tokens, i)
                else:
                    run = paths[name](i) if name == "engine gRPC" else paths[name]()
                if i:
                    results[name].append(run)
        print(f"{len(prompt_ids)}-token prompt, {args.max_tokens} greedy tokens, "
              f"median of {args.runs} runs (after one warm-up run of each path)")
        rows = {name: summarize(name, runs) for name, runs in results.items()}
        base = rows["in-process"]
        for name, row in rows.items():
            if name != "in-process":
                print(f"overhead of {name:<14} ttft_ms={row['ttft_ms'] - base['ttft_ms']:8.2f}  "
                      f"tpot_ms={row['tpot_ms'] - base['tpot_ms']:8.2f}")
        await backend.shutdown()
        for channel in channels:
            channel.close()
    finally:
        if mesh is not None:
            mesh.stop()


if __name__ == "__main__":
    asyncio.run(main())
