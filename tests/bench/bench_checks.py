"""Checks shared by the bench tests (a helper module, not a test file)."""

from __future__ import annotations

from typing import Any

import pytest

PERCENTILES = ("50", "90", "95", "99")


def check_consistent(result: dict[str, Any]) -> None:
    """Figures that must hold for any successful run."""
    completed = result["completed"]
    ok = [i for i, error in enumerate(result["errors"]) if not error]
    assert len(ok) == completed
    for i in ok:
        assert 0 < result["ttfts"][i] <= result["e2els"][i]
        # One inter-token latency per streamed chunk after the first (vLLM's rule);
        # a chunk carries several tokens when speculative decoding accepts a run.
        assert 0 <= len(result["itls"][i]) <= result["output_lens"][i] - 1
        assert sum(result["itls"][i]) <= result["e2els"][i] - result["ttfts"][i] + 1e-6
        assert result["start_offsets"][i] + result["e2els"][i] <= result["duration"] + 1e-6
    for metric in ("ttft", "tpot", "itl", "e2el"):
        values = [result[f"p{p}_{metric}_ms"] for p in PERCENTILES]
        assert values == sorted(values), metric
        assert result[f"median_{metric}_ms"] == pytest.approx(result[f"p50_{metric}_ms"])
    assert result["mean_ttft_ms"] <= result["mean_e2el_ms"]
    duration = result["duration"]
    assert result["request_throughput"] * duration == pytest.approx(completed)
    assert result["output_throughput"] * duration == pytest.approx(result["total_output_tokens"])
    assert result["total_output_tokens"] == sum(result["output_lens"])
    assert result["total_input_tokens"] == sum(result["input_lens"][i] for i in ok)
