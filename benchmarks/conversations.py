"""Multi-turn chats over a KV pool they do not fit: the second KV tier off vs on, one run.

Issue 31, item 2 ("Must show"): many conversations with one shared system
prompt, each user turn adding text, the model's replies kept as history (as
a chat client sends them), a few users at once, and the engine's KV pool
(``--kv-cache-bytes``) too small to keep every conversation, so a returning
turn finds its history evicted. Without the tier it prefills the whole
history again; with it (``--kv-offload-bytes``) the evicted blocks come back
from host memory.

For each mode, in turn (off, on, off, on ... with ``--repeats``), a fresh
mesh without Envoy (tokenizer, cache, one engine, router; the same
``--kv-cache-bytes``), one short warm-up request, then
``llmesh bench --dataset-name conversations --conversations-num N`` against
the router (the same seed, so the same conversations) with
``--save-detailed``. The engine's ``/metrics`` are read before and after the
measured run.

Prints, in one table: TTFT p50/p99 per turn for off and on (medians over the
repeats), the returning turns' (turn >= 1) TTFT p50 ratio on/off (target
<= 0.3), the tier's hit rate (blocks found / blocks looked up) and what it
stored, restored and holds (bytes), the prompt tokens the engine computed,
whether the greedy outputs of every run are identical (by conversation and
turn), the block check after each run (``free + cached == total``, nothing
used), and the load average at each run's start and end.

Usage (from the repository root, so the mesh runs this checkout; alone on the
machine, it measures CPU time)::

    python -m benchmarks.conversations            # the issue's shape (long here)
    python -m benchmarks.conversations --quick    # a fast check (6 x 3, short)

Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.flags import integer, size
from services.cli.mesh import Mesh, MeshStartError, child_env

MODES = ("off", "on")
#: The engine metrics (prefix ``llmesh:``) this benchmark reads; see
#: services/engine/metrics.py and docs/observability.md.
TIER_COUNTERS = ("kv_offload_queries_total", "kv_offload_hits_total",
                 "kv_offload_stored_blocks_total", "kv_offload_restored_blocks_total",
                 "kv_offload_evicted_blocks_total", "prompt_tokens_computed_total",
                 "prompt_tokens_total")
TIER_GAUGES = ("kv_offload_bytes", "kv_offload_capacity_bytes", "kv_cache_num_blocks")


@dataclass(frozen=True)
class Shape:
    """The conversations and the engine's memory of one benchmark."""

    conversations: int
    turns: int
    system_len: int
    turn_len: int
    output_len: int
    users: int
    kv_cache_bytes: str
    kv_offload_bytes: str

    def bench_args(self, seed: int) -> list[str]:
        return ["--dataset-name", "conversations", "--conversations-num",
                str(self.conversations), "--conversations-turns", str(self.turns),
                "--conversations-system-len", str(self.system_len),
                "--conversations-turn-len", str(self.turn_len),
                "--conversations-output-len", str(self.output_len),
                "--max-concurrency", str(self.users), "--seed", str(seed)]


#: The issue's shape: 64 conversations x 8 turns, a 1,000-token system
#: prompt, 300 tokens a user turn, 32 out, 8 users; a pool of ~11,600 tokens
#: (SmolLM2-135M, fp32 KV: 46,080 bytes a token) against ~175,000 tokens of
#: history, and a tier that holds it all.
FULL = Shape(64, 8, 1000, 300, 32, 8, "512MiB", "8GiB")
#: ``--quick``: the same mechanism in about a minute a mode: ~3,100 tokens of
#: history against a pool of ~1,600 (the longest prompt is ~720).
QUICK = Shape(6, 3, 256, 128, 16, 2, "72MiB", "256MiB")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="6 conversations x 3 turns, short texts (a fast check)")
    parser.add_argument("--conversations", type=integer(1), help="default: 64 (quick: 6)")
    parser.add_argument("--turns", type=integer(1),
                        help="user turns each (default: 8; quick: 3)")
    parser.add_argument("--system-len", type=integer(1),
                        help="system prompt tokens (default: 1000)")
    parser.add_argument("--turn-len", type=integer(1),
                        help="tokens a user turn adds (default: 300)")
    parser.add_argument("--output-len", type=integer(1), help="tokens out a turn (default: 32)")
    parser.add_argument("--users", type=integer(1), help="concurrent users (default: 8; quick: 2)")
    parser.add_argument("--kv-cache-bytes", type=size,
                        help="the engine's KV pool (default: 512MiB)")
    parser.add_argument("--kv-offload-bytes", type=size,
                        help="the tier with it on (default: 8GiB)")
    parser.add_argument("--repeats", type=integer(1), default=1,
                        help="runs per mode, interleaved off/on (default: 1)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="tier modes to run (default: off on)")
    parser.add_argument("--seed", type=integer(0), default=0)
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="keep the runs' JSON and the meshes' logs here (default: a "
                             "temporary folder, removed at the end)")
    args = parser.parse_args(argv)
    base = QUICK if args.quick else FULL
    args.shape = Shape(*(getattr(args, name) if getattr(args, name) is not None
                         else getattr(base, name) for name in (
                             "conversations", "turns", "system_len", "turn_len", "output_len",
                             "users", "kv_cache_bytes", "kv_offload_bytes")))
    return args


def scrape(metrics_address: str) -> dict[str, float]:
    """The engine's ``llmesh:`` samples (the ones named above and the block
    gauges by state), by name without the prefix."""
    text = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10).read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("llmesh:"):
            continue
        name, value = line[len("llmesh:"):].rsplit(" ", 1)
        if name in TIER_COUNTERS or name in TIER_GAUGES:
            values[name] = float(value)
        elif name.startswith("kv_cache_blocks{state="):
            values["blocks_" + name.split('"')[1]] = float(value)
    return values


def block_check(metrics_address: str, timeout_s: float = 10.0) -> str:
    """``ok (free F + cached C == total T)`` once the engine is idle, else what failed."""
    deadline = time.monotonic() + timeout_s
    while True:
        values = scrape(metrics_address)
        free, cached = values.get("blocks_free"), values.get("blocks_cached")
        used, total = values.get("blocks_used"), values.get("kv_cache_num_blocks")
        if None in (free, cached, used, total):
            return "n/a (the engine publishes no kv_cache_blocks)"
        assert free is not None and cached is not None and used is not None
        if used == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if used == 0 and free + cached == total:
        return f"ok (free {free:.0f} + cached {cached:.0f} == total {total:.0f})"
    return f"FAILED (free {free:.0f} cached {cached:.0f} used {used:.0f} total {total:.0f})"


class BenchFailed(RuntimeError):
    """A ``llmesh bench`` run exited non-zero (its stderr went to ours)."""


def bench(address: str, args: list[str], result: Path) -> dict:
    """One ``llmesh bench`` run against the router at ``address``; its JSON
    result. Its stderr is ours, so a failure shows its own message.

    Raises:
      BenchFailed: it exited non-zero.
    """
    command = [sys.executable, "-m", "services.bench", "--backend", "llmesh",
               "--base-url", address, *args, "--save-detailed", "--disable-tqdm",
               "--result-file", str(result)]
    done = subprocess.run(command, env=child_env(), stdout=subprocess.DEVNULL)
    if done.returncode != 0:
        raise BenchFailed(f"llmesh bench exited {done.returncode} (its messages are above): "
                          f"{' '.join(args)}")
    return json.loads(result.read_text())


def run_mode(shape: Shape, mode: str, seed: int, run_dir: Path, index: int) -> dict:
    """A fresh mesh with the tier ``mode``; a warm-up, the measured run, the engine's figures."""
    engine_args = ["--kv-cache-bytes", shape.kv_cache_bytes]
    if mode == "on":
        engine_args += ["--kv-offload-bytes", shape.kv_offload_bytes]
    with Mesh(ingress_port=0, admin_port=0, with_envoy=False, engine_args=engine_args,
              run_dir=run_dir / f"mesh-{index}-{mode}") as mesh:
        address, metrics = mesh.router.grpc_address, mesh.engines[0].metrics_address
        # Warm-up: one short request (first-call costs), not measured.
        bench(address, ["--random-input-len", "32", "--random-output-len", "4",
                        "--num-prompts", "1"], run_dir / f"warm-{index}-{mode}.json")
        before = scrape(metrics)
        result = bench(address, shape.bench_args(seed), run_dir / f"run-{index}-{mode}.json")
        after = scrape(metrics)
        result["blocks"] = block_check(metrics)
    result["engine"] = {name: after.get(name, 0.0) - before.get(name, 0.0)
                        for name in TIER_COUNTERS}
    result["engine"].update({name: after.get(name) for name in TIER_GAUGES})
    result["mode"] = mode
    return result


def ms(values: Sequence[float | None], q: float) -> float | None:
    """The ``q``-th percentile (ms) of successful values given in seconds."""
    import numpy as np

    good = [v for v in values if v is not None]
    return float(np.percentile(np.asarray(good) * 1000.0, q)) if good else None


def turn_ttft(run: dict, turns: set[int], q: float) -> float | None:
    """TTFT percentile (ms) of ``run``'s requests for the given turns."""
    return ms([t for t, turn in zip(run["ttfts"], run["turns"], strict=True) if turn in turns], q)


def median(values: Sequence[float | None]) -> float | None:
    good = [v for v in values if v is not None]
    return statistics.median(good) if good else None


def fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def outputs_by_turn(run: dict) -> dict[str, str]:
    return dict(zip(run["tags"], run["generated_texts"], strict=True))


def print_report(shape: Shape, runs: list[dict]) -> None:
    by_mode = {mode: [r for r in runs if r["mode"] == mode] for mode in MODES}
    repeats = max(len(r) for r in by_mode.values())
    turns = sorted({t for r in runs for t in r["turns"] if t is not None})
    print(f"\n{shape.conversations} conversations x {shape.turns} turns, system prompt "
          f"{shape.system_len} tokens, {shape.turn_len} tokens a user turn, "
          f"{shape.output_len} out, {shape.users} users; KV pool {shape.kv_cache_bytes}, "
          f"tier {shape.kv_offload_bytes} when on; {repeats} run(s) a mode "
          "(medians over runs)")
    row = "{:>10} {:>8} {:>10} {:>10} {:>10} {:>10} {:>8}"
    print(row.format("turn", "prompt", "off p50", "off p99", "on p50", "on p99", "on/off"))
    groups = [(str(t), {t}) for t in turns] + [("returning", set(turns) - {0})]
    ratio = None
    for label, group in groups:
        cells = {(mode, q): median([turn_ttft(r, group, q) for r in by_mode[mode]])
                 for mode in MODES for q in (50, 99)}
        prompt = median([statistics.mean(
            [n for n, t in zip(r["input_lens"], r["turns"], strict=True) if t in group])
            for r in runs])
        off, on = cells[("off", 50)], cells[("on", 50)]
        ratio = on / off if off and on is not None else None
        print(row.format(label, fmt(prompt), *(fmt(cells[(m, q)]) for m in MODES
                                               for q in (50, 99)), fmt(ratio, 2)))
    print(f"returning turns TTFT p50 on/off: {fmt(ratio, 2)} (target <= 0.30)")
    for run in runs:
        engine = run["engine"]
        queries, hits = engine["kv_offload_queries_total"], engine["kv_offload_hits_total"]
        rate = f"{hits / queries:.1%}" if queries else "-"
        print(f"tier {run['mode']:>3}: hit rate {rate} ({hits:.0f}/{queries:.0f} blocks), "
              f"stored {engine['kv_offload_stored_blocks_total']:.0f}, restored "
              f"{engine['kv_offload_restored_blocks_total']:.0f}, evicted "
              f"{engine['kv_offload_evicted_blocks_total']:.0f} blocks; holds "
              f"{fmt(engine['kv_offload_bytes'])} of {fmt(engine['kv_offload_capacity_bytes'])} "
              f"bytes; prompt tokens computed {engine['prompt_tokens_computed_total']:.0f} of "
              f"{engine['prompt_tokens_total']:.0f}; {run['completed']} ok, {run['failed']} "
              f"failed, {run['duration']:.0f} s; blocks after: {run['blocks']}; load "
              f"{run['loadavg_start'][0]:.2f} -> {run['loadavg_end'][0]:.2f}")
    reference = outputs_by_turn(runs[0])
    same = all(outputs_by_turn(r) == reference for r in runs[1:])
    differing = sorted({tag for r in runs[1:] for tag, text in outputs_by_turn(r).items()
                        if reference.get(tag) != text})
    print(f"greedy outputs identical across all {len(runs)} runs: {'yes' if same else 'NO'}"
          + ("" if same else f" ({len(differing)} turns differ, first: {differing[:3]})"))


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark; 0 done, 1 a bench run failed (its stderr shown) or a
    mesh did not start (one line naming its log)."""
    args = parse_args(argv)
    with contextlib.ExitStack() as stack:
        if args.out_dir is None:
            run_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(
                prefix="conversations-")))
        else:
            run_dir = args.out_dir.resolve()
            run_dir.mkdir(parents=True, exist_ok=True)
        try:
            run_all(args, run_dir)
        except (BenchFailed, MeshStartError) as error:
            kept = (f"the meshes' logs are in {run_dir}" if args.out_dir is not None else
                    "--out-dir DIR keeps the meshes' logs")
            print(f"conversations: {str(error).splitlines()[0]}; {kept}", file=sys.stderr)
            return 1
    return 0


def run_all(args: argparse.Namespace, run_dir: Path) -> None:
    """Every run in ``run_dir``, then the report."""
    shape: Shape = args.shape
    print(f"started {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, load {os.getloadavg()}, "
          f"{os.cpu_count()} CPUs; runs in {run_dir}", flush=True)
    runs = []
    for index in range(args.repeats):
        order = args.modes if index % 2 == 0 else args.modes[::-1]
        for mode in order:
            runs.append(run_mode(shape, mode, args.seed, run_dir, index))
            # With the engine's figures, so that a cut-short benchmark keeps them.
            (run_dir / f"run-{index}-{mode}.json").write_text(json.dumps(runs[-1]))
            print(f"run {index} tier {mode}: {runs[-1]['duration']:.0f} s, "
                  f"load {os.getloadavg()}", flush=True)
    print_report(shape, runs)
    print(f"ended {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, load {os.getloadavg()}")


if __name__ == "__main__":
    # SIGTERM unwinds as Ctrl-C does: the meshes stop, the temporary folder goes
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())
