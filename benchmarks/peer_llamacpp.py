"""llmesh against llama.cpp's llama-server, both already running (not a test).

    python benchmarks/peer_llamacpp.py --llmesh-url 127.0.0.1:PORT --llama-url http://127.0.0.1:PORT
        [--concurrency 1,8,16,32] [--prompt-len 512] [--output-len 128] [--quick] ...

``benchmarks/peer_llamacpp.sh`` builds llama-server, starts both servers and
runs this; see docs/bench.md, "Peer benchmark: llama.cpp".

Every measurement is one ``llmesh bench`` run (``python -m services.bench``,
a subprocess; its JSON is kept): ``--backend llmesh`` through Envoy's gRPC
ingress, ``--backend openai`` (``/v1/completions``, streaming) for
llama-server. Both get the very same requests: the ``random`` dataset, the
same tokenizer (the served GGUF), the same seed, ``--prompt-len`` tokens in,
``--output-len`` tokens out with EOS ignored, greedy. Scenarios, one per
concurrency level (a fixed number of closed-loop clients), ``--rounds``
times each in alternation (llmesh, llama-server, llmesh, llama-server ...),
so that load drift on the machine hits both; each round has its own seed (the
same for both targets), so no round finds the previous round's prompts in a
prefix cache. The one-stream level also gives TTFT (p50/p95) and TPOT (p50).
Percentiles pool the requests of all rounds; throughput is all rounds' output
tokens over all rounds' durations.

At the end, ``benchmarks/roofline.py`` measures the memory read bandwidth
and the batch-1 decode rooflines, and the report prints the figures, the
ratios llmesh / llama-server, the issue's targets (PASS/MISS) and the load
averages, and writes everything to a JSON file (its path is printed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # run as a script (by peer_llamacpp.sh)

from benchmarks.flags import integer, number  # noqa: E402

TARGETS = ("llmesh", "llama")
LABELS = {"llmesh": "llmesh", "llama": "llama-server"}

#: Defaults of the run shape: --quick, else full.
QUICK_DEFAULTS = {"concurrency": "1,4", "prompt_len": 128, "output_len": 32, "rounds": 1,
                  "ttft_requests": 3, "prompts_per_stream": 1, "max_run_seconds": 60.0}
FULL_DEFAULTS = {"concurrency": "1,8,16,32", "prompt_len": 512, "output_len": 128, "rounds": 2,
                 "ttft_requests": 8, "prompts_per_stream": 2, "max_run_seconds": 240.0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="llmesh vs llama-server: TTFT, TPOT, throughput, roofline.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--llmesh-url", help="host:port of Envoy's ingress (required)")
    parser.add_argument("--llama-url", help="http://host:port of llama-server (required)")
    parser.add_argument("--print-shape", action="store_true",
                        help="print 'MAX_CONCURRENCY PROMPT_LEN OUTPUT_LEN' as the flags "
                             "resolve and exit (for peer_llamacpp.sh)")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke check: defaults become {QUICK_DEFAULTS}")
    parser.add_argument("--concurrency", default=None,
                        help=f"concurrent streams, comma list (default {FULL_DEFAULTS['concurrency']})")
    parser.add_argument("--prompt-len", type=integer(1), default=None,
                        help=f"prompt tokens (default {FULL_DEFAULTS['prompt_len']})")
    parser.add_argument("--output-len", type=integer(2), default=None,
                        help=f"output tokens, EOS ignored (default {FULL_DEFAULTS['output_len']})")
    parser.add_argument("--rounds", type=integer(1), default=None,
                        help=f"alternations per level (default {FULL_DEFAULTS['rounds']})")
    parser.add_argument("--ttft-requests", type=integer(1), default=None,
                        help="requests per round at one stream (TTFT, TPOT) "
                             f"(default {FULL_DEFAULTS['ttft_requests']})")
    parser.add_argument("--prompts-per-stream", type=number(0), default=None,
                        help="requests per round at N streams = this x N "
                             f"(default {FULL_DEFAULTS['prompts_per_stream']})")
    parser.add_argument("--max-run-seconds", type=number(0), default=None,
                        help="one run stops sending after this (llmesh bench --duration; "
                             f"in-flight requests finish) (default {FULL_DEFAULTS['max_run_seconds']})")
    parser.add_argument("--num-warmups", type=integer(0), default=1,
                        help="warm-up requests before each run (not counted)")
    parser.add_argument("--seed", type=integer(0), default=0)
    parser.add_argument("--out-dir", default=None,
                        help="where the runs' JSON and the summary go "
                             "(default .cache/peer_llamacpp/DATE in the repository)")
    parser.add_argument("--llama-command", default="",
                        help="llama-server's command line, recorded in the JSON")
    parser.add_argument("--llmesh-command", default="",
                        help="the mesh's command line, recorded in the JSON")
    parser.add_argument("--skip-roofline", action="store_true")
    parser.add_argument("--resume", action="store_true",
                        help="with --out-dir of an earlier run: reuse the runs whose JSON is "
                             "there (same flags!), run only the missing ones, report again")
    args = parser.parse_args(argv)
    defaults = QUICK_DEFAULTS if args.quick else FULL_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        args.levels = sorted({int(v) for v in str(args.concurrency).split(",") if v.strip()})
    except ValueError:
        parser.error(f"--concurrency {args.concurrency!r}: expected integers, comma-separated")
    if not args.levels or min(args.levels) < 1:
        parser.error("--concurrency: every value must be >= 1")
    if args.resume and not args.out_dir:
        parser.error("--resume needs --out-dir")
    if not args.print_shape and not (args.llmesh_url and args.llama_url):
        parser.error("--llmesh-url and --llama-url are required")
    return args


def log(message: str) -> None:
    print(f"peer_llamacpp: {message}", file=sys.stderr, flush=True)


# -- runs --------------------------------------------------------------------


def child_env() -> dict[str, str]:
    """This environment with the repository and its generated stubs (``llmesh.v1``)
    first on PYTHONPATH, as the mesh gives its services."""
    env = dict(os.environ)
    paths = [str(REPO_ROOT), str(REPO_ROOT / "services" / "gen")]
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH")
                                                  else []))
    return env


def requests_for(args: argparse.Namespace, level: int) -> int:
    if level == 1:
        return max(args.ttft_requests, math.ceil(args.prompts_per_stream))
    return max(level, math.ceil(args.prompts_per_stream * level))


def bench_command(args: argparse.Namespace, target: str, level: int, seed: int,
                  result_file: Path) -> list[str]:
    """The ``llmesh bench`` command line of one run (identical prompts for both targets)."""
    if target == "llmesh":
        where = ["--backend", "llmesh", "--base-url", args.llmesh_url]
    else:
        where = ["--backend", "openai", "--base-url", args.llama_url]
    return [sys.executable, "-m", "services.bench", *where,
            "--dataset-name", "random",
            "--random-input-len", str(args.prompt_len),
            "--random-output-len", str(args.output_len),
            "--num-prompts", str(requests_for(args, level)),
            "--max-concurrency", str(level),
            "--request-rate", "inf",
            "--num-warmups", str(args.num_warmups),
            "--duration", f"{args.max_run_seconds:g}",
            "--seed", str(seed),
            "--temperature", "0",
            "--ignore-eos",
            "--result-file", str(result_file),
            "--disable-tqdm",
            "--metadata", f"peer_target={target}", f"peer_level={level}"]


class BenchFailed(RuntimeError):
    """One ``llmesh bench`` run failed (e.g. a server unreachable); the message
    is one line: its exit status, its last message and its log file."""


def run_bench(command: list[str], log_file: Path) -> dict[str, Any]:
    """Runs one ``llmesh bench``; returns its result JSON.

    Raises:
      BenchFailed: it exited non-zero or wrote no result.
    """
    began = time.monotonic()
    with log_file.open("w") as out:
        code = subprocess.call(command, cwd=REPO_ROOT, env=child_env(), stdout=out,
                               stderr=subprocess.STDOUT)
    result_file = Path(command[command.index("--result-file") + 1])
    if code != 0 or not result_file.exists():
        said = [line for line in log_file.read_text().splitlines() if line.startswith("llmesh")]
        last = said[-1] if said else "no message"
        raise BenchFailed(f"llmesh bench exited with {code} ({last}); log: {log_file}")
    result = json.loads(result_file.read_text())
    result["_wall_s"] = time.monotonic() - began
    return result


# -- figures -----------------------------------------------------------------


def percentile(values: list[float], p: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), or None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One target's figures at one level, pooled over its rounds."""
    ttfts = [t * 1000 for r in runs for t in r["ttfts"] if t is not None]
    tpots = [t * 1000 for r in runs for t in r["tpots"] if t is not None]
    output = sum(r["total_output_tokens"] for r in runs)
    duration = sum(r["duration"] for r in runs)
    per_round = [r["output_throughput"] for r in runs]
    return {
        "rounds": len(runs),
        "completed": sum(r["completed"] for r in runs),
        "failed": sum(r["failed"] for r in runs),
        "not_sent": sum(r.get("not_sent") or 0 for r in runs),
        "errors_by_status": [r.get("errors_by_status") for r in runs],
        "ttft_p50_ms": percentile(ttfts, 50), "ttft_p95_ms": percentile(ttfts, 95),
        "tpot_p50_ms": percentile(tpots, 50), "tpot_p95_ms": percentile(tpots, 95),
        "output_throughput": output / duration if duration else None,
        "output_throughput_per_round": per_round,
        "total_output_tokens": output,
        "duration_s": duration,
        "output_lens": sorted({n for r in runs for n in r["output_lens"]}),
        "input_lens": sorted({n for r in runs for n in r["input_lens"]}),
        "server_prompt_tokens": sorted({n for r in runs for n in r["server_prompt_tokens"]
                                        if n is not None}),
        "server_completion_tokens": sorted({n for r in runs
                                            for n in r["server_completion_tokens"]
                                            if n is not None}),
        "loadavg_1m": [[r["loadavg_start"][0], r["loadavg_end"][0]] for r in runs],
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def run_roofline(args: argparse.Namespace, llmesh_tpot: float | None,
                 llama_tpot: float | None, out: Path) -> dict[str, Any] | None:
    command = [sys.executable, str(REPO_ROOT / "benchmarks" / "roofline.py"), "--json", str(out)]
    if llmesh_tpot:
        command += ["--llmesh-tpot-ms", f"{llmesh_tpot:.4f}"]
    if llama_tpot:
        command += ["--llama-tpot-ms", f"{llama_tpot:.4f}"]
    log("roofline: " + shlex.join(command))
    code = subprocess.call(command, cwd=REPO_ROOT, env=child_env(), stdout=subprocess.DEVNULL)
    if code != 0 or not out.exists():
        log(f"roofline.py failed (exit {code})")
        return None
    return {"command": shlex.join(command), **json.loads(out.read_text())}


def targets(levels: dict[int, dict[str, Any]], roof: dict[str, Any] | None
            ) -> list[dict[str, Any]]:
    one = levels.get(1, {})
    sixteen = levels.get(16)
    fraction = roof["llmesh"]["fraction"] if roof else None
    rows = [
        ("throughput at 16 streams, llmesh / llama-server", ">=", 2.0,
         ratio(sixteen["llmesh"]["output_throughput"], sixteen["llama"]["output_throughput"])
         if sixteen else None),
        ("one-stream TPOT p50, llmesh / llama-server", "<=", 1.0,
         ratio(one["llmesh"]["tpot_p50_ms"], one["llama"]["tpot_p50_ms"]) if one else None),
        ("TTFT p50 (one stream), llmesh / llama-server", "<=", 0.5,
         ratio(one["llmesh"]["ttft_p50_ms"], one["llama"]["ttft_p50_ms"]) if one else None),
        ("one-stream decode, llmesh / its roofline", ">=", 0.40, fraction),
    ]
    result = []
    for name, op, threshold, value in rows:
        if value is None:
            verdict = "n/a"
        else:
            verdict = "PASS" if (value >= threshold if op == ">=" else value <= threshold) \
                else "MISS"
        result.append({"target": name, "op": op, "threshold": threshold, "value": value,
                       "verdict": verdict})
    return result


def report(args: argparse.Namespace, levels: dict[int, dict[str, Any]],
           roof: dict[str, Any] | None, goals: list[dict[str, Any]],
           loads: list[float]) -> str:
    lines = [
        "",
        f"## llmesh vs llama-server: {args.prompt_len}-token prompts, {args.output_len} tokens "
        f"out (EOS ignored), greedy, {args.rounds} round(s) per level in alternation",
        "",
        "| metric | llmesh | llama-server | llmesh / llama-server |",
        "|---|---:|---:|---:|",
    ]
    one = levels.get(1)
    if one:
        for key, name in (("ttft_p50_ms", "TTFT p50 (1 stream), ms"),
                          ("ttft_p95_ms", "TTFT p95 (1 stream), ms"),
                          ("tpot_p50_ms", "TPOT p50 (1 stream), ms")):
            a, b = one["llmesh"][key], one["llama"][key]
            lines.append(f"| {name} | {fmt(a)} | {fmt(b)} | {fmt(ratio(a, b), 2)} |")
    for level, figures in levels.items():
        a, b = figures["llmesh"]["output_throughput"], figures["llama"]["output_throughput"]
        rounds = ""
        if args.rounds > 1:  # each target's per-round figures, to show the spread
            rounds = " (per round: " + "; ".join(
                ", ".join(f"{v:.1f}" for v in figures[t]["output_throughput_per_round"])
                for t in TARGETS) + ")"
        lines.append(f"| output tok/s at {level} stream{'s' if level > 1 else ''}{rounds} | "
                     f"{fmt(a)} | {fmt(b)} | {fmt(ratio(a, b), 2)} |")
    lines += ["", "| level | target | requests | failed | TTFT p50 ms | TTFT p95 ms | "
                  "TPOT p50 ms | TPOT p95 ms | output lens | server prompt tokens |",
              "|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for level, figures in levels.items():
        for target in TARGETS:
            f = figures[target]
            lines.append(f"| {level} | {LABELS[target]} | {f['completed']} | {f['failed']} | "
                         f"{fmt(f['ttft_p50_ms'])} | {fmt(f['ttft_p95_ms'])} | "
                         f"{fmt(f['tpot_p50_ms'])} | {fmt(f['tpot_p95_ms'])} | "
                         f"{','.join(map(str, f['output_lens']))} | "
                         f"{','.join(map(str, f['server_prompt_tokens'])) or 'n/a'} |")
    if roof:
        bw = roof["bandwidth"]
        lines += ["", f"## Decode roofline (batch 1): memory read bandwidth "
                      f"{bw['bytes_per_s'] / 1e9:.1f} GB/s ({bw['method']} over "
                      f"{bw['bytes'] / (1 << 30):.3g} GiB, {bw['threads']} threads = the "
                      f"engine's, best of {bw['repeats']})", "",
                  "| target | weight bytes / step | roofline tok/s | one-stream tok/s "
                  "(1000 / TPOT p50) | of roofline |",
                  "|---|---:|---:|---:|---:|"]
        for key, name in (("llmesh", "llmesh (torch engine, default config)"),
                          ("llama_cpp", "llama-server (GGUF tensor data)")):
            r = roof[key]
            mb = "n/a" if not r["weight_bytes"] else f"{r['weight_bytes'] / 1e6:.1f} MB"
            frac = "n/a" if r["fraction"] is None else f"{r['fraction'] * 100:.0f} %"
            lines.append(f"| {name} | {mb} | {fmt(r['roofline_tok_s'], 0)} | "
                         f"{fmt(r['decode_tok_s'])} | {frac} |")
        if roof["llmesh"].get("missing"):
            lines.append(f"\nllmesh roofline: n/a: {roof['llmesh']['missing']}")
    lines += ["", "## Targets (issue 5)", ""]
    for goal in goals:
        value = "n/a" if goal["value"] is None else f"{goal['value']:.2f}"
        lines.append(f"- {goal['verdict']:4}  {goal['target']} = {value} "
                     f"(target {goal['op']} {goal['threshold']:g})")
    lines += ["", f"1-minute load average: {min(loads):.2f} to {max(loads):.2f} over the runs "
                  f"(os.getloadavg at each run's start and end; the machine has "
                  f"{os.cpu_count()} CPUs)"]
    return "\n".join(lines)


def check_matching(args: argparse.Namespace, levels: dict[int, dict[str, Any]]) -> list[str]:
    """Warnings where the two targets did not get or produce the same token counts."""
    notes = []
    for level, figures in levels.items():
        for target in TARGETS:
            f = figures[target]
            if f["failed"] or f["not_sent"]:
                notes.append(f"level {level}, {LABELS[target]}: {f['failed']} failed, "
                             f"{f['not_sent']} not sent ({f['errors_by_status']})")
            if f["output_lens"] != [args.output_len]:
                notes.append(f"level {level}, {LABELS[target]}: output lengths "
                             f"{f['output_lens']}, not all {args.output_len}")
            if f["server_prompt_tokens"] and f["server_prompt_tokens"] != [args.prompt_len]:
                notes.append(f"level {level}, {LABELS[target]}: the server counted "
                             f"{f['server_prompt_tokens']} prompt tokens "
                             f"(bench: {args.prompt_len})")
    return notes


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.print_shape:
        print(max(args.levels), args.prompt_len, args.output_len)
        return 0
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = Path(args.out_dir or REPO_ROOT / ".cache" / "peer_llamacpp" / stamp).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    log(f"levels {args.levels}, {args.prompt_len} tokens in, {args.output_len} out, "
        f"{args.rounds} round(s); runs in {out_dir}")
    runs: list[dict[str, Any]] = []
    raw: dict[int, dict[str, list[dict[str, Any]]]] = {}
    began = time.monotonic()
    for index, level in enumerate(args.levels):
        raw[level] = {t: [] for t in TARGETS}
        for round_ in range(args.rounds):
            seed = args.seed + 1000 * round_ + index  # the same for both targets
            for target in TARGETS:
                name = f"c{level}-r{round_}-{target}"
                command = bench_command(args, target, level, seed, out_dir / f"{name}.json")
                log(f"[{time.monotonic() - began:6.0f}s] {name}: "
                    f"{requests_for(args, level)} requests, {level} stream(s), seed {seed}")
                if args.resume and (out_dir / f"{name}.json").exists():
                    result = json.loads((out_dir / f"{name}.json").read_text())
                    result["_wall_s"] = None
                    log(f"{name}: reusing {out_dir / f'{name}.json'}")
                else:
                    result = run_bench(command, out_dir / f"{name}.log")
                raw[level][target].append(result)
                runs.append({"name": name, "level": level, "round": round_, "target": target,
                             "seed": seed, "command": shlex.join(command),
                             "result_file": str(out_dir / f"{name}.json"),
                             "wall_s": result["_wall_s"],
                             "output_throughput": result["output_throughput"],
                             "completed": result["completed"], "failed": result["failed"],
                             "loadavg_start": result["loadavg_start"],
                             "loadavg_end": result["loadavg_end"]})
                log(f"{name}: {result['output_throughput']:.1f} output tok/s, "
                    f"TTFT p50 {fmt(result.get('p50_ttft_ms'))} ms, TPOT p50 "
                    f"{fmt(result.get('p50_tpot_ms'))} ms, load {result['loadavg_end'][0]:.2f}")
    levels = {level: {t: pooled(raw[level][t]) for t in TARGETS} for level in args.levels}
    one = levels.get(1)
    roof = None
    if not args.skip_roofline:
        roof = run_roofline(args, one["llmesh"]["tpot_p50_ms"] if one else None,
                            one["llama"]["tpot_p50_ms"] if one else None,
                            out_dir / "roofline.json")
    goals = targets(levels, roof)
    loads = [v for r in runs for v in (r["loadavg_start"][0], r["loadavg_end"][0])]
    print(report(args, levels, roof, goals, loads), flush=True)
    notes = check_matching(args, levels)
    for note in notes:
        print(f"WARNING: {note}", flush=True)
    summary = {
        "date": stamp,
        "settings": {k: v for k, v in vars(args).items() if k != "levels"} | {
            "levels": args.levels, "cpus": os.cpu_count()},
        "commands": {"llama_server": args.llama_command, "llmesh": args.llmesh_command,
                     "bench_example": {t: next((r["command"] for r in runs
                                                if r["target"] == t), None) for t in TARGETS}},
        "levels": {str(level): figures for level, figures in levels.items()},
        "ratios_llmesh_over_llama": {
            str(level): {key: ratio(f["llmesh"][key], f["llama"][key])
                         for key in ("ttft_p50_ms", "ttft_p95_ms", "tpot_p50_ms",
                                     "output_throughput")}
            for level, f in levels.items()},
        "roofline": roof,
        "targets": goals,
        "warnings": notes,
        "runs": runs,
        "loadavg_1m_range": [min(loads), max(loads)],
        "elapsed_s": time.monotonic() - began,
    }
    path = out_dir / "summary.json"
    path.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\nall numbers: {path}", flush=True)
    return 0


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # subprocess.call kills the running bench on the way out


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _terminate)
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        log("interrupted")
        sys.exit(130)
    except BenchFailed as error:  # e.g. a server unreachable
        log(f"stopped: {error}")
        sys.exit(1)
