"""Where a first token's time goes, per hop: the pure parts of ``mesh_latency.py --attribute``.

* :func:`cpu_ns` reads a process's CPU time from ``/proc/PID/task/*/schedstat``
  (nanoseconds, unlike the 10 ms ticks of ``/proc/PID/stat``);
* :func:`histogram_sum_count` reads a Prometheus histogram's sum and count
  from a ``/metrics`` page (the router's ``llmesh:time_to_first_token_seconds``,
  the engine's ``llmesh:engine_step_duration_seconds``), so that the delta
  around one request alone is that request's router TTFT or engine step
  (:func:`engine_reading`: the step histogram and the governor's thread count);
* :func:`hop_rows` turns each path's per-request :class:`Sample` into the
  per-hop table (milliseconds, one value per round), :func:`format_hops`
  prints it;
* :func:`cpu_ms_per_request` subtracts a process's idle CPU rate
  (:func:`idle_rate`, with its standard error) from its CPU over the
  attribution requests; an estimate below 0 within the idle rate's error is
  read as 0, one further below is kept (and shows the measurement is off).

No I/O here but :func:`cpu_ns` and :func:`scrape`; the arithmetic is
tested in tests/bench/test_latency_attribution.py.
"""

from __future__ import annotations

import math
import statistics
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

#: The router's own TTFT (receipt of the request to its first token-carrying message).
ROUTER_TTFT = "llmesh:time_to_first_token_seconds"
#: The engine's step time (schedule, forward, sample, update).
ENGINE_STEP = "llmesh:engine_step_duration_seconds"
#: The compute threads of the engine's next step (the thread governor's).
ENGINE_THREADS = "llmesh:engine_num_threads"
#: The path the others are measured against.
BASE = "in-process"


def schedstat_ns(text: str) -> int:
    """Nanoseconds on CPU from one ``/proc/.../schedstat`` line (its first
    field; the others are run-queue wait ns and timeslices).

    Raises:
      ValueError: the text does not start with a whole number.
    """
    fields = text.split()
    if not fields:
        raise ValueError("empty schedstat")
    return int(fields[0])


def cpu_ns(pid: int) -> int:
    """Nanoseconds ``pid`` has run on a CPU so far: the sum over its live
    threads' ``/proc/PID/task/TID/schedstat`` (threads that have exited are
    no longer counted; a thread that exits while read is skipped).

    Raises:
      FileNotFoundError: ``pid`` does not exist.
    """
    tasks = Path(f"/proc/{pid}/task")
    if not tasks.is_dir():
        raise FileNotFoundError(f"no process {pid}")
    total = 0
    for stat in tasks.glob("*/schedstat"):
        try:
            total += schedstat_ns(stat.read_text())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def histogram_sum_count(metrics_text: str, name: str) -> tuple[float, int]:
    """(sum, count) of the histogram ``name`` in a Prometheus text page, added
    over all its label sets; (0.0, 0) when the page lacks it (nothing observed
    yet under a labelled histogram).

    ``name`` is the metric's name without ``_sum``/``_count`` (e.g.
    ``llmesh:engine_step_duration_seconds``; the sum is in its unit, seconds).
    """
    total, count = 0.0, 0
    for family in text_string_to_metric_families(metrics_text):
        if family.name != name:
            continue
        for sample in family.samples:
            if sample.name == f"{name}_sum":
                total += sample.value
            elif sample.name == f"{name}_count":
                count += int(sample.value)
    return total, count


def gauge_value(metrics_text: str, name: str) -> float | None:
    """The value of the unlabelled gauge ``name`` in a Prometheus text page;
    None when the page lacks it."""
    for family in text_string_to_metric_families(metrics_text):
        if family.name == name and family.samples:
            return float(family.samples[0].value)
    return None


#: Tries of one scrape: a service's metrics server may drop a connection
#: under load (seen once: ``RemoteDisconnected`` from the router's, which
#: ended a 2.5-minute run).
SCRAPE_TRIES = 3


def scrape(address: str, timeout_s: float = 5.0) -> str:
    """The Prometheus text page at ``http://ADDRESS/metrics``, tried up to
    :data:`SCRAPE_TRIES` times 50 ms apart.

    Raises:
      OSError: the last try's error (``urllib.error.URLError``,
        ``http.client.RemoteDisconnected``, a timeout).
    """
    for attempt in range(SCRAPE_TRIES):
        try:
            with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout_s) as page:
                return str(page.read().decode())
        except OSError:
            if attempt + 1 == SCRAPE_TRIES:
                raise
            time.sleep(0.05)
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class EngineReading:
    """An engine's step counters at one moment.

    Attributes:
      step_s: seconds of all its steps so far.
      steps: steps so far.
      threads: compute threads its next step runs on (the thread governor's
        ``llmesh:engine_num_threads``; 0: unknown).
    """

    step_s: float
    steps: int
    threads: int


def engine_reading(metrics_text: str) -> EngineReading:
    """The engine's :class:`EngineReading` from its ``/metrics`` page."""
    step_s, steps = histogram_sum_count(metrics_text, ENGINE_STEP)
    return EngineReading(step_s, steps, int(gauge_value(metrics_text, ENGINE_THREADS) or 0))


def histogram_delta(before: tuple[float, int], after: tuple[float, int]) -> tuple[float, int]:
    """(sum, count) observed between two readings of one histogram."""
    return after[0] - before[0], after[1] - before[1]


@dataclass(frozen=True)
class Sample:
    """One max_tokens=1 request, alone on the machine (seconds).

    Attributes:
      client_ttft_s: sending to the first token, at the client.
      step_s: the engine's step time(s) for the request (the sum of ``steps``
        steps); None where the path has no engine to read.
      steps: how many engine steps ran while the request did (1 for a prompt
        prefilled in one step; more: chunked prefill, or other work).
      router_ttft_s: the router's own TTFT for the request; None on paths
        without a router.
      threads: the compute threads the engine's step ran on (0: unknown;
        None: no engine to read).
    """

    client_ttft_s: float
    step_s: float | None = None
    steps: int = 1
    router_ttft_s: float | None = None
    threads: int | None = None


#: The table's columns, in order, with what each includes.
COLUMNS = {
    "client_ttft": "client TTFT",
    "ttft_overhead": "client TTFT - in-process client TTFT, same round "
                     "(= step_inflation + outside_overhead)",
    "step": "engine step(s) for the request",
    "step_inflation": "step - in-process step, same round (the step slowed by the mesh's CPU, "
                      "and the steps' own spread)",
    "client_minus_step": "client TTFT - step (everything outside the step)",
    "outside_overhead": "client_minus_step - in-process's, same round (what the hops add "
                        "outside the step; free of the steps' spread)",
    "router_minus_step": "router TTFT - step (router + engine hop, outside the step)",
    "client_minus_router": "client TTFT - router TTFT (client <-> router edges, Envoy or not)",
}


def hop_rows(samples: dict[str, list[Sample]]) -> dict[str, dict[str, list[float]]]:
    """The per-hop table: path → column (:data:`COLUMNS`) → one value per
    round, in milliseconds.

    ``samples[path][i]`` is round ``i`` of ``path``; every path has the same
    number of rounds and :data:`BASE` (in process) is one of them, so that
    ``step_inflation`` pairs each round with in-process's of the same round.
    A column a path cannot have (no router, no step) is left out of its row.

    Raises:
      ValueError: the paths' round counts differ, or :data:`BASE` is missing.
    """
    if BASE not in samples:
        raise ValueError(f"no {BASE!r} path")
    rounds = {len(runs) for runs in samples.values()}
    if len(rounds) != 1:
        raise ValueError(f"paths have different round counts: {sorted(rounds)}")
    base = samples[BASE]
    rows: dict[str, dict[str, list[float]]] = {}
    base_has_steps = all(b.step_s is not None for b in base)
    for path, runs in samples.items():
        row: dict[str, list[float]] = {"client_ttft": [s.client_ttft_s * 1e3 for s in runs]}
        if path != BASE:
            row["ttft_overhead"] = [(s.client_ttft_s - b.client_ttft_s) * 1e3
                                    for s, b in zip(runs, base)]
        if all(s.step_s is not None for s in runs):
            steps = [_ms(s.step_s) for s in runs]
            row["step"] = steps
            row["client_minus_step"] = [s.client_ttft_s * 1e3 - t for s, t in zip(runs, steps)]
            if path != BASE and base_has_steps:
                row["step_inflation"] = [s - _ms(b.step_s) for s, b in zip(steps, base)]
                row["outside_overhead"] = [
                    (s.client_ttft_s - b.client_ttft_s) * 1e3 - inflation
                    for s, b, inflation in zip(runs, base, row["step_inflation"])]
            if all(s.router_ttft_s is not None for s in runs):
                row["router_minus_step"] = [_ms(s.router_ttft_s) - t
                                            for s, t in zip(runs, steps)]
        if all(s.router_ttft_s is not None for s in runs):
            row["client_minus_router"] = [s.client_ttft_s * 1e3 - _ms(s.router_ttft_s)
                                          for s in runs]
        rows[path] = row
    return rows


def format_hops(rows: dict[str, dict[str, list[float]]]) -> list[str]:
    """The table of :func:`hop_rows` as text lines: one line per column of
    :data:`COLUMNS` (with what it includes), one cell per path, each
    ``median [p25-p75]``; "-" where a path lacks the column."""
    width = 22
    lines = [f"  {'':<20}" + "".join(f"{path:>{width}}" for path in rows)]
    for key, meaning in COLUMNS.items():
        cells = []
        for row in rows.values():
            cells.append(f"{'-':>{width}}" if key not in row else
                         f"{_cell(row[key]):>{width}}")
        lines.append(f"  {key:<20}" + "".join(cells))
    lines.append("  where:")
    lines.extend(f"    {key}: {meaning}" for key, meaning in COLUMNS.items())
    return lines


def path_order(names: list[str], i: int) -> list[str]:
    """Round ``i``'s order of the paths, from a Williams design (Williams
    1949, balanced for first-order carry-over): row ``i mod k`` of the square
    whose first row is 0, 1, k-1, 2, k-2, ... (each next row adds 1 mod k),
    the row reversed in every other cycle of ``k`` rounds (which an odd ``k``
    needs). Over ``2 * k`` rounds each path directly follows each other one
    equally often. (Rotations alone put the same path after the in-process
    run every round, and the second mesh after the first: a position bias
    the comparison could not tell from a difference of code.)"""
    k = len(names)
    first = [0] + [(j + 1) // 2 if j % 2 else k - j // 2 for j in range(1, k)]
    row = [names[(j + i) % k] for j in first]
    return row[::-1] if (i // k) % 2 else row


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(median, p25, p75) of ``values`` (inclusive quartiles; one value: itself thrice).

    Raises:
      statistics.StatisticsError: ``values`` is empty.
    """
    if len(values) < 2:
        return statistics.median(values), values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return statistics.median(values), q1, q3


def _cell(values: list[float]) -> str:
    med, q1, q3 = quartiles(values)
    return f"{med:.2f} [{q1:.2f}-{q3:.2f}]"


def _ms(seconds: float | None) -> float:
    assert seconds is not None
    return seconds * 1e3


def multi_step(samples: dict[str, list[Sample]]) -> dict[str, int]:
    """Per path, how many of its requests did not take exactly one engine
    step (2+: their ``step`` is the sum of those steps, not one prefill;
    0: no step was observed in the request's window)."""
    return {path: n for path, runs in samples.items()
            if (n := sum(1 for s in runs if s.step_s is not None and s.steps != 1))}


def thread_mix(samples: dict[str, list[Sample]]) -> dict[str, dict[int, int]]:
    """Per path with an engine, how many of its requests' steps ran on each
    thread count (a step on fewer threads is slower for that alone, not for
    the mesh)."""
    mix: dict[str, dict[int, int]] = {}
    for path, runs in samples.items():
        counts = Counter(s.threads for s in runs if s.threads is not None)
        if counts:
            mix[path] = dict(sorted(counts.items(), reverse=True))
    return mix


@dataclass(frozen=True)
class IdleRate:
    """A process's CPU while nothing is sent, in ns of CPU per wall second.

    Attributes:
      ns_per_s: the rate over all the idle windows (their CPU over their seconds).
      stderr_ns_per_s: its standard error: the spread (sample standard
        deviation) of the windows' own rates over the square root of their
        number; 0 with one window (no spread to see).
    """

    ns_per_s: float
    stderr_ns_per_s: float = 0.0


def idle_rate(windows: Sequence[tuple[int, float]]) -> IdleRate:
    """The :class:`IdleRate` of ``windows``: (CPU ns, wall seconds) of each
    idle window, measured one after the other.

    Raises:
      ValueError: no window, or one of no time.
    """
    if not windows or any(seconds <= 0 for _, seconds in windows):
        raise ValueError(f"need idle windows of > 0 s, got {list(windows)}")
    rate = sum(ns for ns, _ in windows) / sum(seconds for _, seconds in windows)
    if len(windows) == 1:
        return IdleRate(rate)
    spread = statistics.stdev(ns / seconds for ns, seconds in windows)
    return IdleRate(rate, spread / math.sqrt(len(windows)))


#: A per-request CPU below 0 by no more than this many idle standard errors
#: is read as 0: the process used nothing beyond its idle rate.
CLAMP_STDERRS = 2.0


@dataclass(frozen=True)
class CpuPerRequest:
    """CPU milliseconds per request, a process's idle rate subtracted.

    Attributes:
      ms: the estimate; 0.0 where it came out below 0 within
        :data:`CLAMP_STDERRS` of ``stderr_ms`` (``clamped``). Further below
        0 it is kept as it is: the idle rate was not the process's rate
        during the requests (a periodic task in the idle windows, say),
        which a clamp would hide.
      stderr_ms: what the idle rate's standard error amounts to per request.
      clamped: ``ms`` was read as 0.
    """

    ms: float
    stderr_ms: float
    clamped: bool = False

    def __str__(self) -> str:
        return f"{self.ms:.2f}±{self.stderr_ms:.2f}"


def cpu_ms_per_request(used_ns: int, idle: IdleRate, elapsed_s: float,
                       requests: int) -> CpuPerRequest:
    """CPU milliseconds per request: ``used_ns`` over ``elapsed_s`` seconds
    of ``requests`` requests, less what the process spends idle in that time
    at ``idle``'s rate (measured alone), with the uncertainty that rate
    carries (:class:`CpuPerRequest`: never below 0 unless the measurement
    says the process used less than idle).

    Raises:
      ValueError: ``requests`` < 1.
    """
    if requests < 1:
        raise ValueError(f"requests must be >= 1, got {requests}")
    ms = (used_ns - idle.ns_per_s * elapsed_s) / requests / 1e6
    stderr_ms = idle.stderr_ns_per_s * elapsed_s / requests / 1e6
    if 0 > ms >= -CLAMP_STDERRS * stderr_ms:
        return CpuPerRequest(0.0, stderr_ms, clamped=True)
    return CpuPerRequest(ms, stderr_ms)
