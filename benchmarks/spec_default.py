"""Which speculation method should ``auto`` be: n-gram against suffix, interleaved (not a test).

    python benchmarks/spec_default.py --round R [--workloads repeated grounded]
                                      [--streams 1 16] [--limit N] [--max-tokens 128]
                                      --json OUT/round-R.json
    python benchmarks/spec_default.py --summarize OUT/round-*.json

One round runs both methods on each workload and stream count of
``benchmarks/spec_decode.py`` (``TorchBackend`` in-process, default engine
options, greedy), the two passes back to back: n-gram first in even rounds,
suffix first in odd ones (A B, B A, ...), so drift in the machine's load and a
pass's position in the round hit both methods alike. Before a workload's
passes every prompt is prefilled once (``max_tokens`` 1), so each method finds
the same prefix cache, and each method decodes the first two requests once
(the cost rule's step times and acceptance records past their first steps);
the suffix cache is emptied before every pass. At
1 stream a pass runs the requests one at a time and counts decode tokens/s
(tokens after the first over the time after the first); at N streams, N
clients take the requests in order and it counts aggregate output tokens/s
(prefill included). Each round is one process, so rounds can run in separate
lock holds; it records the load averages before and after.

``--summarize`` reads the rounds' JSON files and prints, per workload and
stream count, each method's median and range (min-max) over the rounds, the
median of the per-round ratios suffix / n-gram with its range, each method's
accepted tokens per pass (``drafts x (acceptance length - 1)``: the steps the
method saved, which depends on the load only through the cost rule's step
times) and whether the two methods' outputs were identical in every round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "services" / "gen")]

from benchmarks.spec_decode import StepLog, run_one, suffix_proposer, workload  # noqa: E402
from services.common.model_files import default_model_path  # noqa: E402
from services.common.sampling import (  # noqa: E402
    SamplingOptions,
    SpeculativeMethod,
    SpeculativeOptions,
)
from services.engine.config import EngineConfig  # noqa: E402
from services.engine.torch_backend.backend import TorchBackend  # noqa: E402
from services.tokenizer.tokenizer import Tokenizer  # noqa: E402

METHODS = ("ngram", "suffix")


def loads() -> list[float]:
    """The 1, 5 and 15-minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


async def one_pass(backend: TorchBackend, log: StepLog, prompts: list[tuple[int, ...]],
                   options: SamplingOptions, method: str, streams: int) -> dict[str, object]:
    """One method's pass: tok/s (decode at 1 stream, aggregate otherwise),
    acceptance length, drafts and the outputs."""
    spec = SpeculativeOptions(SpeculativeMethod(method))
    suffix_proposer(backend).clear()
    log.steps.clear()
    outs: list[list[int]] = [[] for _ in prompts]
    decode_s = [0.0] * len(prompts)
    queue = list(enumerate(prompts))[::-1]

    async def client() -> None:
        while queue:
            index, prompt = queue.pop()
            outs[index], _, decode_s[index] = await run_one(backend, prompt, options, spec)

    began = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(streams)))
    elapsed = time.perf_counter() - began
    length, drafts = log.acceptance()
    rate = (sum(len(o) - 1 for o in outs) / sum(decode_s) if streams == 1
            else sum(map(len, outs)) / elapsed)
    return {"tok_s": rate, "acceptance_length": length, "drafts": drafts, "outputs": outs}


async def run_round(args: argparse.Namespace) -> dict[str, object]:
    path = default_model_path()
    tokenizer = Tokenizer.load(path)
    log = StepLog()
    backend = TorchBackend(EngineConfig(model_path=path, max_model_len=2048), step_observer=log)
    order = METHODS if args.round % 2 == 0 else METHODS[::-1]
    report: dict[str, object] = {"round": args.round, "order": list(order),
                                 "limit": args.limit, "max_tokens": args.max_tokens,
                                 "load_before": loads()}
    print(f"round {args.round}: order {' then '.join(order)}; load before {loads()}")
    await backend.start()
    try:
        options = SamplingOptions(max_tokens=args.max_tokens)
        for name in args.workloads:
            prompts = workload(name, tokenizer)[:args.limit]
            for prompt in prompts:  # the same warm prefix cache for every pass
                await run_one(backend, prompt, SamplingOptions(max_tokens=1),
                              SpeculativeOptions(SpeculativeMethod.NONE))
            for method in order:  # step times and acceptance records past their first steps
                await one_pass(backend, log, prompts[:2], options, method, 1)
            for streams in args.streams:
                batch = prompts if len(prompts) >= streams else [
                    prompts[i % len(prompts)] for i in range(streams)]
                passes = {m: await one_pass(backend, log, batch, options, m, streams)
                          for m in order}
                same = passes["ngram"]["outputs"] == passes["suffix"]["outputs"]
                for method, done in passes.items():
                    print(f"{name} {streams} streams {method}: {done['tok_s']:.1f} tok/s, "
                          f"acceptance {done['acceptance_length']:.2f}, drafts "
                          f"{done['drafts']}; load {loads()}")
                    report[f"{name}/{streams}/{method}"] = {
                        k: v for k, v in done.items() if k != "outputs"}
                report[f"{name}/{streams}/identical"] = same
    finally:
        await backend.shutdown()
    report["load_after"] = loads()
    print(f"round {args.round} done; load after {loads()}")
    return report


def summarize(files: list[Path]) -> None:
    rounds = [json.loads(f.read_text()) for f in files]
    print(f"{len(rounds)} rounds (orders: "
          f"{', '.join('/'.join(r['order']) for r in rounds)}); load before-after per round: "
          + "; ".join(f"{r['load_before'][0]}-{r['load_after'][0]}" for r in rounds))
    keys = sorted({k.rsplit("/", 1)[0] for r in rounds for k in r if k.count("/") == 2})
    print("| workload | streams | n-gram tok/s median (min-max) | suffix tok/s median (min-max)"
          " | suffix / n-gram per round: median (min-max) | accepted tokens n-gram / suffix:"
          " median (min-max) | identical outputs |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for key in keys:
        name, streams = key.split("/")
        rates = {m: [r[f"{key}/{m}"]["tok_s"] for r in rounds] for m in METHODS}
        ratios = [s / n for n, s in zip(rates["ngram"], rates["suffix"])]
        same = all(r[f"{key}/identical"] for r in rounds)
        cells = [f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})"
                 for v in rates.values()]
        accepted = [[round(r[f"{key}/{m}"]["drafts"] * (r[f"{key}/{m}"]["acceptance_length"] - 1))
                     for r in rounds] for m in METHODS]
        saved = " / ".join(f"{statistics.median(v):.0f} ({min(v)}-{max(v)})" for v in accepted)
        print(f"| {name} | {streams} | {cells[0]} | {cells[1]} | "
              f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) | {saved} |"
              f" {same} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--round", type=int, default=0, help="even: n-gram first; odd: suffix")
    parser.add_argument("--workloads", nargs="+", default=["repeated", "grounded"],
                        choices=["grounded", "repeated"])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--limit", type=int, default=None, help="first N requests only")
    parser.add_argument("--json", type=Path, default=None, help="write the round here")
    parser.add_argument("--summarize", type=Path, nargs="+", default=None)
    args = parser.parse_args()
    if args.summarize:
        summarize(args.summarize)
        return
    report = asyncio.run(run_round(args))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
