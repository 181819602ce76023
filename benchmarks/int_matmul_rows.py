"""Time of the native Q4_1 integer matmul by row count (not a test).

    python benchmarks/int_matmul_rows.py [--rows 1,4,16,128] [--threads 1] [--repeats 200]

Runs ``native.q4_1_matmul`` (this checkout's ``kernels/int_matmul.c``, built
as the engine builds it: ``$CC`` and its flags included, so
``CC="cc -mno-avx512f"`` times the AVX2 path and ``CC="cc -mno-avx512bf16"``
a Xeon without avx512_bf16) on SmolLM2's four projection shapes (q/k/v
960x576, o 576x576, gate/up 3072x576, down 576x1536) with random Q4_1 weights
and bf16 activations, and prints per row count the p50, p90 and min of one
layer's four calls (µs; ``--repeats`` timings each) and the 1-minute load
average before and after. A decode step is 1 row (or 1 + the speculative
tokens), a 128-token prompt 128 rows per call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]),
                str(Path(__file__).resolve().parents[1] / "services" / "gen")]

import torch  # noqa: E402

from services.engine.torch_backend import native  # noqa: E402
from services.engine.torch_backend.gguf_loader import Q4_1Blocks  # noqa: E402
from services.engine.torch_backend.quant import NativeInt4Projection  # noqa: E402

#: (out_features, in_features) of one SmolLM2 layer's projections.
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))


def random_projection(out_features: int, in_features: int, gen: torch.Generator) -> torch.Tensor:
    """Packed Q4_1 weights as a GGUF holds them (d > 0, m about -8 d)."""
    blocks = in_features // 32
    q = torch.randint(0, 16, (out_features, in_features), generator=gen, dtype=torch.uint8)
    d = (torch.rand(out_features, blocks, generator=gen) * 0.02 + 0.001).half()
    m = (-d.float() * 8).half()
    return NativeInt4Projection.from_q4_1(Q4_1Blocks(d, m, q)).packed


def layer_times(rows: int, repeats: int, gen: torch.Generator) -> list[float]:
    """``repeats`` timings (µs) of the four projections of one layer at ``rows`` rows."""
    calls = []
    for out_features, in_features in SHAPES:
        packed = random_projection(out_features, in_features, gen)
        x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
        calls.append((x, packed, out_features))
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        for x, packed, out_features in calls:
            native.q4_1_matmul(x, packed, out_features, torch.bfloat16)
        times.append((time.perf_counter() - began) * 1e6)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,16,128")
    parser.add_argument("--threads", type=int, default=0, help="0: torch's default")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    print(f"library {native.library_path().name}, CC={os.environ.get('CC', 'cc')!r}, "
          f"{torch.get_num_threads()} threads, row chunk {native.int_matmul_row_chunk()}")
    print("| rows | p50 µs | p90 µs | min µs | µs per row (p50) |")
    print("|---:|---:|---:|---:|---:|")
    gen = torch.Generator().manual_seed(0)
    for rows in (int(r) for r in args.rows.split(",")):
        times = sorted(layer_times(rows, args.repeats, gen))
        p50, p90 = statistics.median(times), times[int(0.9 * (len(times) - 1))]
        print(f"| {rows} | {p50:.1f} | {p90:.1f} | {times[0]:.1f} | {p50 / rows:.1f} |")
    print(f"load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    main()
