"""Cost of the logits processors per decode step (not a test).

    python benchmarks/logits_processors.py [--batch 8] [--vocab 49152] [--history 1000]

Times :func:`sample_step` (greedy rows) on random ``[batch, vocab]`` logits:

* plain rows (no processors: the fast path, one ``any()`` over the rows);
* every row with all five processors and ``--history`` output tokens, counts
  kept incrementally (one new token per step, as in decoding);
* the same with the counts rebuilt from the whole history each step (what the
  incremental state avoids);
* a speculative step: every row with 4 proposals (5 target rows each).

Prints the median (and minimum) microseconds per step of each, and the load average.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "services" / "gen")]

from services.common.sampling import SamplingOptions  # noqa: E402
from services.engine.torch_backend.logits_processors import LogitsProcessorState  # noqa: E402
from services.engine.torch_backend.sampler import SamplingRow  # noqa: E402
from services.engine.torch_backend.step_sampler import StepRow, sample_step  # noqa: E402

OPTIONS = SamplingOptions(max_tokens=4096, repetition_penalty=1.2, frequency_penalty=0.5,
                          presence_penalty=0.3, min_tokens=2048,
                          logit_bias=tuple((i, 1.0) for i in range(0, 3000, 10)))


def median_us(step: Callable[[], object], repeats: int = 200) -> str:
    """``"median (min)"`` microseconds of ``step`` (the minimum is the steadier
    figure on a loaded machine)."""
    for _ in range(10):
        step()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        step()
        times.append(time.perf_counter() - began)
    return f"{statistics.median(times) * 1e6:9.1f} ({min(times) * 1e6:9.1f})"


def penalised_state(history: list[int], prompt: tuple[int, ...]) -> LogitsProcessorState:
    state = LogitsProcessorState.for_request(OPTIONS, prompt, (2,))
    assert state is not None
    for token in history:
        state.append(token)
    return state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--history", type=int, default=1000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(args.batch, args.vocab, generator=gen)
    prompt = tuple(torch.randint(0, args.vocab, (200,), generator=gen).tolist())
    history = torch.randint(0, args.vocab, (args.history,), generator=gen).tolist()

    plain = [StepRow(SamplingRow()) for _ in range(args.batch)]
    states = [penalised_state(history, prompt) for _ in range(args.batch)]
    penalised = [StepRow(SamplingRow(), (), s) for s in states]

    def incremental() -> None:
        for s in states:
            s.append(history[0])
        sample_step(logits, penalised)

    def from_scratch() -> None:
        rows = [StepRow(SamplingRow(), (), penalised_state(history, prompt))
                for _ in range(args.batch)]
        sample_step(logits, rows)

    spec_logits = torch.randn(args.batch * 5, args.vocab, generator=gen)
    spec = [StepRow(SamplingRow(), (5, 6, 7, 8), s) for s in states]
    spec_plain = [StepRow(SamplingRow(), (5, 6, 7, 8)) for _ in range(args.batch)]

    print(f"batch {args.batch}, vocab {args.vocab}, history {args.history}, 1 thread")
    print(f"plain rows (fast path)          {median_us(lambda: sample_step(logits, plain))} us")
    print(f"all processors, incremental     {median_us(incremental)} us")
    print(f"all processors, from scratch    {median_us(from_scratch, 50)} us")
    print(f"spec k=4 plain rows             "
          f"{median_us(lambda: sample_step(spec_logits, spec_plain))} us")
    print(f"spec k=4 all processors         "
          f"{median_us(lambda: sample_step(spec_logits, spec))} us")
    with open("/proc/loadavg") as f:
        print("loadavg", f.read().strip())


if __name__ == "__main__":
    main()
