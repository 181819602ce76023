"""Engine latency numbers on this machine (not a test; pytest does not collect it).

    python -m tests.engine.bench_engine [--dtype float32|bfloat16] [--device cpu]
                                        [--quantization none|int8|int4]

Prints start-up (GGUF load + model build, warm-up), prefill of a 100-token
prompt, and decode ms/token (median inter-token time over several runs), all
through ``TorchBackend.generate`` so the thread hand-off is included.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from services.common.sampling import SamplingOptions
from services.engine.config import EngineConfig
from services.engine.torch_backend.backend import TorchBackend, resolve_quantization
from services.engine.types import SequenceRequest

PROMPT_100 = tuple(100 + (i * 977) % 48000 for i in range(100))


async def timed_tokens(backend: TorchBackend, request: SequenceRequest) -> list[float]:
    """Arrival times (perf_counter seconds) of each token, first entry the start time."""
    stamps = [time.perf_counter()]
    async for delta in backend.generate(request):
        stamps.extend(time.perf_counter() for _ in delta.token_ids)
    return stamps


async def main(dtype: str, device: str, runs: int, tokens: int, quantization: str) -> None:
    backend = TorchBackend(EngineConfig(dtype=dtype, device=device, max_model_len=2048,
                                        quantization=quantization))
    began = time.perf_counter()
    await backend.start()
    total = time.perf_counter() - began
    assert backend.timings is not None
    print(f"start: {total:.2f} s (load {backend.timings.load_s:.2f} s, "
          f"warm-up {backend.timings.warmup_s * 1000:.0f} ms)")
    prefill = []
    for i in range(runs):
        stamps = await timed_tokens(backend, SequenceRequest(
            f"prefill-{i}", PROMPT_100, SamplingOptions(max_tokens=1)))
        prefill.append(stamps[1] - stamps[0])
    print(f"prefill 100 tokens (+1 sampled): median {statistics.median(prefill) * 1000:.1f} ms "
          f"over {runs} runs")
    gaps = []
    for i in range(runs):
        stamps = await timed_tokens(backend, SequenceRequest(
            f"decode-{i}", PROMPT_100[:20], SamplingOptions(max_tokens=tokens, ignore_eos=True)))
        gaps.extend(b - a for a, b in zip(stamps[2:], stamps[3:], strict=False))
    print(f"decode: median {statistics.median(gaps) * 1000:.1f} ms/token, "
          f"p90 {statistics.quantiles(gaps, n=10)[-1] * 1000:.1f} ms "
          f"({len(gaps)} gaps, {runs} runs of {tokens} tokens)")
    await backend.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quantization", default=None, choices=("none", "int8", "int4"),
                        help="default: the engine's, or none with a --dtype other than float32")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    quantization = args.quantization or (
        resolve_quantization(EngineConfig()).quantization if args.dtype == "float32"
        else "none")
    asyncio.run(main(args.dtype, args.device, args.runs, args.tokens, quantization))
