"""Speculative decoding speed-up, off / n-gram / suffix (/ draft), on two workloads (not a test).

    python benchmarks/spec_decode.py [--workloads grounded repeated] [--methods ngram suffix]
                                     [--streams 1 16] [--max-tokens 128] [--rounds 2]
                                     [--json OUT.json] [--tree-replay]

Runs ``TorchBackend`` in-process (SmolLM2, default engine options otherwise),
chat template applied, greedy:

* ``grounded``: the 8 input-grounded passages of
  ``benchmarks/data/spec_passages.json`` (rewrite / summarise / edit a given
  passage of ~300 tokens);
* ``repeated``: the 64 requests of ``benchmarks/data/repeated_traffic.json``
  (eight shared documents and code files, eight tasks each, shuffled; made by
  ``benchmarks/make_repeated_traffic.py``, which says how), in their order.

Every method starts from the same cold state: the suffix cache is emptied
before each method's pass over a workload, so suffix decoding learns only from
the earlier requests of that pass (never from the same request in an earlier
round). At 1 stream each request runs alone, in order; per request the fastest
of ``--rounds`` passes counts. It prints decode tokens/s (tokens after the first
over the time after the first: the prefill does not count), the speed-up over
off, whether every output is identical to off, and the mean acceptance length
(``1 + accepted / drafts``). At N streams the workload runs N at a time (a pool
of N clients taking requests in order): aggregate output tokens/s.

``--tree-replay`` answers "would tree verification pay?" offline: for the
suffix proposer's matches along the off outputs (the true greedy tokens), it
counts the tokens a best path of ``r`` proposals would have accepted against
the best frequency-scored tree of the same ``r`` nodes, and prints tokens per
step and the decode speed each would reach at the engine's measured step time
for ``r + 1`` rows.

Prints the 1-minute load average before and after: other work on the machine
moves every number here.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import heapq
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "services" / "gen")]

from services.common.model_files import default_model_path  # noqa: E402
from services.common.sampling import (  # noqa: E402
    SamplingOptions,
    SpeculativeMethod,
    SpeculativeOptions,
)
from services.common.wire.chat import ChatMessage  # noqa: E402
from services.engine.config import EngineConfig  # noqa: E402
from services.engine.torch_backend.backend import TorchBackend  # noqa: E402
from services.engine.torch_backend.suffix_cache import (  # noqa: E402
    SENTINEL,
    SuffixCache,
    longest_match,
)
from services.engine.torch_backend.spec_policy import StepCostModel  # noqa: E402
from services.engine.torch_backend.suffix_proposer import SuffixProposer  # noqa: E402
from services.engine.types import SequenceRequest, StepStats  # noqa: E402
from services.tokenizer.tokenizer import Tokenizer  # noqa: E402

PASSAGES = ROOT / "benchmarks" / "data" / "spec_passages.json"
REPEATED = ROOT / "benchmarks" / "data" / "repeated_traffic.json"
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


def load() -> float:
    return os.getloadavg()[0]


def workload(name: str, tokenizer: Tokenizer) -> list[tuple[int, ...]]:
    """The prompts (token ids, chat template applied) of workload ``name``."""
    if name == "grounded":
        chats = [[ChatMessage("user", e["prompt"])] for e in json.loads(PASSAGES.read_text())]
    else:
        chats = [[ChatMessage(m["role"], m["content"]) for m in r["messages"]]
                 for r in json.loads(REPEATED.read_text())["requests"]]
    return [tuple(tokenizer.apply_chat_template(chat).token_ids) for chat in chats]


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


def suffix_proposer(backend: TorchBackend) -> SuffixProposer:
    speculator = backend.speculator
    assert speculator is not None
    proposer = speculator.proposers[SpeculativeMethod.SUFFIX]
    assert isinstance(proposer, SuffixProposer)
    return proposer


@dataclasses.dataclass
class Pass:
    """One method's pass over a workload at 1 stream."""

    outputs: list[list[int]]
    decode_s: list[float]
    drafts: int
    accepted: int


async def one_pass(backend: TorchBackend, log: StepLog, prompts: list[tuple[int, ...]],
                   options: SamplingOptions, spec: SpeculativeOptions) -> Pass:
    suffix_proposer(backend).clear()
    outputs, seconds = [], []
    drafts = accepted = 0
    for prompt in prompts:
        log.steps.clear()
        out, _, decode_s = await run_one(backend, prompt, options, spec)
        outputs.append(out)
        seconds.append(decode_s)
        drafts += sum(s.spec_num_drafts for s in log.steps)
        accepted += sum(s.spec_num_accepted_tokens for s in log.steps)
    return Pass(outputs, seconds, drafts, accepted)


async def single_stream(backend: TorchBackend, log: StepLog, prompts: list[tuple[int, ...]],
                        options: SamplingOptions, methods: list[SpeculativeOptions],
                        rounds: int) -> dict[str, dict[str, float | bool]]:
    names = [spec.method.value for spec in methods]
    best: dict[str, list[float]] = {}
    passes: dict[str, Pass] = {}
    for _ in range(rounds):
        for spec, name in zip(methods, names):  # interleaved: load hits all alike
            done = await one_pass(backend, log, prompts, options, spec)
            passes.setdefault(name, done)
            best[name] = (done.decode_s if name not in best
                          else [min(a, b) for a, b in zip(best[name], done.decode_s)])
    reference = passes["none"].outputs
    tokens = [len(out) - 1 for out in reference]
    base = sum(tokens) / sum(best["none"])
    results: dict[str, dict[str, float | bool]] = {}
    print(f"\n1 stream, {len(prompts)} requests in order, decode tokens/s (per request the "
          f"fastest of {rounds} passes), greedy")
    print("| method | decode tok/s | speed-up | identical to off | mean acceptance length |")
    print("|---|---:|---:|---|---:|")
    for name in names:
        done = passes[name]
        rate = sum(len(o) - 1 for o in done.outputs) / sum(best[name])
        length = 1 + done.accepted / done.drafts if done.drafts else 1.0
        same = done.outputs == reference
        results[name] = {"decode_tok_s": rate, "speedup": rate / base, "identical": same,
                         "acceptance_length": length}
        print(f"| {name} | {rate:.1f} | {rate / base:.2f}x | {same} | {length:.2f} |")
    return results


async def many_streams(backend: TorchBackend, log: StepLog, prompts: list[tuple[int, ...]],
                       options: SamplingOptions, methods: list[SpeculativeOptions],
                       streams: int) -> dict[str, dict[str, float | bool]]:
    batch = prompts if len(prompts) >= streams else [
        prompts[i % len(prompts)] for i in range(streams)]
    rows = []
    reference: list[list[int]] | None = None
    for spec in methods:
        suffix_proposer(backend).clear()
        log.steps.clear()
        queue = list(enumerate(batch))[::-1]
        outs: list[list[int]] = [[] for _ in batch]

        async def client() -> None:
            while queue:
                index, prompt = queue.pop()
                outs[index] = (await run_one(backend, prompt, options, spec))[0]

        began = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(streams)))
        elapsed = time.perf_counter() - began
        reference = outs if reference is None else reference
        length, drafts = log.acceptance()
        step_ms = statistics.median(s.duration_s for s in log.steps) * 1e3
        rows.append((spec.method.value, sum(map(len, outs)) / elapsed, outs == reference,
                     length, drafts, step_ms))
    base = rows[0][1]
    print(f"\n{streams} streams, aggregate output tokens/s (prefill included), greedy")
    print("| method | tok/s | vs off | identical | mean acceptance length | drafts | step p50 ms |")
    print("|---|---:|---:|---|---:|---:|---:|")
    results: dict[str, dict[str, float | bool]] = {}
    for name, rate, same, length, drafts, step_ms in rows:
        results[name] = {"tok_s": rate, "vs_off": rate / base, "identical": same,
                         "acceptance_length": length, "drafts": drafts}
        print(f"| {name} | {rate:.1f} | {rate / base:.2f}x | {same} | {length:.2f} | {drafts} |"
              f" {step_ms:.1f} |")
    return results


# -- tree replay ------------------------------------------------------------------


def _children(buffer: np.ndarray, ends: np.ndarray, depth: int, high: int,
              size: int | None) -> dict[int, np.ndarray]:
    """The occurrences in ``ends`` grouped by their token ``depth`` steps on."""
    positions = ends + depth
    known = positions < high
    slots = positions if size is None else positions % size
    votes = np.where(known, buffer[np.where(known, slots, 0)], SENTINEL)
    return {int(t): ends[votes == t] for t in np.unique(votes) if t != SENTINEL}


def best_tree(buffer: np.ndarray, ends: np.ndarray, nodes: int, high: int,
              size: int | None = None) -> dict[tuple[int, ...], float]:
    """The ``nodes`` most probable continuation prefixes (a tree: every prefix
    of a node is a node), probability = share of occurrences, expanded best
    first (SuffixDecoding's greedy speculation tree)."""
    tree: dict[tuple[int, ...], float] = {}
    heap: list[tuple[float, tuple[int, ...], np.ndarray]] = []
    total = ends.shape[0]
    for token, members in _children(buffer, ends, 1, high, size).items():
        heapq.heappush(heap, (-members.shape[0] / total, (token,), members))
    while heap and len(tree) < nodes:
        negative, path, members = heapq.heappop(heap)
        tree[path] = -negative
        for token, below in _children(buffer, members, len(path) + 1, high, size).items():
            heapq.heappush(heap, (-below.shape[0] / total, path + (token,), below))
    return tree


def tree_replay(prompts: list[tuple[int, ...]], outputs: list[list[int]], rows: int,
                cost: StepCostModel, cache_tokens: int = 262_144, max_match: int = 32) -> None:
    """Offline: steps a best path vs a best tree of ``rows`` nodes would take to
    emit the greedy ``outputs`` (module doc). Both use the longest match in the
    request so far or, when longer, in the earlier outputs."""
    cache = SuffixCache(cache_tokens)
    steps = {"path": 0, "tree": 0}
    emitted = 0
    for prompt, out in zip(prompts, outputs):
        full = np.asarray(prompt + tuple(out), dtype=np.int64)
        for kind in steps:
            t = 0
            while t < len(out):
                context = full[:len(prompt) + t]
                candidates: list[tuple] = []
                ends = np.flatnonzero(context[:-1] == context[-1])
                match, own = longest_match(context, ends, context, matched=1,
                                           max_match=max_match, low=0)
                candidates.append((match, context, own, context.shape[0], None))
                g_match, g_ends = cache.match(context, max_match=max_match)
                candidates.append((g_match, cache.ring, g_ends, cache.written, cache.max_tokens))
                match, buffer, ends, high, size = max(candidates, key=lambda c: c[0])
                truth = tuple(out[t:t + rows])
                accepted = 0
                if match and ends.size:
                    if kind == "tree":
                        tree = best_tree(buffer, ends, rows, high, size)
                    else:
                        tree = {}
                        path: tuple[int, ...] = ()
                        members = ends
                        while len(path) < rows:
                            groups = _children(buffer, members, len(path) + 1, high, size)
                            if not groups:
                                break
                            token, members = max(groups.items(), key=lambda g: g[1].shape[0])
                            path += (token,)
                            tree[path] = 1.0
                    while accepted < len(truth) and truth[:accepted + 1] in tree:
                        accepted += 1
                t += accepted + 1
                steps[kind] += 1
        emitted += len(out)
        cache.insert(out)
    print(f"\ntree replay: {len(outputs)} requests, {emitted} tokens, {rows} proposed tokens "
          f"({rows + 1} rows a step)")
    print("| verification | steps | tokens/step | predicted decode tok/s |")
    print("|---|---:|---:|---:|")
    for kind, count in steps.items():
        per_step = emitted / count
        print(f"| best {kind} | {count} | {per_step:.2f} | "
              f"{per_step / cost.seconds(1 + rows):.1f} |")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=["grounded", "repeated"],
                        choices=["grounded", "repeated"])
    parser.add_argument("--methods", nargs="+", default=["ngram", "suffix"],
                        choices=["ngram", "draft", "suffix"])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2,
                        help="passes per method at 1 stream (per request the fastest counts)")
    parser.add_argument("--limit", type=int, default=None, help="first N requests only")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--tree-replay", action="store_true")
    parser.add_argument("--engine-arg", action="append", default=[], metavar="FIELD=VALUE",
                        help="an EngineConfig field (e.g. suffix_spec_factor=2.0), repeatable")
    args = parser.parse_args()

    path = default_model_path()
    tokenizer = Tokenizer.load(path)
    config = EngineConfig(model_path=path, max_model_len=2048)
    for item in args.engine_arg:
        field, value = item.split("=", 1)
        current = getattr(config, field)
        kind = type(current) if current is not None else int
        config = dataclasses.replace(config, **{field: (
            value.lower() in ("1", "true", "yes") if kind is bool else kind(value))})
    log = StepLog()
    backend = TorchBackend(config, step_observer=log)
    print(f"load average before: {load():.2f}; max_tokens {args.max_tokens}; "
          f"engine: speculative cost model {config.speculative_cost_model}, "
          f"disable batch size {config.speculative_disable_batch_size}, "
          f"n-gram k={config.num_speculative_tokens}, suffix k="
          f"{config.suffix_num_speculative_tokens} factor {config.suffix_spec_factor} "
          f"min prob {config.suffix_min_token_prob}")
    report: dict[str, object] = {"config": {k: str(v) for k, v in
                                            dataclasses.asdict(config).items()}}
    await backend.start()
    try:
        options = SamplingOptions(max_tokens=args.max_tokens)
        methods = [SpeculativeOptions(SpeculativeMethod.NONE)] + [
            SpeculativeOptions(SpeculativeMethod(m)) for m in args.methods]
        await run_one(backend, (1, 2, 3), SamplingOptions(max_tokens=4), methods[0])  # warm
        for name in args.workloads:
            prompts = workload(name, tokenizer)[:args.limit]
            print(f"\n== workload {name}: {len(prompts)} requests, prompts of "
                  f"{statistics.mean(map(len, prompts)):.0f} tokens (mean); load {load():.2f}")
            results: dict[str, object] = {}
            for streams in args.streams:
                if streams == 1:
                    results["1"] = await single_stream(backend, log, prompts, options, methods,
                                                       args.rounds)
                else:
                    results[str(streams)] = await many_streams(backend, log, prompts, options,
                                                               methods, streams)
            if args.tree_replay:
                log.steps.clear()
                reference = (await one_pass(backend, log, prompts, options, methods[0])).outputs
                speculator = backend.speculator
                assert speculator is not None
                for rows in (3, 7, 15):  # + the sequence's own row: 4, 8, 16 rows
                    tree_replay(prompts, reference, rows, speculator.cost)
            report[name] = results
    finally:
        await backend.shutdown()
    print(f"\nload average after: {load():.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
