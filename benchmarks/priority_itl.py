"""An INTERACTIVE stream's inter-token latency beside a long BATCH prefill, the
torch engine in process, with the outranked-prefill bound off and on.

One process runs one engine (``--slowdown``: its
``--outranked-prefill-slowdown``; ``off``: a BATCH prompt chunk takes the step
budget left beside an INTERACTIVE decode, the behaviour before the bound),
prefix caching off (every run computes its prompts), speculation off (one token
a step, so a gap between deltas is one token's latency). A round: the
INTERACTIVE request alone (``--interactive-prompt-tokens`` prompt,
``--max-tokens`` greedy tokens), then the same again with a BATCH request of
``--batch-prompt-tokens`` prompt tokens (``--batch-max-tokens`` tokens)
submitted when the INTERACTIVE stream's first token arrives. Prints the
INTERACTIVE stream's ITL p50/p99 alone and beside the prefill, the BATCH
request's TTFT and total time (medians, from its submission), the prompt
tokens deferred by priority (``llmesh:prompt_tokens_deferred_by_priority_total``)
per round, the engine's measured step profile, and ``uptime``'s load averages
before and after. ``--json FILE`` appends the samples; ``--summary FILE...``
pools the runs of each ``--label`` into one table, so runs of the settings can
be interleaved process by process (one engine per process: the engine's thread
governor sets the process's torch threads). With ``PYTHONPATH`` at an older
checkout (whose engine has no bound) ``--slowdown`` is ignored.

Usage: ``python benchmarks/priority_itl.py [--slowdown 2] [--rounds 3]
[--batch-prompt-tokens 4000] [--max-tokens 64] [--label new] [--json FILE]``;
``python benchmarks/priority_itl.py --summary FILE``. Not a test: numbers
depend on the machine (2 shared cores here); docs/bench.md has a run.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import time

from prometheus_client import CollectorRegistry

from services.common.sampling import Priority, SamplingOptions
from services.engine.config import EngineConfig, parse_bytes
from services.engine.metrics import EngineMetrics
from services.engine.torch_backend.backend import TorchBackend
from services.engine.types import SequenceRequest

_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}


@dataclasses.dataclass
class Engine:
    """One setting's engine and what it measured."""

    name: str
    backend: TorchBackend
    metrics: EngineMetrics
    itl_alone: list[float] = dataclasses.field(default_factory=list)
    itl_beside: list[float] = dataclasses.field(default_factory=list)
    batch_ttft: list[float] = dataclasses.field(default_factory=list)
    batch_total: list[float] = dataclasses.field(default_factory=list)

    def deferred(self) -> float:
        name = "llmesh:prompt_tokens_deferred_by_priority_total"
        return self.metrics.registry.get_sample_value(name) or 0.0


def engine(name: str, args: argparse.Namespace) -> Engine:
    """The engine of one ``--slowdown`` setting (``off`` or a factor; ignored
    where the checkout's engine has no bound)."""
    options: dict = {"max_model_len": args.batch_prompt_tokens + 512,
                     "enable_prefix_caching": False, "speculative_method": "none",
                     "kv_cache_bytes": parse_bytes(args.kv_cache_bytes)}
    if "outranked_prefill_slowdown" in _FIELDS:
        options["outranked_prefill_slowdown"] = None if name == "off" else float(name)
    metrics = EngineMetrics(CollectorRegistry())
    return Engine(name, TorchBackend(EngineConfig(**options),
                                     step_observer=metrics.observe_step), metrics)


def prompt(tokens: int, seed: int) -> tuple[int, ...]:
    """``tokens`` ordinary token ids, distinct per ``seed``."""
    return tuple(1000 + (seed * 7919 + i * 31) % 20000 for i in range(tokens))


async def interactive(eng: Engine, rid: str, args: argparse.Namespace,
                      first: asyncio.Event | None) -> list[float]:
    """The INTERACTIVE stream's gaps between tokens (seconds); sets ``first`` at
    its first token."""
    request = SequenceRequest(rid, prompt(args.interactive_prompt_tokens, hash(rid) % 997),
                              SamplingOptions(max_tokens=args.max_tokens, ignore_eos=True,
                                              temperature=0.0))
    gaps: list[float] = []
    last = None
    async for delta in eng.backend.generate(request):
        now = time.perf_counter()
        if last is None and first is not None:
            first.set()
        elif last is not None and delta.token_ids:
            gaps.extend([(now - last) / len(delta.token_ids)] * len(delta.token_ids))
        last = now
    return gaps


async def batch(eng: Engine, rid: str, args: argparse.Namespace,
                first: asyncio.Event) -> tuple[float, float]:
    """The BATCH request, sent at ``first``: its TTFT and total time (seconds)."""
    await first.wait()
    request = SequenceRequest(rid, prompt(args.batch_prompt_tokens, hash(rid) % 997),
                              SamplingOptions(max_tokens=args.batch_max_tokens,
                                              ignore_eos=True, temperature=0.0),
                              Priority.BATCH)
    began = time.perf_counter()
    ttft = 0.0
    async for _ in eng.backend.generate(request):
        ttft = ttft or time.perf_counter() - began
    return ttft, time.perf_counter() - began


async def one_round(eng: Engine, index: int, args: argparse.Namespace) -> None:
    eng.itl_alone += await interactive(eng, f"alone-{index}", args, None)
    first = asyncio.Event()
    gaps, (ttft, total) = await asyncio.gather(
        interactive(eng, f"inter-{index}", args, first), batch(eng, f"batch-{index}", args, first))
    eng.itl_beside += gaps
    eng.batch_ttft.append(ttft)
    eng.batch_total.append(total)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)] if ordered else float("nan")


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f}"


def profile_line(eng: Engine) -> str:
    """The engine's measured step profile (what sizes the bound)."""
    profile = eng.backend.load().step_profile
    decode = profile.decode_step(1) * 1e3
    return (f"profile: decode step of 1 row {decode:.1f} ms, prompt token "
            f"{profile.prefill_s(1) * 1e3:.2f} ms")


def summary(rows: list[dict]) -> None:
    """The table of ``rows`` (one per process run, :func:`main`'s JSON lines),
    samples pooled per label."""
    labels: dict[str, dict] = {}
    for row in rows:
        pooled = labels.setdefault(row["label"], {k: [] for k in row if k != "label"})
        for key, values in row.items():
            if key != "label":
                pooled[key] += values
    print("label     ITL alone p50/p99 ms  ITL beside p50/p99 ms  batch TTFT s  batch total s"
          "  deferred tokens/run  runs")
    for label, data in labels.items():
        print(f"{label:>8s}  {percentile(data['itl_alone'], 0.5) * 1e3:8.1f} /"
              f"{percentile(data['itl_alone'], 0.99) * 1e3:7.1f}  "
              f"{percentile(data['itl_beside'], 0.5) * 1e3:9.1f} /"
              f"{percentile(data['itl_beside'], 0.99) * 1e3:7.1f}  "
              f"{statistics.median(data['batch_ttft']):12.2f}  "
              f"{statistics.median(data['batch_total']):13.2f}  "
              f"{statistics.median(data['deferred']):19.0f}  {len(data['batch_total']):4d}")


async def main(args: argparse.Namespace) -> dict:
    eng = engine(args.slowdown, args)
    await eng.backend.start()
    # Warm-up (kernels, the step profile), not counted.
    await one_round(eng, -1, argparse.Namespace(**{**vars(args), "batch_prompt_tokens": 512}))
    for values in (eng.itl_alone, eng.itl_beside, eng.batch_ttft, eng.batch_total):
        values.clear()
    print(f"{args.label}: before: {load()}; {profile_line(eng)}", flush=True)
    deferred = []
    for index in range(args.rounds):
        before = eng.deferred()
        await one_round(eng, index, args)
        deferred.append(eng.deferred() - before)
        print(f"  round {index} {args.label}: ITL beside p50/p99 "
              f"{percentile(eng.itl_beside[-args.max_tokens:], 0.5) * 1e3:6.1f} / "
              f"{percentile(eng.itl_beside[-args.max_tokens:], 0.99) * 1e3:6.1f} ms, "
              f"batch TTFT {eng.batch_ttft[-1]:5.2f} s, total {eng.batch_total[-1]:5.2f} s",
              flush=True)
    print(f"{args.label}: after: {load()}; {profile_line(eng)}")
    await eng.backend.shutdown()
    return {"label": args.label, "itl_alone": eng.itl_alone, "itl_beside": eng.itl_beside,
            "batch_ttft": eng.batch_ttft, "batch_total": eng.batch_total, "deferred": deferred}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--slowdown", default="2",
                        help="the engine's --outranked-prefill-slowdown (off: no bound)")
    parser.add_argument("--label", default=None, help="name in the table (default: --slowdown)")
    parser.add_argument("--json", default=None, help="append this run's samples to this file")
    parser.add_argument("--summary", nargs="+", default=None,
                        help="print the table of these --json files instead of running")
    parser.add_argument("--interactive-prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch-prompt-tokens", type=int, default=4000)
    parser.add_argument("--batch-max-tokens", type=int, default=16)
    parser.add_argument("--kv-cache-bytes", default="384MiB")
    parsed = parser.parse_args()
    if parsed.summary:
        rows = []
        for path in parsed.summary:
            with open(path) as source:
                rows += [json.loads(line) for line in source]
        summary(rows)
    else:
        parsed.label = parsed.label or parsed.slowdown
        result = asyncio.run(main(parsed))
        if parsed.json:
            with open(parsed.json, "a") as sink:
                sink.write(json.dumps(result) + "\n")
        summary([result])
