"""The engine's per-step delivery overhead on ``Multiplex``: event-loop CPU
time per engine step, from the step's end to its message on the wire.

One in-process engine (the torch backend over a tiny random Llama: its steps
are short, so delivery is a visible share) serves a real ``Multiplex`` call on
a loopback gRPC port; ``--streams`` requests of ``--max-tokens`` tokens each
(EOS ignored) run on it at once, ``--runs`` times. The event loop thread runs
everything but the model: the engine's delivery into the call's outbox, the
outbox's writer, gRPC and this script's reader; the engine thread runs the
steps. Per run: the loop thread's CPU seconds (``time.thread_time``) over the
run, divided by the engine steps (counted by the step observer) and by the
tokens delivered. The model never runs on the loop thread, so the difference
between two checkouts is their delivery path (the reader and gRPC are the
same).

Usage (compare two checkouts, interleaved, under the exclusive lock)::

    flock -x /tmp/llmesh-cpu.lock sh -c 'for i in 1 2 3; do
      PYTHONPATH=OLD:OLD/services/gen python benchmarks/engine_delivery.py --label old
      PYTHONPATH=NEW:NEW/services/gen python benchmarks/engine_delivery.py --label new
    done'

Prints, per run and as the median of the runs with the interquartile range,
the loop's microseconds per step and per token, and the load average before
and after. Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

# Appended, not prepended: PYTHONPATH picks the checkout measured (tools/ is a
# namespace package, so this one's engine_path is found beside an older one's).
sys.path.append(str(Path(__file__).resolve().parent.parent))

from tools.engine_path import multiplex_start, tiny_engine  # noqa: E402


async def _run_once(stub: object, streams: int, max_tokens: int, base: int
                    ) -> tuple[float, int]:
    """One run: (loop CPU seconds, tokens read)."""
    import grpc

    from llmesh.v1 import engine_pb2

    call = stub.Multiplex()  # type: ignore[attr-defined]
    ids = set(range(base, base + streams))
    began = time.thread_time()
    await call.write(engine_pb2.MultiplexRequest(
        starts=[multiplex_start(i, f"d-{i}", max_tokens) for i in ids]))
    tokens = 0
    while ids:
        for update in (await call.read()).updates:
            tokens += len(update.token_ids)
            if update.finish_reason or update.status_code:
                ids.discard(update.stream_id)
    cpu = time.thread_time() - began
    await call.done_writing()
    while await call.read() is not grpc.aio.EOF:
        pass
    return cpu, tokens


async def _main(args: argparse.Namespace) -> None:
    steps = [0]

    def count(_stats: object) -> None:
        steps[0] += 1

    per_step: list[float] = []
    per_token: list[float] = []
    async with tiny_engine(count) as stub:
        await _run_once(stub, args.streams, 8, 1000)  # warm-up
        for run in range(args.runs):
            before = steps[0]
            cpu, tokens = await _run_once(stub, args.streams, args.max_tokens, run * 1000)
            num_steps = steps[0] - before
            per_step.append(cpu / num_steps * 1e6)
            per_token.append(cpu / tokens * 1e6)
            print(f"{args.label} run {run}: {num_steps} steps, {tokens} tokens, loop CPU "
                  f"{cpu * 1e3:.1f} ms: {per_step[-1]:.1f} us/step, "
                  f"{per_token[-1]:.2f} us/token", flush=True)
    print(f"{args.label} median: {_median_iqr(per_step)} us of loop CPU per step, "
          f"{_median_iqr(per_token)} us per token ({args.streams} streams)", flush=True)


def _median_iqr(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.1f}"
    q1, _, q3 = statistics.quantiles(values, n=4)
    return f"{statistics.median(values):.1f} (IQR {q1:.1f}-{q3:.1f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=16, help="requests at once")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--label", default=os.environ.get("PYTHONPATH", "").split(":")[0])
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()}", flush=True)
    asyncio.run(_main(args))
    print(f"load average after: {os.getloadavg()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
