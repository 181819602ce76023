"""services.bench.metrics on hand-made records: every figure checked exactly."""

from __future__ import annotations

import pytest

from services.bench.metrics import (
    calculate_metrics,
    max_concurrent,
    meets_slos,
    parse_goodput,
    per_turn,
    percentile_key,
    summarize,
    tpot_of,
)
from services.bench.records import RequestOutput


def record(*, ok: bool = True, prompt: int = 0, out: int = 0, ttft: float = 0.0,
           itl: tuple[float, ...] = (), e2e: float = 0.0, start: float = 0.0,
           error: str = "") -> RequestOutput:
    return RequestOutput(success=ok, error=error, prompt_len=prompt, output_tokens=out,
                         ttft=ttft, itl=list(itl), latency=e2e, start_time=start)


# A: 4 tokens, TPOT (0.2-0.1)/3; B: 1 token (no TPOT); C: failed; D: 3 tokens, TPOT 0.1.
A = record(prompt=10, out=4, ttft=0.1, itl=(0.02, 0.03, 0.05), e2e=0.2, start=100.0)
B = record(prompt=20, out=1, ttft=0.3, e2e=0.3, start=100.5)
C = record(ok=False, prompt=7, error="UNAVAILABLE", e2e=0.01, start=101.0)
D = record(prompt=5, out=3, ttft=0.2, itl=(0.1, 0.1), e2e=0.4, start=100.1)
RECORDS = [A, B, C, D]


def test_tpot_is_decode_time_per_token_after_the_first() -> None:
    assert tpot_of(A) == pytest.approx(0.1 / 3)
    assert tpot_of(D) == pytest.approx(0.1)
    assert tpot_of(B) is None  # one token: no decode interval
    assert tpot_of(C) is None  # failed


def test_aggregate_counts_and_throughputs() -> None:
    result = calculate_metrics(RECORDS, 2.0)
    assert result["duration"] == 2.0
    assert result["completed"] == 3
    assert result["failed"] == 1
    assert result["total_input_tokens"] == 35  # failed request's prompt not counted
    assert result["total_output_tokens"] == 8
    assert result["request_throughput"] == pytest.approx(1.5)
    assert result["output_throughput"] == pytest.approx(4.0)
    assert result["total_token_throughput"] == pytest.approx(21.5)
    assert result["max_concurrent_requests"] == 2
    assert result["errors_by_status"] == {"UNAVAILABLE": 1}
    assert result["request_goodput"] is None and result["goodput"] is None


def test_latency_figures_in_ms() -> None:
    result = calculate_metrics(RECORDS, 2.0)
    expected = {
        # TTFT of A, B, D: 100, 300, 200 ms
        "mean_ttft_ms": 200.0, "median_ttft_ms": 200.0, "p50_ttft_ms": 200.0,
        "p90_ttft_ms": 280.0, "p95_ttft_ms": 290.0, "p99_ttft_ms": 298.0,
        # TPOT of A, D: 33.33, 100 ms
        "mean_tpot_ms": 200.0 / 3, "median_tpot_ms": 200.0 / 3,
        "p99_tpot_ms": 100.0 / 3 + 0.99 * 200.0 / 3,
        # ITL pooled: 20, 30, 50, 100, 100 ms
        "mean_itl_ms": 60.0, "median_itl_ms": 50.0, "p90_itl_ms": 100.0, "p99_itl_ms": 100.0,
        # E2EL of A, B, D: 200, 300, 400 ms
        "mean_e2el_ms": 300.0, "median_e2el_ms": 300.0, "p99_e2el_ms": 398.0,
    }
    for key, value in expected.items():
        assert result[key] == pytest.approx(value), key
    assert result["std_ttft_ms"] == pytest.approx((20000 / 3) ** 0.5)


def test_per_request_lists_keep_every_request_in_order() -> None:
    result = calculate_metrics(RECORDS, 2.0)
    assert result["input_lens"] == [10, 20, 7, 5]
    assert result["output_lens"] == [4, 1, 0, 3]
    assert result["ttfts"] == [0.1, 0.3, None, 0.2]
    assert result["e2els"] == [0.2, 0.3, None, 0.4]
    assert result["itls"] == [[0.02, 0.03, 0.05], [], [], [0.1, 0.1]]
    assert result["tpots"][1] is None and result["tpots"][2] is None
    assert result["start_offsets"] == pytest.approx([0.0, 0.5, 1.0, 0.1])
    assert result["errors"] == ["", "", "UNAVAILABLE", ""]


def test_goodput_counts_requests_meeting_every_slo() -> None:
    assert calculate_metrics(RECORDS, 2.0, goodput_slos_ms={"ttft": 250})["goodput"] == 1.0
    # B has one token: its TPOT counts as 0 and meets any TPOT SLO.
    assert calculate_metrics(RECORDS, 2.0, goodput_slos_ms={"tpot": 50})["goodput"] == 1.0
    both = calculate_metrics(RECORDS, 2.0, goodput_slos_ms={"ttft": 250, "tpot": 50})
    assert both["request_goodput"] == 0.5 and both["goodput"] == 0.5
    assert calculate_metrics(RECORDS, 2.0, goodput_slos_ms={"e2el": 300})["goodput"] == 1.0
    assert not meets_slos(C, {"ttft": 1e9})


def test_no_successful_request_gives_empty_figures() -> None:
    result = calculate_metrics([C], 1.0)
    assert result["completed"] == 0 and result["failed"] == 1
    assert result["mean_ttft_ms"] is None and result["p99_itl_ms"] is None
    assert result["request_throughput"] == 0.0


def test_selected_metrics_and_percentiles() -> None:
    result = calculate_metrics(RECORDS, 2.0, percentiles=[25, 99.9], metrics=["ttft"])
    assert result["p25_ttft_ms"] == pytest.approx(150.0)
    assert result["p99.9_ttft_ms"] == pytest.approx(299.8)
    assert "p99_ttft_ms" not in result and "mean_itl_ms" not in result
    with pytest.raises(ValueError):
        calculate_metrics(RECORDS, 2.0, metrics=["latency"])
    with pytest.raises(ValueError):
        calculate_metrics(RECORDS, 0.0)


def test_summarize_and_percentile_keys() -> None:
    assert percentile_key(99) == "99" and percentile_key(99.9) == "99.9"
    assert summarize([0.001, 0.003], "x", [50]) == {
        "mean_x_ms": pytest.approx(2.0), "median_x_ms": pytest.approx(2.0),
        "std_x_ms": pytest.approx(1.0), "p50_x_ms": pytest.approx(2.0)}


def test_max_concurrent_treats_touching_intervals_as_sequential() -> None:
    assert max_concurrent([record(start=0.0, e2e=1.0), record(start=1.0, e2e=1.0)]) == 1
    assert max_concurrent([record(start=0.0, e2e=2.0), record(start=1.0, e2e=2.0),
                           record(start=1.5, e2e=0.1)]) == 3
    assert max_concurrent([]) == 0


def test_parse_goodput() -> None:
    assert parse_goodput(["ttft:500", "tpot:50", "e2el:2000.5"]) == {
        "ttft": 500.0, "tpot": 50.0, "e2el": 2000.5}
    for bad in (["ttft"], ["itl:5"], ["ttft:fast"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_admission_refusals_are_counted_with_their_latency() -> None:
    refused = [record(ok=False, error="RESOURCE_EXHAUSTED", e2e=0.002, start=101.0),
               record(ok=False, error="HTTP 429", e2e=0.004, start=101.1)]
    result = calculate_metrics([*RECORDS, *refused], 2.0, percentiles=(50, 99))
    assert result["refused"] == 2  # C's UNAVAILABLE is a failure, not a refusal
    assert result["failed"] == 3
    assert result["mean_refusal_ms"] == pytest.approx(3.0)
    assert result["p99_refusal_ms"] == pytest.approx(3.98)
    assert calculate_metrics(RECORDS, 2.0)["refused"] == 0


def test_per_turn_figures_split_a_conversations_run_by_turn() -> None:
    turns = [record(prompt=10, out=2, ttft=0.1, itl=(0.01,), e2e=0.11),
             record(prompt=30, out=2, ttft=0.3, itl=(0.03,), e2e=0.33),
             record(prompt=50, out=2, ttft=0.5, itl=(0.05,), e2e=0.55),
             record(ok=False, error="UNAVAILABLE", prompt=60),
             record(prompt=99, out=2, ttft=9.0, e2e=9.1)]  # outside conversations
    for output, turn in zip(turns, [0, 1, 1, 1, None], strict=True):
        output.turn = turn
    rows = per_turn(turns, [50, 99], ["ttft", "itl"])
    assert [(r["turn"], r["completed"], r["failed"]) for r in rows] == [(0, 1, 0), (1, 2, 1)]
    assert rows[1]["mean_input_tokens"] == 40
    assert rows[0]["median_ttft_ms"] == pytest.approx(100)
    assert rows[1]["median_ttft_ms"] == pytest.approx(400)
    assert rows[1]["p99_itl_ms"] == pytest.approx(49.8)
    assert "median_tpot_ms" not in rows[0]
    result = calculate_metrics(turns, 1.0, percentiles=[50, 99])
    assert result["per_turn"] == per_turn(turns, [50, 99])
    assert result["turns"] == [0, 1, 1, 1, None]
    assert "per_turn" not in calculate_metrics(RECORDS, 1.0)
