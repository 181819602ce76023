"""Pure functions: per-request records → the result figures.

Keys follow ``vllm bench serve`` where the concept matches. Definitions,
per successful request (times in the records are seconds, figures in ms):

- TTFT: sending to the first chunk with output;
- TPOT: ``(e2e - TTFT) / (output_tokens - 1)``, for requests with at least
  two output tokens;
- ITL: every gap between consecutive chunks with output, pooled over requests;
- E2EL: sending to the end of the stream.

Each gets ``mean_/median_/std_/pNN_<metric>_ms``. Throughputs divide by the
run's duration (first send to last end): ``request_throughput`` (successful
requests/s), ``output_throughput`` (output tokens/s), ``total_token_throughput``
((input + output) tokens/s of successful requests). ``request_goodput`` (also
``goodput``) counts the successful requests whose TTFT, TPOT and E2EL all meet
the given SLOs (TPOT of a one-token request is 0). An empty metric (no
successful request, or none with two tokens for TPOT) is ``None``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from services.bench.records import RequestOutput

METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
DEFAULT_PERCENTILES = (50.0, 90.0, 95.0, 99.0)


def percentile_key(p: float) -> str:
    """``99`` → ``"99"``, ``99.9`` → ``"99.9"`` (as in vLLM's ``p99_ttft_ms``)."""
    return str(int(p)) if float(p).is_integer() else str(p)


def tpot_of(output: RequestOutput) -> float | None:
    """TPOT in seconds, ``None`` unless the request succeeded with >= 2 output tokens."""
    if not output.success or output.output_tokens < 2:
        return None
    return (output.latency - output.ttft) / (output.output_tokens - 1)


#: Failures that are an overloaded server's refusal (admission control).
REFUSAL_ERRORS = frozenset({"RESOURCE_EXHAUSTED", "HTTP 429", "HTTP 503"})


def summarize(values_s: Sequence[float], name: str,
              percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict[str, float | None]:
    """``mean_/median_/std_/pNN_<name>_ms`` of values given in seconds."""
    keys = [f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms",
            *(f"p{percentile_key(p)}_{name}_ms" for p in percentiles)]
    if len(values_s) == 0:
        return dict.fromkeys(keys, None)
    ms = np.asarray(values_s, dtype=float) * 1000.0
    figures = [float(np.mean(ms)), float(np.median(ms)), float(np.std(ms)),
               *(float(np.percentile(ms, p)) for p in percentiles)]
    return dict(zip(keys, figures, strict=True))


def parse_goodput(specs: Sequence[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` → ``{"ttft": 500.0, "tpot": 50.0}`` (ms).

    Raises:
      ValueError: a malformed item, an unknown metric or a negative value.
    """
    slos: dict[str, float] = {}
    for spec in specs:
        name, sep, value = spec.partition(":")
        if not sep:
            raise ValueError(f"--goodput {spec!r}: expected METRIC:MS, e.g. ttft:500")
        if name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput {spec!r}: metric must be one of "
                             f"{', '.join(GOODPUT_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {spec!r}: {value!r} is not a number of ms") from None
        if ms < 0:
            raise ValueError(f"--goodput {spec!r}: the SLO must be >= 0 ms")
        slos[name] = ms
    return slos


def meets_slos(output: RequestOutput, slos_ms: Mapping[str, float]) -> bool:
    """Whether a successful request meets every SLO (ms)."""
    if not output.success:
        return False
    values = {"ttft": output.ttft, "tpot": tpot_of(output) or 0.0, "e2el": output.latency}
    return all(values[name] * 1000.0 <= slo for name, slo in slos_ms.items())


def max_concurrent(outputs: Sequence[RequestOutput]) -> int:
    """Most requests in flight at once (by their send and end times)."""
    events = sorted([(o.start_time, 1) for o in outputs] +
                    [(o.start_time + o.latency, -1) for o in outputs],
                    key=lambda e: (e[0], e[1]))
    peak = current = 0
    for _, step in events:
        current += step
        peak = max(peak, current)
    return peak


def calculate_metrics(outputs: Sequence[RequestOutput], duration_s: float, *,
                      percentiles: Sequence[float] = DEFAULT_PERCENTILES,
                      metrics: Sequence[str] = METRICS,
                      goodput_slos_ms: Mapping[str, float] | None = None,
                      start_time: float | None = None) -> dict[str, Any]:
    """The result figures of one run.

    Args:
      outputs: one record per request sent.
      duration_s: the run's wall time (first send to last end), > 0.
      percentiles: which ``pNN_`` figures to give.
      metrics: which of ``ttft, tpot, itl, e2el`` to summarize.
      goodput_slos_ms: SLOs in ms by metric; ``None``/empty: no goodput
        (``request_goodput`` is ``None``).
      start_time: the run's start (``perf_counter``) for the per-request
        ``start_offsets``; default: the earliest send.

    Returns:
      the aggregate figures (vLLM's keys), ``refused`` (failures that are
      admission refusals, :data:`REFUSAL_ERRORS`) with the ``*_refusal_ms``
      figures of their latency, ``errors_by_status``, and the
      per-request lists ``input_lens``, ``output_lens``, ``ttfts``, ``tpots``,
      ``itls``, ``e2els`` (seconds; ``None`` for failed requests),
      ``start_offsets``, ``errors``, ``server_prompt_tokens``,
      ``server_completion_tokens``.
    """
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    unknown = set(metrics) - set(METRICS)
    if unknown:
        raise ValueError(f"unknown metrics {sorted(unknown)}; choose from {', '.join(METRICS)}")
    good = [o for o in outputs if o.success]
    series = _series(good)
    result = _totals(outputs, good, duration_s)
    if goodput_slos_ms:
        result["request_goodput"] = sum(meets_slos(o, goodput_slos_ms) for o in good) / duration_s
    result["goodput"] = result["request_goodput"]
    for name in metrics:
        result.update(summarize(series[name], name, percentiles))
    # Admission refusals (RESOURCE_EXHAUSTED / HTTP 429, 503): how fast the
    # overloaded server said no.
    refusals = [o.latency for o in outputs if not o.success and o.error in REFUSAL_ERRORS]
    result["refused"] = len(refusals)
    result.update(summarize(refusals, "refusal", percentiles))
    result["errors_by_status"] = dict(sorted(Counter(o.error for o in outputs
                                                     if not o.success).items()))
    if any(o.turn is not None for o in outputs):
        result["per_turn"] = per_turn(outputs, percentiles, metrics)
    origin = start_time if start_time is not None else min(
        (o.start_time for o in outputs), default=0.0)
    result.update(per_request(outputs, origin))
    return result


def _totals(outputs: Sequence[RequestOutput], good: Sequence[RequestOutput],
            duration_s: float) -> dict[str, Any]:
    """The run's counts, token totals and rates per second (vLLM's keys;
    ``request_goodput`` None until the SLOs are counted)."""
    total_input = sum(o.prompt_len for o in good)
    total_output = sum(o.output_tokens for o in good)
    return {
        "duration": duration_s,
        "completed": len(good),
        "failed": len(outputs) - len(good),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(good) / duration_s,
        "request_goodput": None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "max_concurrent_requests": max_concurrent(outputs),
    }


def _series(good: Sequence[RequestOutput]) -> dict[str, list[float]]:
    """The values (seconds) each metric summarizes, from successful requests."""
    return {
        "ttft": [o.ttft for o in good],
        "tpot": [t for t in (tpot_of(o) for o in good) if t is not None],
        "itl": [gap for o in good for gap in o.itl],
        "e2el": [o.latency for o in good],
    }


def per_turn(outputs: Sequence[RequestOutput], percentiles: Sequence[float] = DEFAULT_PERCENTILES,
             metrics: Sequence[str] = METRICS) -> list[dict[str, Any]]:
    """The figures of each conversation turn: one dict per turn that any request
    asked for, in turn order, with ``turn`` (0-based), ``completed``,
    ``failed``, ``mean_input_tokens`` (successful requests' prompt tokens)
    and the ``mean_/median_/std_/pNN_<metric>_ms`` of ``metrics``.
    Requests without a turn are left out.
    """
    turns = sorted({o.turn for o in outputs if o.turn is not None})
    rows = []
    for turn in turns:
        mine = [o for o in outputs if o.turn == turn]
        good = [o for o in mine if o.success]
        row: dict[str, Any] = {
            "turn": turn, "completed": len(good), "failed": len(mine) - len(good),
            "mean_input_tokens": (sum(o.prompt_len for o in good) / len(good)) if good else None}
        series = _series(good)
        for name in metrics:
            row.update(summarize(series[name], name, percentiles))
        rows.append(row)
    return rows


def per_request(outputs: Sequence[RequestOutput], origin: float) -> dict[str, list[Any]]:
    """The per-request lists of the result (seconds; ``None`` where a request failed)."""
    return {
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": [o.output_tokens if o.success else 0 for o in outputs],
        "ttfts": [o.ttft if o.success else None for o in outputs],
        "tpots": [tpot_of(o) for o in outputs],
        "itls": [list(o.itl) if o.success else [] for o in outputs],
        "e2els": [o.latency if o.success else None for o in outputs],
        "start_offsets": [o.start_time - origin for o in outputs],
        "errors": [o.error for o in outputs],
        "turns": [o.turn for o in outputs],
        "server_prompt_tokens": [o.server_prompt_tokens for o in outputs],
        "server_completion_tokens": [o.server_completion_tokens for o in outputs],
    }
