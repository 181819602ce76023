"""Speculative decoding speed-up on input-grounded prompts (not a test).

    python benchmarks/spec_decode.py [--k 3] [--ngram-min 1] [--ngram-max 4] [--ngram-full-len 3]
                                     [--methods ngram draft] [--streams 1 16]
                                     [--max-tokens 128] [--quantization ...]
                                     [--quant-kernel auto|native|torch]

Runs ``TorchBackend`` in-process (SmolLM2, default engine options otherwise) on
the passages of ``benchmarks/data/spec_passages.json`` (rewrite / summarise /
edit a given passage of ~300 tokens), chat template applied, greedy. For each
method it prints, against speculation off on the same engine:

* at 1 stream: decode tokens/s (tokens after the first / time after the first,
  so the prompt's prefill does not count), the speed-up, whether every output
  is identical, and the mean acceptance length (tokens per speculative step:
  ``1 + accepted / drafts``);
* at N streams (all passages at once, repeated to N): aggregate output tokens/s
  with speculation forced on at any batch size, and with the engine's default
  ``--speculative-disable-batch-size``.

Prints the 1-minute load average before and after: other work on the machine
moves every number here.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "services" / "gen")]

from services.common.model_files import default_model_path  # noqa: E402
from services.common.sampling import (  # noqa: E402
    SamplingOptions,
    SpeculativeMethod,
    SpeculativeOptions,
)
from services.engine.config import EngineConfig  # noqa: E402
from services.engine.torch_backend.backend import TorchBackend  # noqa: E402
from services.engine.types import SequenceRequest, StepStats  # noqa: E402
from services.tokenizer.tokenizer import ChatMessage, Tokenizer  # noqa: E402

PASSAGES = ROOT / "benchmarks" / "data" / "spec_passages.json"
_ids = itertools.count()


class StepLog:
    """Step observer keeping each step's stats."""

    def __init__(self) -> None:
        self.steps: list[StepStats] = []

    def __call__(self, stats: StepStats) -> None:
        self.steps.append(stats)

    def acceptance(self) -> tuple[float, int]:
        """Mean tokens per speculative step (1 + accepted / drafts), and drafts."""
        drafts = sum(s.spec_num_drafts for s in self.steps)
        accepted = sum(s.spec_num_accepted_tokens for s in self.steps)
        return (1 + accepted / drafts if drafts else 1.0), drafts


async def run_one(backend: TorchBackend, prompt: tuple[int, ...], options: SamplingOptions,
                  speculative: SpeculativeOptions) -> tuple[list[int], float, float]:
    """Tokens, seconds to the first token, seconds from the first to the last."""
    request = SequenceRequest(f"bench-{next(_ids)}", prompt, options, speculative=speculative)
    began = time.perf_counter()
    first = 0.0
    tokens: list[int] = []
    async for delta in backend.generate(request):
        if delta.token_ids and not tokens:
            first = time.perf_counter()
        tokens.extend(delta.token_ids)
    return tokens, first - began, time.perf_counter() - first


def load() -> float:
    return os.getloadavg()[0]


async def single_stream(backend: TorchBackend, log: StepLog, prompts: list[tuple[int, ...]],
                        options: SamplingOptions, methods: list[SpeculativeOptions],
                        rounds: int) -> None:
    """Each prompt ``rounds`` times per method, interleaved; per prompt and method
    the fastest decode counts (robust to other work on a shared machine)."""
    names = [spec.method.value for spec in methods]
    seconds = {name: [0.0] * len(prompts) for name in names}
    tokens = {name: [0] * len(prompts) for name in names}
    identical = {name: True for name in names}
    drafts = dict.fromkeys(names, 0)
    accepted = dict.fromkeys(names, 0)
    # decode steps (each request's first, the prompt, left out) by tokens computed
    steps: dict[str, dict[int, list[float]]] = {name: {} for name in names}
    last_steps: dict[str, dict[int, int]] = {name: {} for name in names}
    for index, prompt in enumerate(prompts):
        reference: list[int] | None = None
        for _ in range(rounds):
            for spec, name in zip(methods, names):  # interleaved: load hits all alike
                log.steps.clear()
                out, _, decode_s = await run_one(backend, prompt, options, spec)
                reference = out if reference is None else reference
                identical[name] &= out == reference
                best = seconds[name][index]
                seconds[name][index] = decode_s if best == 0.0 else min(best, decode_s)
                tokens[name][index] = len(out) - 1
                drafts[name] += sum(s.spec_num_drafts for s in log.steps)
                accepted[name] += sum(s.spec_num_accepted_tokens for s in log.steps)
                counts: dict[int, int] = {}
                for step in log.steps[1:]:
                    steps[name].setdefault(step.num_scheduled_tokens, []).append(step.duration_s)
                    counts[step.num_scheduled_tokens] = counts.get(step.num_scheduled_tokens, 0) + 1
                for size, count in counts.items():  # one run's mix per prompt
                    last_steps[name][size] = last_steps[name].get(size, 0) + count
    base = sum(tokens["none"]) / sum(seconds["none"])

    def estimate(name: str) -> float:
        """Decode tok/s from median step times per step size times the run's step
        mix: robust to other work stalling a few steps."""
        total = sum(statistics.median(steps[name][size]) * count / rounds
                    for size, count in last_steps[name].items())
        return sum(tokens[name]) / total

    print(f"\n1 stream, decode tokens/s (wall: fastest of {rounds} runs per prompt; "
          "step-median estimate), greedy")
    print("| method | tok/s wall | speed-up wall | tok/s est. | speed-up est. | identical to off"
          " | mean acceptance length | per-prompt speed-up (wall) |")
    print("|---|---:|---:|---:|---:|---|---:|---|")
    base_est = estimate("none")
    for name in names:
        rate = sum(tokens[name]) / sum(seconds[name])
        length = 1 + accepted[name] / drafts[name] if drafts[name] else 1.0
        per_prompt = " ".join(f"{seconds['none'][i] / seconds[name][i]:.2f}"
                              for i in range(len(prompts)))
        print(f"| {name} | {rate:.1f} | {rate / base:.2f}x | {estimate(name):.1f} |"
              f" {estimate(name) / base_est:.2f}x | {identical[name]} | {length:.2f} |"
              f" {per_prompt} |")
    for name in names:
        sizes = ", ".join(f"{size}: {statistics.median(v) * 1e3:.1f} ms x{len(v)}"
                          for size, v in sorted(steps[name].items()))
        print(f"{name} decode steps by tokens computed (median, count): {sizes}")


async def many_streams(backend: TorchBackend, log: StepLog, prompts: list[tuple[int, ...]],
                       options: SamplingOptions, methods: list[SpeculativeOptions],
                       streams: int, default_limit: int | None) -> None:
    speculator = backend.speculator
    assert speculator is not None
    batch = [prompts[i % len(prompts)] for i in range(streams)]
    rows = []
    reference: list[list[int]] | None = None
    for spec in methods:
        limits = [None] if spec.method is SpeculativeMethod.NONE else [None, default_limit]
        for limit in limits:
            speculator.config = dataclasses.replace(speculator.config, disable_batch_size=limit)
            log.steps.clear()
            began = time.perf_counter()
            results = await asyncio.gather(*(run_one(backend, p, options, spec) for p in batch))
            elapsed = time.perf_counter() - began
            outs = [tokens for tokens, _, _ in results]
            reference = outs if reference is None else reference
            generated = sum(map(len, outs))
            length, drafts = log.acceptance()
            step_ms = statistics.median(s.duration_s for s in log.steps) * 1e3
            label = spec.method.value + ("" if spec.method is SpeculativeMethod.NONE else
                                         f" (disable above {limit})" if limit else " (forced)")
            rows.append((label, generated / elapsed, outs == reference, length, drafts, step_ms))
    speculator.config = dataclasses.replace(speculator.config, disable_batch_size=default_limit)
    base = rows[0][1]
    print(f"\n{streams} streams, aggregate output tokens/s (prompt prefill included), greedy")
    print("| method | tok/s | vs off | identical | mean acceptance length | drafts |"
          " step p50 ms |")
    print("|---|---:|---:|---|---:|---:|---:|")
    for label, rate, same, length, drafts, step_ms in rows:
        print(f"| {label} | {rate:.1f} | {rate / base:.2f}x | {same} | {length:.2f} | {drafts} |"
              f" {step_ms:.1f} |")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=EngineConfig.num_speculative_tokens)
    parser.add_argument("--ngram-min", type=int, default=EngineConfig.ngram_min)
    parser.add_argument("--ngram-max", type=int, default=EngineConfig.ngram_max)
    parser.add_argument("--ngram-full-len", type=int, default=EngineConfig.ngram_full_len)
    parser.add_argument("--draft-num-layers", type=int, default=8)
    parser.add_argument("--methods", nargs="+", default=["ngram"], choices=["ngram", "draft"])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=8, help="passages used (at most 8)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="runs per prompt and method at 1 stream (the fastest counts)")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--quant-kernel", default=None, choices=("auto", "native", "torch"))
    args = parser.parse_args()

    path = default_model_path()
    tokenizer = Tokenizer.load(path)
    entries = json.loads(PASSAGES.read_text())[:args.prompts]
    prompts = [tuple(tokenizer.apply_chat_template([ChatMessage("user", e["prompt"])]).token_ids)
               for e in entries]
    config = EngineConfig(model_path=path, max_model_len=2048, num_speculative_tokens=args.k,
                          ngram_min=args.ngram_min, ngram_max=args.ngram_max,
                          ngram_full_len=args.ngram_full_len,
                          draft_num_layers=args.draft_num_layers)
    if args.quantization is not None:
        config = dataclasses.replace(config, quantization=args.quantization)
    if args.quant_kernel is not None:
        config = dataclasses.replace(config, quant_kernel=args.quant_kernel)
    log = StepLog()
    backend = TorchBackend(config, step_observer=log)
    print(f"load average before: {load():.2f}; prompts: {len(prompts)} of "
          f"{statistics.mean(map(len, prompts)):.0f} tokens (mean); max_tokens "
          f"{args.max_tokens}; k={args.k}, n-gram {args.ngram_min}..{args.ngram_max} "
          f"(k for matches >= {args.ngram_full_len}); "
          f"quantization {getattr(config, 'quantization', 'none')}, quant kernel "
          f"{getattr(config, 'quant_kernel', 'torch')}")
    await backend.start()
    try:
        options = SamplingOptions(max_tokens=args.max_tokens)
        methods = [SpeculativeOptions(SpeculativeMethod.NONE)] + [
            SpeculativeOptions(SpeculativeMethod(m)) for m in args.methods]
        await run_one(backend, prompts[0], SamplingOptions(max_tokens=4), methods[0])  # warm
        for streams in args.streams:
            if streams == 1:
                await single_stream(backend, log, prompts, options, methods, args.rounds)
            else:
                await many_streams(backend, log, prompts, options, methods, streams,
                                   config.speculative_disable_batch_size)
    finally:
        await backend.shutdown()
    print(f"\nload average after: {load():.2f}")


if __name__ == "__main__":
    asyncio.run(main())
