"""Decode speed under CPU contention: llmesh and llama-server side by side (not a test).

    python benchmarks/contention.py [--skip-build] [--rounds 2] [--busy 0,1,2]
        [--quota 1.5] [--prompt-len 32] [--output-len 48] [--concurrency 1,8]

Without ``--llmesh-url`` it runs ``benchmarks/peer_llamacpp.sh`` with itself as
the driver (``PEER_DRIVER``): that script builds or finds llama-server, starts
it and the llmesh mesh (default engine settings) on free ports, and calls
this file back with their URLs, llama-server's PID and the mesh's run folder.

Scenarios, in this order, each with both targets at each concurrency level,
``--rounds`` times in alternation (llmesh, llama-server, llama-server,
llmesh, ...; each round its own seed, the same for both targets):

* ``quiet``: nothing else started;
* ``busy N`` for each N in ``--busy`` (> 0): N ``python3 -c "while True:
  pass"`` processes run beside both servers (issue 31's noisy neighbour);
* ``quota Q``: the engine process and llama-server are each moved into a
  new cgroup of their own whose CPU quota is Q CPUs (cgroup v1
  ``cpu.cfs_quota_us`` or v2 ``cpu.max``, created under the cgroup they are
  in; moved back and removed after). The engine finds its new cgroup while
  running (its thread governor re-reads ``/proc/self/cgroup``). Where no
  cgroup can be made (no write access) the scenario is skipped and the report
  says so.

Every measurement is one ``llmesh bench`` run through peer_llamacpp.py's
helpers (``bench_command``, ``run_bench``, ``pooled``): the ``random``
dataset, ``--prompt-len`` tokens in, ``--output-len`` out with EOS ignored,
greedy. One stream reports decode tok/s = 1000 / TPOT p50; N streams report
output tok/s. The report prints each scenario's figures for both targets,
llmesh / llama-server, llmesh's fraction of its quiet speed, the engine's
thread governor metrics after the scenario (``llmesh:engine_num_threads``,
``cpu_contention_events_total``, ``cpu_throttled_seconds_total``), the
targets of issue 31 (one busy process: llmesh one stream >= 40 % of quiet and
>= 5x llama-server) and the load averages.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import peer_llamacpp  # noqa: E402
from benchmarks.flags import integer, integers, number  # noqa: E402
from peer_llamacpp import (  # noqa: E402
    LABELS,
    REPO_ROOT,
    BenchFailed,
    fmt,
    pooled,
    ratio,
    run_bench,
)

from services.engine.torch_backend.cpu_accounting import find_cgroup_cpu  # noqa: E402

BUSY = [sys.executable, "-c", "while True: pass"]
ORDERS = (("llmesh", "llama"), ("llama", "llmesh"))
GOVERNOR_METRICS = ("llmesh:engine_num_threads", "llmesh:cpu_contention_events_total",
                    "llmesh:cpu_throttled_seconds_total")


def log(message: str) -> None:
    print(f"contention: {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--llmesh-url", help="host:port of Envoy's ingress (else: start both "
                        "servers through peer_llamacpp.sh)")
    parser.add_argument("--llama-url", help="http://host:port of llama-server")
    parser.add_argument("--llama-pid", type=integer(1),
                        default=int(os.environ.get("PEER_LLAMA_PID", "0")) or None,
                        help="llama-server's PID (for the quota scenario)")
    parser.add_argument("--mesh-run-dir", type=Path,
                        default=os.environ.get("PEER_MESH_RUN_DIR") or None,
                        help="the mesh's run folder (engine-0.json: PID and metrics port)")
    parser.add_argument("--skip-build", action="store_true",
                        help="peer_llamacpp.sh: fail rather than build llama-server")
    parser.add_argument("--print-shape", action="store_true",
                        help="print 'MAX_CONCURRENCY PROMPT_LEN OUTPUT_LEN' and exit")
    parser.add_argument("--concurrency", type=integers(1), default="1,8",
                        help="streams, comma list")
    parser.add_argument("--busy", type=integers(0), default="1,2",
                        help="busy processes per scenario, comma list (0: none)")
    parser.add_argument("--quota", type=number(0, inclusive=True), default=1.5,
                        help="CPU quota of the quota scenario in CPUs (0: no such scenario)")
    parser.add_argument("--prompt-len", type=integer(1), default=32)
    parser.add_argument("--output-len", type=integer(2), default=48,
                        help="tokens out (TPOT needs two)")
    parser.add_argument("--rounds", type=integer(1), default=2)
    parser.add_argument("--ttft-requests", type=integer(1), default=2,
                        help="requests per one-stream run")
    parser.add_argument("--prompts-per-stream", type=number(0), default=1.0,
                        help="requests per N-stream run = this x N")
    parser.add_argument("--num-warmups", type=integer(0), default=1)
    parser.add_argument("--max-run-seconds", type=number(0), default=60.0,
                        help="each llmesh bench run stops sending after this")
    parser.add_argument("--settle-seconds", type=number(0, inclusive=True), default=2.0,
                        help="wait after a scenario starts before measuring")
    parser.add_argument("--seed", type=integer(0), default=31)
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--llama-command", default="")
    parser.add_argument("--llmesh-command", default="")
    args = parser.parse_args(argv)
    args.levels = args.concurrency
    args.busy_counts = [count for count in args.busy if count > 0]
    return args


def run_servers(argv: list[str]) -> int:
    """Runs peer_llamacpp.sh with this file as its driver (it calls us back)."""
    flags = [a for a in argv if a != "--skip-build"]
    command = [str(REPO_ROOT / "benchmarks" / "peer_llamacpp.sh"),
               *(["--skip-build"] if "--skip-build" in argv else []), *flags]
    env = dict(os.environ, PEER_DRIVER=str(Path(__file__).resolve()))
    return subprocess.call(command, env=env)


# -- scenarios ---------------------------------------------------------------


@contextlib.contextmanager
def busy_processes(count: int) -> Iterator[None]:
    children = [subprocess.Popen(BUSY) for _ in range(count)]
    try:
        yield
    finally:
        for child in children:
            child.kill()
            child.wait()


@contextlib.contextmanager
def cpu_quota(pids: list[int], cpus: float) -> Iterator[None]:
    """Moves each of ``pids`` (whole processes) into a new cgroup of its own
    with a quota of ``cpus`` CPUs (a pod each), and back after. Raises OSError
    where a cgroup cannot be made or joined."""
    with contextlib.ExitStack() as stack:
        for pid in pids:
            stack.enter_context(_own_cgroup(pid, cpus))
        yield


@contextlib.contextmanager
def _own_cgroup(pid: int, cpus: float) -> Iterator[None]:
    cgroup = find_cgroup_cpu(Path(f"/proc/{pid}"))
    if cgroup is None:
        raise OSError(f"no cgroup CPU controller found for pid {pid}")
    home = cgroup.directory
    made = home / f"llmesh-contention-{os.getpid()}-{pid}"
    made.mkdir()
    try:
        period = 100_000
        if cgroup.version == 2:
            (made / "cpu.max").write_text(f"{int(cpus * period)} {period}")
        else:
            (made / "cpu.cfs_period_us").write_text(str(period))
            (made / "cpu.cfs_quota_us").write_text(str(int(cpus * period)))
        (made / "cgroup.procs").write_text(str(pid))
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                (home / "cgroup.procs").write_text(str(pid))
    finally:
        time.sleep(0.2)
        made.rmdir()


def engine_info(run_dir: Path | None) -> dict[str, Any]:
    """The mesh's first engine's port file (``pid``, ``metrics_port``), or {}."""
    if run_dir is None or not (run_dir / "engine-0.json").exists():
        return {}
    return json.loads((run_dir / "engine-0.json").read_text())


def governor_metrics(engine: dict[str, Any]) -> dict[str, float]:
    """The engine's thread governor metrics from its /metrics (empty if unreadable)."""
    port = engine.get("metrics_port")
    if not port or port < 0:
        return {}
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
    except OSError:
        return {}
    found = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in GOVERNOR_METRICS:
            found[name.removeprefix("llmesh:")] = float(value)
    return found


def scenarios(args: argparse.Namespace, engine: dict[str, Any]) -> list[tuple[str, Any]]:
    """``(name, context manager factory or a reason it is skipped)``."""
    found: list[tuple[str, Any]] = [("quiet", contextlib.nullcontext)]
    for count in args.busy_counts:
        found.append((f"busy {count}", lambda count=count: busy_processes(count)))
    if args.quota > 0:
        pids = [pid for pid in (engine.get("pid"), args.llama_pid) if pid]
        name = f"quota {args.quota:g} CPUs"
        if len(pids) < 2:
            found.append((name, "the engine's or llama-server's PID is unknown"))
        else:
            found.append((name, lambda: cpu_quota(pids, args.quota)))
    return found


# -- runs and report ---------------------------------------------------------


def measure(args: argparse.Namespace, out_dir: Path, scenario: str, index: int
            ) -> dict[int, dict[str, Any]]:
    """Both targets at every level, ``--rounds`` times in alternation."""
    raw: dict[int, dict[str, list[dict[str, Any]]]] = {
        level: {t: [] for t in LABELS} for level in args.levels}
    for round_ in range(args.rounds):
        for level in args.levels:
            seed = args.seed + 1000 * round_ + 100 * index + level
            for target in ORDERS[round_ % 2]:
                name = f"{scenario.replace(' ', '_')}-c{level}-r{round_}-{target}"
                command = peer_llamacpp.bench_command(args, target, level, seed,
                                                      out_dir / f"{name}.json")
                launched = time.monotonic()
                result = run_bench(command, out_dir / f"{name}.log")
                # when its requests began, about: after the client's start-up
                result["_requests_began"] = launched + result["_wall_s"] - result["duration"]
                raw[level][target].append(result)
                log(f"{name}: {result['output_throughput']:.1f} output tok/s, TPOT p50 "
                    f"{fmt(result.get('p50_tpot_ms'))} ms, load {result['loadavg_end'][0]:.2f}")
    figures = {level: {t: pooled(raw[level][t]) for t in LABELS} for level in args.levels}
    for level in args.levels:  # the first round's, right after the scenario began
        for target in LABELS:
            tpots = [t for t in raw[level][target][0]["tpots"] if t is not None]
            figures[level][target]["first_round_tpot_p50_ms"] = (
                1000 * statistics.median(tpots) if tpots else None)
            figures[level][target]["_requests_began"] = raw[level][target][0]["_requests_began"]
    return figures


class ThreadTrace:
    """Polls the engine's ``llmesh:engine_num_threads`` every ``period_s`` on a
    thread of its own from :meth:`start` to :meth:`stop`; ``changes`` holds
    ``(seconds since start, threads)`` at start and at each change."""

    def __init__(self, engine: dict[str, Any], period_s: float = 0.2) -> None:
        self._engine, self._period_s = engine, period_s
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="thread-trace", daemon=True)
        self.began = 0.0
        self.changes: list[tuple[float, float]] = []

    def start(self) -> ThreadTrace:
        self.began = time.monotonic()
        self._thread.start()
        return self

    def stop(self) -> list[tuple[float, float]]:
        self._stopping.set()
        self._thread.join()
        return self.changes

    def _poll(self) -> None:
        while not self._stopping.wait(self._period_s):
            threads = governor_metrics(self._engine).get("engine_num_threads")
            if threads is not None and (not self.changes or self.changes[-1][1] != threads):
                self.changes.append((round(time.monotonic() - self.began, 2), threads))


def speed(figures: dict[str, Any], level: int) -> float | None:
    """Decode tok/s at one stream (1000 / TPOT p50), output tok/s at more."""
    if level == 1:
        tpot = figures["tpot_p50_ms"]
        return 1000.0 / tpot if tpot else None
    return figures["output_throughput"]


def report(args: argparse.Namespace, results: dict[str, Any], skipped: dict[str, str],
           governor: dict[str, dict[str, float]], loads: list[float],
           threads: dict[str, list[tuple[float, float]]]) -> tuple[str, list[str]]:
    lines = ["", f"## Decode under CPU contention: {args.prompt_len} tokens in, {args.output_len} "
                 f"out (EOS ignored), greedy, {args.rounds} round(s) in alternation, "
                 f"{os.cpu_count()} CPUs", "",
             "| scenario | streams | llmesh tok/s | llama-server tok/s | llmesh / llama-server "
             "| llmesh of quiet | llama-server of quiet |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    quiet = results.get("quiet", {})
    for scenario, levels in results.items():
        for level, figures in levels.items():
            a, b = speed(figures["llmesh"], level), speed(figures["llama"], level)
            qa = speed(quiet[level]["llmesh"], level) if level in quiet else None
            qb = speed(quiet[level]["llama"], level) if level in quiet else None
            lines.append(f"| {scenario} | {level} | {fmt(a)} | {fmt(b)} | {fmt(ratio(a, b), 2)} | "
                         f"{fmt(ratio(a, qa), 2)} | {fmt(ratio(b, qb), 2)} |")
    for scenario, reason in skipped.items():
        lines.append(f"| {scenario} | skipped: {reason} | | | | | |")
    lines += ["", "(1 stream: decode tok/s = 1000 / TPOT p50; N streams: output tok/s)", "",
              "Engine thread governor after each scenario (the engine's /metrics):", ""]
    for scenario, metrics in governor.items():
        lines.append(f"- {scenario}: " + (", ".join(f"{k} {v:g}" for k, v in metrics.items())
                                          or "n/a"))
    lines += ["", f"The engine's threads from each scenario's start (measuring began after "
                  f"{args.settle_seconds:g} s; seconds: threads), and one stream in the first "
                  "round (right after the start; decode tok/s):", ""]
    for scenario, changes in threads.items():
        first = results.get(scenario, {}).get(1, {})
        decode = {t: first[t].get("first_round_tpot_p50_ms") for t in first}
        began = first.get("llmesh", {}).get("requests_began_s")
        lines.append(f"- {scenario}: " + (", ".join(f"{t:g} s: {n:g}" for t, n in changes)
                                          or "n/a") + "; first round " + ", ".join(
            f"{LABELS[t]} {fmt(1000 / ms if ms else None)}" for t, ms in decode.items())
            + f" (llmesh's requests from {fmt(began, 1)} s)")
    goals = []
    busy = results.get("busy 1", {}).get(1)
    if busy and 1 in quiet:
        kept = ratio(speed(busy["llmesh"], 1), speed(quiet[1]["llmesh"], 1))
        over = ratio(speed(busy["llmesh"], 1), speed(busy["llama"], 1))
        for name, value, threshold in (
                ("one busy process: llmesh one-stream speed / its quiet speed", kept, 0.40),
                ("one busy process: llmesh / llama-server, one stream", over, 5.0)):
            verdict = "n/a" if value is None else ("PASS" if value >= threshold else "MISS")
            goals.append(f"{verdict}: {name} = {fmt(value, 2)} (target >= {threshold:g})")
    lines += ["", "## Targets (issue 31)", "", *[f"- {g}" for g in goals]]
    lines += ["", f"1-minute load average: {min(loads):.2f} to {max(loads):.2f} over the runs "
                  f"(busy processes included)"]
    return "\n".join(lines), goals


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; 0 done, 1 a bench run failed (one line names it), 2 a
    bad flag."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.print_shape:
        print(max(args.levels), args.prompt_len, args.output_len)
        return 0
    if not args.llmesh_url:
        return run_servers(argv)
    # peer_llamacpp.sh stops the driver with SIGTERM: unwind, so busy processes
    # are killed and the engine leaves the quota cgroup
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return run_scenarios(args)
    except BenchFailed as error:  # e.g. a server unreachable: every later run fails too
        log(f"stopped: {error}")
        return 1


def run_scenarios(args: argparse.Namespace) -> int:
    """Every scenario against the running servers, then the report and summary.json.

    Raises:
      BenchFailed: a ``llmesh bench`` run failed.
    """
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = Path(args.out_dir or REPO_ROOT / ".cache" / "contention" / stamp).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    engine = engine_info(args.mesh_run_dir)
    log(f"runs in {out_dir}; engine {engine or 'unknown'}, llama-server pid {args.llama_pid}")
    results: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    governor: dict[str, dict[str, float]] = {}
    threads: dict[str, list[tuple[float, float]]] = {}
    for index, (scenario, make) in enumerate(scenarios(args, engine)):
        if isinstance(make, str):
            skipped[scenario] = make
            continue
        try:
            context = make()
            context.__enter__()
        except OSError as exc:
            skipped[scenario] = f"{type(exc).__name__}: {exc}"
            log(f"{scenario}: skipped ({exc})")
            continue
        trace = ThreadTrace(engine).start()
        try:
            log(f"{scenario}: started, settling {args.settle_seconds:g} s")
            time.sleep(args.settle_seconds)
            results[scenario] = measure(args, out_dir, scenario, index)
            governor[scenario] = governor_metrics(engine)
        finally:
            context.__exit__(None, None, None)
            threads[scenario] = trace.stop()
        for level in results[scenario].values():  # as seconds since the scenario began
            for figures in level.values():
                figures["requests_began_s"] = round(
                    figures.pop("_requests_began") - trace.began, 2)
    loads = [v for levels in results.values() for level in levels.values()
             for figures in level.values() for pair in figures["loadavg_1m"] for v in pair]
    text, goals = report(args, results, skipped, governor, loads or [0.0], threads)
    print(text, flush=True)
    (out_dir / "summary.json").write_text(json.dumps(
        {"date": stamp, "settings": {k: str(v) for k, v in vars(args).items()},
         "commands": {"llama_server": args.llama_command, "llmesh": args.llmesh_command},
         "results": results, "skipped": skipped, "governor": governor,
         "thread_changes": threads, "targets": goals},
        indent=2))
    log(f"summary: {out_dir / 'summary.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
