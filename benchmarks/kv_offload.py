"""Returning prompts with the KV offload tier off and on, the torch engine in process.

Three engines share the machine, each with the same small KV pool
(``--kv-cache-bytes``): ``off`` (no tier), ``memory`` (``--kv-offload-bytes``
of host memory) and ``disk`` (the same, memory-mapped from a file in
``--offload-dir``). A round, on each engine in turn (interleaved, the prefix
cache reset first): ``--prompts`` distinct prompts of ``--prompt-tokens``
tokens one after the other (cold: each evicts the earlier ones from the
pool), then the same prompts again (returning: recomputed without the tier,
restored from it with). Prints per engine the TTFT p50/p90 of cold and of
returning prompts over all rounds, the prompt tokens computed, the tier's
restore time per block against the engine's prefill time per block, and
whether every greedy output equals the ``off`` engine's. Prints ``uptime``
load averages beside the numbers.

Usage: ``python benchmarks/kv_offload.py [--rounds 3] [--prompts 4]
[--prompt-tokens 1024] [--kv-cache-bytes 48MiB] [--kv-offload-bytes 1GiB]
[--offload-dir /tmp]``. Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from pathlib import Path

from prometheus_client import CollectorRegistry

from services.common.sampling import SamplingOptions
from services.engine.config import EngineConfig, parse_bytes
from services.engine.metrics import EngineMetrics
from services.engine.torch_backend.backend import TorchBackend
from services.engine.types import SequenceRequest


class Engine:
    """One engine of the comparison and its own metrics."""

    def __init__(self, name: str, config: EngineConfig) -> None:
        self.name = name
        self.metrics = EngineMetrics(CollectorRegistry())
        self.backend = TorchBackend(config, step_observer=self.metrics.observe_step)
        self.ttft: dict[str, list[float]] = {"cold": [], "returning": []}
        self.outputs: list[list[int]] = []

    def value(self, name: str) -> float:
        return self.metrics.registry.get_sample_value(name) or 0.0

    async def ask(self, request_id: str, prompt: tuple[int, ...], kind: str) -> None:
        began = time.perf_counter()
        tokens: list[int] = []
        async for delta in self.backend.generate(SequenceRequest(
                request_id, prompt, SamplingOptions(max_tokens=8, ignore_eos=True))):
            if not tokens:
                self.ttft[kind].append(time.perf_counter() - began)
            tokens.extend(delta.token_ids)
        self.outputs.append(tokens)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


async def main(args: argparse.Namespace) -> None:
    base = dict(max_model_len=max(2048, args.prompt_tokens + 64),
                kv_cache_bytes=parse_bytes(args.kv_cache_bytes))
    offload = parse_bytes(args.kv_offload_bytes)
    engines = [Engine("off", EngineConfig(**base)),  # type: ignore[arg-type]
               Engine("memory", EngineConfig(**base, kv_offload_bytes=offload)),  # type: ignore[arg-type]
               Engine("disk", EngineConfig(**base, kv_offload_bytes=offload,  # type: ignore[arg-type]
                                           kv_offload_dir=Path(args.offload_dir)))]
    for engine in engines:
        await engine.backend.start()
    rng = random.Random(7)
    prompts = [tuple(rng.randrange(100, 48000) for _ in range(args.prompt_tokens))
               for _ in range(args.prompts)]
    print(f"load before: {os.getloadavg()}")
    for round_ in range(args.rounds):
        for engine in engines:
            assert engine.backend.reset_prefix_cache()
            for kind in ("cold", "returning"):
                for i, prompt in enumerate(prompts):
                    await engine.ask(f"{round_}-{kind}-{i}", prompt, kind)
            counts = engine.backend.check_integrity()
            assert counts.used == 0 and counts.free + counts.cached == counts.total
    print(f"load after: {os.getloadavg()}")
    info = engines[0].backend.kv_cache_info
    assert info is not None
    print(f"pool {info.num_blocks} blocks x {info.block_size} tokens; {args.prompts} prompts x "
          f"{args.prompt_tokens} tokens, {args.rounds} rounds, 8 output tokens each")
    print(f"{'engine':8s} {'cold p50':>9s} {'cold p90':>9s} {'ret p50':>9s} {'ret p90':>9s} "
          f"{'ret/off':>8s} {'computed':>9s} {'restore/blk':>12s} {'prefill/blk':>12s} same")
    off_returning = statistics.median(engines[0].ttft["returning"])
    for engine in engines:
        cold, ret = engine.ttft["cold"], engine.ttft["returning"]
        restored = engine.value("llmesh:kv_offload_restored_blocks_total")
        restore_s = engine.value("llmesh:kv_offload_restore_seconds_sum")
        prefill = engine.backend.load().step_profile.prefill_token_s * info.block_size
        per_block = f"{restore_s / restored * 1e3:9.3f} ms" if restored else f"{'-':>12s}"
        print(f"{engine.name:8s} {statistics.median(cold):8.3f}s {percentile(cold, 0.9):8.3f}s "
              f"{statistics.median(ret):8.3f}s {percentile(ret, 0.9):8.3f}s "
              f"{statistics.median(ret) / off_returning:8.2f} "
              f"{engine.value('llmesh:prompt_tokens_computed_total'):9.0f} {per_block} "
              f"{prefill * 1e3:9.3f} ms {engine.outputs == engines[0].outputs}")
    for engine in engines:
        await engine.backend.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--kv-cache-bytes", default="48MiB")
    parser.add_argument("--kv-offload-bytes", default="1GiB")
    parser.add_argument("--offload-dir", default="/tmp")
    asyncio.run(main(parser.parse_args()))
