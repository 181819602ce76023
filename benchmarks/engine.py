"""Torch engine throughput, prefix-cache TTFT and step times on this machine (not a test).

    python benchmarks/engine.py [--no-batch-invariant] [--streams 1 4 16 32]
                                [--device cpu] [--dtype float32]
                                [--quantization none|int8|int4] [--[no-]dense-prefill]
                                [--quant-kernel auto|native|torch]
                                [--attention-backend auto|native|torch]

Runs ``TorchBackend`` in-process (SmolLM2, the default engine options) and prints:

* aggregate output tokens/s at each number of concurrent streams (each stream:
  a distinct prompt of ``--prompt-tokens`` tokens, ``--output-tokens`` tokens
  generated with EOS ignored), with the p50/p90/p99 engine step time and the
  mean batch size of those steps;
* TTFT of a request whose 1,024-token prefix an earlier request computed
  (warm, prefix-cache hit) against one whose prefix is new (cold), medians
  over ``--ttft-runs`` pairs;
* the 1-minute load average before and after, since other work on the machine
  skews every number here.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]),
                str(Path(__file__).resolve().parents[1] / "services" / "gen")]

from services.common.sampling import SamplingOptions  # noqa: E402
from services.engine.config import EngineConfig  # noqa: E402
from services.engine.torch_backend.backend import TorchBackend  # noqa: E402
from services.engine.types import SequenceRequest, StepStats  # noqa: E402


class StepLog:
    """Step observer keeping each step's stats."""

    def __init__(self) -> None:
        self.steps: list[StepStats] = []

    def __call__(self, stats: StepStats) -> None:
        self.steps.append(stats)


def prompt(length: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(100, 48000) for _ in range(length))


async def stream(backend: TorchBackend, request: SequenceRequest) -> tuple[float, int]:
    """Seconds to the first token and tokens generated."""
    began = time.perf_counter()
    first, count = 0.0, 0
    async for delta in backend.generate(request):
        if delta.token_ids and not count:
            first = time.perf_counter() - began
        count += len(delta.token_ids)
    return first, count


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def throughput(backend: TorchBackend, log: StepLog, streams: int, prompt_tokens: int,
                     output_tokens: int, seed: int) -> dict[str, float]:
    options = SamplingOptions(max_tokens=output_tokens, ignore_eos=True)
    requests = [SequenceRequest(f"tp-{streams}-{seed}-{i}", prompt(prompt_tokens, seed * 1000 + i),
                                options) for i in range(streams)]
    log.steps.clear()
    began = time.perf_counter()
    results = await asyncio.gather(*(stream(backend, r) for r in requests))
    elapsed = time.perf_counter() - began
    generated = sum(count for _, count in results)
    step_ms = [s.duration_s * 1000 for s in log.steps]
    return {"streams": streams, "tokens_per_s": generated / elapsed, "elapsed_s": elapsed,
            "ttft_s": statistics.median(first for first, _ in results),
            "p50": percentile(step_ms, 0.5), "p90": percentile(step_ms, 0.9),
            "p99": percentile(step_ms, 0.99),
            "batch": statistics.mean(s.batch_size for s in log.steps)}


async def prefix_ttft(backend: TorchBackend, runs: int, prefix_tokens: int) -> tuple[float, float]:
    """Median TTFT (s) of cold requests (new prefix) and warm ones (same prefix as
    the cold request just before, different suffix)."""
    cold, warm = [], []
    options = SamplingOptions(max_tokens=1)
    for run in range(runs):
        prefix = prompt(prefix_tokens, 900_000 + run)
        first = SequenceRequest(f"cold-{run}", prefix + prompt(16, 1), options)
        second = SequenceRequest(f"warm-{run}", prefix + prompt(16, 2), options)
        cold.append((await stream(backend, first))[0])
        warm.append((await stream(backend, second))[0])
    return statistics.median(cold), statistics.median(warm)


async def main(args: argparse.Namespace) -> None:
    load_before = os.getloadavg()
    log = StepLog()
    config = EngineConfig(model_path=args.model, device=args.device, dtype=args.dtype,
                          max_model_len=2048,
                          quantization=args.quantization,
                          dense_prefill=args.dense_prefill, quant_kernel=args.quant_kernel,
                          attention_backend=args.attention_backend,
                          batch_invariant=args.batch_invariant,
                          max_num_batched_tokens=args.max_num_batched_tokens)
    backend = TorchBackend(config, step_observer=log)
    await backend.start()
    kv = backend.kv_cache_info
    print(f"torch engine: {args.device} {args.dtype} quantization={args.quantization}, "
          f"dense_prefill={'auto' if args.dense_prefill is None else args.dense_prefill}, "
          f"quant_kernel={args.quant_kernel}, attention={args.attention_backend}, "
          f"batch_invariant={args.batch_invariant}, "
          f"step budget {config.step_token_budget()} tokens, KV cache {kv.num_blocks} blocks "
          f"x {kv.block_size} tokens ({kv.num_bytes / 2**30:.2f} GiB), "
          f"{os.cpu_count()} CPUs, load average {load_before[0]:.2f}")
    await throughput(backend, log, 2, 32, 8, seed=0)  # warm-up
    rows = []
    for streams in args.streams:
        rows.append(await throughput(backend, log, streams, args.prompt_tokens,
                                     args.output_tokens, seed=streams))
    base = rows[0]["tokens_per_s"]
    print(f"\nthroughput: prompt {args.prompt_tokens} tokens, {args.output_tokens} output tokens "
          f"per stream")
    print("| streams | output tok/s | x 1-stream | median TTFT s | step p50 ms | p90 ms | p99 ms "
          "| mean batch |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['streams']} | {row['tokens_per_s']:.1f} | {row['tokens_per_s'] / base:.2f} "
              f"| {row['ttft_s']:.3f} | {row['p50']:.1f} | {row['p90']:.1f} | {row['p99']:.1f} "
              f"| {row['batch']:.1f} |")
    cold, warm = await prefix_ttft(backend, args.ttft_runs, args.prefix_tokens)
    print(f"\nTTFT with a {args.prefix_tokens}-token shared prefix (+16-token suffix, median of "
          f"{args.ttft_runs}): cold {cold * 1000:.0f} ms, warm {warm * 1000:.0f} ms, "
          f"warm/cold {warm / cold:.3f}")
    counts = backend.check_integrity()
    await backend.shutdown()
    load_after = os.getloadavg()
    print(f"\nKV blocks after the run: {counts}; load average before {load_before[0]:.2f}, "
          f"after {load_after[0]:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None,
                        help="GGUF file (default: the packaged SmolLM2)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", default=EngineConfig().quantization,
                        choices=("none", "int8", "int4"))
    parser.add_argument("--dense-prefill", action=argparse.BooleanOptionalAction,
                        default=EngineConfig().dense_prefill,
                        help="default: auto (only with --quant-kernel torch)")
    parser.add_argument("--quant-kernel", default=EngineConfig().quant_kernel,
                        choices=("auto", "native", "torch"))
    parser.add_argument("--attention-backend", default="auto", choices=("auto", "native", "torch"))
    parser.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--ttft-runs", type=int, default=3)
    asyncio.run(main(parser.parse_args()))
