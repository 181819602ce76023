"""``sampling.n`` against n single requests, the torch engine in process.

Sends one request with ``n`` choices (``--n``, seed 42, temperature 1, EOS
ignored, ``--max-tokens`` each) on a ``--prompt-tokens``-token prompt, then the
``n`` single requests seeded 42..42+n-1 that its choices must equal, all at
once. Prints, per way, the wall time, the prompt tokens the engine computed
(``llmesh:prompt_tokens_computed_total``) and the KV blocks in use at the
peak, and checks the outputs are equal. Prefix caching is off, so the singles
cannot share their prompt through the cache either.

Usage: ``python benchmarks/parallel_sampling.py [--n 4] [--prompt-tokens 512]
[--max-tokens 32]``. Not a test: numbers depend on the machine (2 cores here).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time

from prometheus_client import CollectorRegistry

from services.common.sampling import SamplingOptions
from services.engine.config import EngineConfig
from services.engine.metrics import EngineMetrics
from services.engine.torch_backend.backend import TorchBackend
from services.engine.types import SequenceRequest


async def run(backend: TorchBackend, requests: list[SequenceRequest]) -> tuple[dict, int]:
    """Each request's tokens by (request, choice), and the peak KV blocks in use."""
    out: dict[tuple[str, int], list[int]] = {}
    peak = 0

    async def one(request: SequenceRequest) -> None:
        nonlocal peak
        async for delta in backend.generate(request):
            out.setdefault((request.request_id, delta.index), []).extend(delta.token_ids)
            peak = max(peak, backend.check_integrity().used)

    await asyncio.gather(*(one(r) for r in requests))
    return out, peak


async def main(args: argparse.Namespace) -> None:
    metrics = EngineMetrics(CollectorRegistry())
    backend = TorchBackend(EngineConfig(max_model_len=2048, enable_prefix_caching=False,
                                        max_tokens_cap=256),
                           step_observer=metrics.observe_step)
    await backend.start()
    prompt = tuple(1000 + i % 5000 for i in range(args.prompt_tokens))
    options = SamplingOptions(temperature=1.0, seed=42, max_tokens=args.max_tokens,
                              ignore_eos=True, n=args.n)

    def computed() -> float:
        return metrics.registry.get_sample_value("llmesh:prompt_tokens_computed_total") or 0.0

    results = {}
    for way, requests in (
            ("n", [SequenceRequest("n", prompt, options)]),
            ("singles", [SequenceRequest(f"s{i}", prompt, dataclasses.replace(
                options, n=1, seed=42 + i)) for i in range(args.n)])):
        before, began = computed(), time.perf_counter()
        tokens, peak = await run(backend, requests)
        results[way] = [tokens[key] for key in sorted(tokens, key=lambda k: (k[1], k[0]))]
        print(f"{way:8s} n={args.n} prompt={args.prompt_tokens} max_tokens={args.max_tokens}: "
              f"{time.perf_counter() - began:6.2f} s, prompt tokens computed "
              f"{computed() - before:6.0f}, peak KV blocks used {peak}")
    print("choices equal the singles (seed 42 + i):", results["n"] == results["singles"])
    await backend.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=32)
    asyncio.run(main(parser.parse_args()))
