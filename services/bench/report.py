"""What a run shows: a table on the terminal, a JSON file, a PNG.

The PNG (matplotlib, Agg) holds the CDFs of TTFT and ITL, one line per run;
for a sweep (several ``--request-rate`` or ``--max-concurrency`` values) it
adds output throughput and p99 TTFT against the swept value.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from services.bench.metrics import METRICS, percentile_key

_WIDTH = 50
_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:.{digits}f}"
    return str(value)


def rate_label(rate: float | str) -> str:
    """``inf`` or the rate without a needless ``.0`` (also for ``"inf"`` read from JSON)."""
    rate = float(rate)
    return "inf" if math.isinf(rate) else f"{rate:g}"


def format_result(result: Mapping[str, Any], percentiles: Sequence[float],
                  metrics: Sequence[str] = METRICS) -> str:
    """The terminal table of one run, in the layout of ``vllm bench serve``,
    with one latency row per metric."""
    def row(label: str, value: Any, digits: int = 2) -> str:
        return f"{label + ':':<40} {_fmt(value, digits)}"

    concurrency = result.get("max_concurrency")
    lines = [
        " Serving Benchmark Result ".center(_WIDTH, "="),
        row("Backend", result.get("backend")),
        row("Model", result.get("model_id")),
        row("Dataset", result.get("dataset_name")),
        row("Request rate (req/s)", rate_label(result.get("request_rate", math.inf))),
        row("Burstiness", result.get("burstiness")),
        row("Max concurrency", concurrency if concurrency is not None else "none"),
        row("Successful requests", result["completed"]),
        row("Failed requests", result["failed"]),
        row("Benchmark duration (s)", result["duration"]),
        row("Total input tokens", result["total_input_tokens"]),
        row("Total generated tokens", result["total_output_tokens"]),
        row("Request throughput (req/s)", result["request_throughput"]),
    ]
    if result.get("request_goodput") is not None:
        lines.append(row("Request goodput (req/s)", result["request_goodput"]))
    lines += [
        row("Output token throughput (tok/s)", result["output_throughput"]),
        row("Total token throughput (tok/s)", result["total_token_throughput"]),
        row("Max concurrent requests", result["max_concurrent_requests"]),
        " Latency (ms) ".center(_WIDTH, "-"),
    ]
    columns = ["mean", *(f"p{percentile_key(p)}" for p in percentiles)]
    lines.append(f"{'':<6}" + "".join(f"{c:>{max(9, len(c) + 1)}}" for c in columns))
    for name in metrics:
        keys = [f"mean_{name}_ms", *(f"p{percentile_key(p)}_{name}_ms" for p in percentiles)]
        lines.append(f"{_NAMES[name]:<6}" + "".join(
            f"{_fmt(result.get(k)):>{max(9, len(c) + 1)}}"
            for k, c in zip(keys, columns, strict=True)))
    if result.get("refused"):
        lines.append(row("Refused requests (admission)", result["refused"]))
        lines.append(f"{'Refusal':<6}" + "".join(
            f"{_fmt(result.get(k)):>{max(9, len(c) + 1)}}"
            for k, c in zip(["mean_refusal_ms", *(f"p{percentile_key(p)}_refusal_ms"
                                                   for p in percentiles)],
                            columns, strict=True)))
    if result.get("errors_by_status"):
        lines.append(" Errors ".center(_WIDTH, "-"))
        lines += [row(status or "unknown", count)
                  for status, count in result["errors_by_status"].items()]
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def format_per_turn(rows: Sequence[Mapping[str, Any]], percentiles: Sequence[float],
                    metrics: Sequence[str] = METRICS) -> str:
    """The per-turn table of a conversations run (``result["per_turn"]``): one
    row per turn with its successful requests, mean prompt tokens, and the
    median and the highest of ``percentiles`` of each metric (ms)."""
    top = f"p{percentile_key(max(percentiles))}"
    header = ["turn", "ok", "prompt"] + [f"{_NAMES[m]} {c}" for m in metrics
                                         for c in ("p50", top)]
    lines = [" Per turn (ms) ".center(_WIDTH, "-"),
             "".join(f"{h:>{max(7, len(h) + 1)}}" for h in header)]
    for row in rows:
        cells = [row["turn"], row["completed"], _fmt(row["mean_input_tokens"], 0)]
        cells += [_fmt(row.get(f"{key}_{m}_ms"), 1) for m in metrics
                  for key in ("median", top)]
        lines.append("".join(f"{_fmt(c):>{max(7, len(h) + 1)}}"
                             for c, h in zip(cells, header, strict=True)))
    return "\n".join(lines)


def format_summary(runs: Sequence[Mapping[str, Any]], sweep_key: str) -> str:
    """A Markdown table, one row per run: throughput and p50/p99 latencies (ms)."""
    header = [sweep_key, "completed", "failed", "req/s", "output tok/s",
              "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "ITL p50", "ITL p99",
              "E2EL p50", "E2EL p99"]
    keys = ["completed", "failed", "request_throughput", "output_throughput",
            "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
            "median_itl_ms", "p99_itl_ms", "median_e2el_ms", "p99_e2el_ms"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for run in runs:
        value = run[sweep_key]
        label = rate_label(value) if sweep_key == "request_rate" else _fmt(value)
        cells = [label, *(_fmt(run.get(k), 2 if k == "request_throughput" else 1)
                          for k in keys)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_json(path: str | Path, payload: Mapping[str, Any]) -> Path:
    """Writes ``payload`` as indented JSON (``inf`` as the string ``"inf"``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_jsonable(payload), indent=2) + "\n", "utf-8")
    return path


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def _cdf(ax: Any, values_ms: Sequence[float], label: str) -> None:
    import numpy as np

    if not values_ms:
        return
    xs = np.sort(np.asarray(values_ms, dtype=float))
    ys = np.arange(1, len(xs) + 1) / len(xs)
    ax.step(xs, ys, where="post", label=label)


def plot(runs: Sequence[Mapping[str, Any]], path: str | Path, *,
         sweep_key: str | None = None, title: str = "") -> Path:
    """Writes the PNG: TTFT and ITL CDFs (one line per run); with ``sweep_key``
    also output throughput and p99 TTFT against it.

    Args:
      runs: result dicts (with the per-request ``ttfts`` and ``itls``).
      sweep_key: ``request_rate`` or ``max_concurrency`` for a sweep, else ``None``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = 2 if sweep_key else 1
    fig, axes = plt.subplots(rows, 2, figsize=(12, 4.5 * rows), squeeze=False)
    for run in runs:
        label = _run_label(run, sweep_key)
        _cdf(axes[0][0], [t * 1000 for t in run["ttfts"] if t is not None], label)
        _cdf(axes[0][1], [g * 1000 for gaps in run["itls"] for g in gaps], label)
    for ax, name in ((axes[0][0], "TTFT"), (axes[0][1], "ITL")):
        _log_if_wide(ax)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of " + ("requests" if name == "TTFT" else "token gaps"))
        ax.set_title(f"{name} CDF")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=8)
    if sweep_key:
        _sweep_axes(axes[1], runs, sweep_key)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _log_if_wide(ax: Any) -> None:
    """Log x scale when the plotted values span more than 20x (long tails)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    xs = [x for line in ax.get_lines() for x in line.get_xdata() if x > 0]
    if xs and max(xs) > 20 * min(xs):
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())


def _run_label(run: Mapping[str, Any], sweep_key: str | None) -> str:
    if sweep_key == "request_rate":
        return f"rate {rate_label(run['request_rate'])}"
    if sweep_key == "max_concurrency":
        return f"concurrency {run['max_concurrency']}"
    return str(run.get("model_id") or run.get("backend") or "run")


def _sweep_axes(axes: Sequence[Any], runs: Sequence[Mapping[str, Any]], sweep_key: str) -> None:
    values = [float(run[sweep_key]) for run in runs]  # "inf" from JSON too
    numeric = not any(math.isinf(v) for v in values)
    xs: list[float] = values if numeric else [float(i) for i in range(len(values))]
    labels = [rate_label(v) for v in values]
    name = "request rate (req/s)" if sweep_key == "request_rate" else "max concurrency"
    throughput, ttft = axes
    throughput.plot(xs, [r["output_throughput"] for r in runs], "o-", label="output tok/s")
    for x, run in zip(xs, runs, strict=True):
        throughput.annotate(f"{run['request_throughput']:.2f} req/s",
                            (x, run["output_throughput"]), textcoords="offset points",
                            xytext=(4, -12), fontsize=8)
    throughput.set_ylabel("output tokens/s")
    throughput.set_ylim(bottom=0)
    throughput.set_title(f"throughput vs {name}")
    ttft.plot(xs, [r.get("p99_ttft_ms") or 0.0 for r in runs], "o-", color="tab:red",
              label="p99 TTFT")
    ttft.plot(xs, [r.get("median_ttft_ms") or 0.0 for r in runs], "o--", color="tab:gray",
              label="median TTFT")
    ttft.set_ylabel("ms")
    ttft.set_title(f"TTFT vs {name}")
    ttft.legend(fontsize=8)
    ttft.set_ylim(bottom=0)
    throughput.legend(fontsize=8)
    log2 = numeric and min(xs) > 0 and max(xs) >= 8 * min(xs)
    for ax in (throughput, ttft):
        ax.set_xlabel(name)
        ax.grid(alpha=0.3)
        if log2:
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels(labels)
        ax.minorticks_off()
