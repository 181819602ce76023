"""services.bench.report: the terminal table, the sweep summary, JSON and PNG files."""

from __future__ import annotations

import json
import math
from pathlib import Path

from services.bench.metrics import calculate_metrics
from services.bench.records import RequestOutput
from services.bench.report import (
    format_per_turn,
    format_result,
    format_summary,
    plot,
    write_json,
)


def run_result(rate: float, concurrency: int | None = None) -> dict:
    outputs = [RequestOutput(success=True, prompt_len=8, output_tokens=3, ttft=0.1 * (i + 1),
                             itl=[0.01, 0.02], latency=0.1 * (i + 1) + 0.03, start_time=i * 0.1)
               for i in range(4)]
    outputs.append(RequestOutput(error="DEADLINE_EXCEEDED", start_time=0.5))
    result = calculate_metrics(outputs, 1.0, goodput_slos_ms={"ttft": 250})
    return {"backend": "llmesh", "model_id": "m", "dataset_name": "random",
            "request_rate": rate, "burstiness": 1.0, "max_concurrency": concurrency, **result}


def test_table_shows_counts_latencies_and_errors() -> None:
    table = format_result(run_result(math.inf, 4), [50, 99])
    lines = table.splitlines()
    assert "Serving Benchmark Result" in lines[0]
    assert any(line.startswith("Successful requests:") and line.endswith(" 4") for line in lines)
    assert any(line.startswith("Request goodput (req/s):") and line.endswith("2.00")
               for line in lines)
    header = next(line for line in lines if "mean" in line)
    assert header.split() == ["mean", "p50", "p99"]
    ttft = next(line for line in lines if line.startswith("TTFT"))
    assert ttft.split() == ["TTFT", "250.00", "250.00", "397.00"]
    assert any(line.startswith("DEADLINE_EXCEEDED:") for line in lines)
    assert "inf" in next(line for line in lines if line.startswith("Request rate"))


def test_summary_is_a_markdown_table() -> None:
    summary = format_summary([run_result(math.inf, 1), run_result(math.inf, 4)],
                             "max_concurrency")
    lines = summary.splitlines()
    assert lines[0].startswith("| max_concurrency | completed | failed | req/s |")
    assert lines[1].count("---") == lines[0].count("|") - 1
    assert lines[2].startswith("| 1 | 4 | 1 | 4.00 | 12.0 | 250.0 |")
    rates = format_summary([run_result(2.0), run_result(math.inf)], "request_rate")
    assert rates.splitlines()[2].startswith("| 2 |")
    assert rates.splitlines()[3].startswith("| inf |")


def test_json_writes_inf_as_a_string(tmp_path: Path) -> None:
    path = write_json(tmp_path / "sub" / "r.json", {"request_rate": math.inf, "x": [1.5, None]})
    assert json.loads(path.read_text()) == {"request_rate": "inf", "x": [1.5, None]}


def test_plots_are_pngs(tmp_path: Path) -> None:
    single = plot([run_result(math.inf)], tmp_path / "one.png")
    sweep = plot([run_result(1.0), run_result(4.0), run_result(math.inf)], tmp_path / "s.png",
                 sweep_key="request_rate", title="sweep")
    for path in (single, sweep):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sweep.stat().st_size > single.stat().st_size


def test_per_turn_table_has_a_row_per_turn() -> None:
    rows = [{"turn": t, "completed": 8, "failed": 0, "mean_input_tokens": 1300.0 + 340 * t,
             "median_ttft_ms": 100.0 * (t + 1), "p99_ttft_ms": 250.0, "median_tpot_ms": None,
             "p99_tpot_ms": None} for t in range(3)]
    lines = format_per_turn(rows, [50, 99], ["ttft", "tpot"]).splitlines()
    assert lines[1].split() == ["turn", "ok", "prompt", "TTFT", "p50", "TTFT", "p99",
                                "TPOT", "p50", "TPOT", "p99"]
    assert [line.split() for line in lines[2:]] == [
        ["0", "8", "1300", "100.0", "250.0", "-", "-"],
        ["1", "8", "1640", "200.0", "250.0", "-", "-"],
        ["2", "8", "1980", "300.0", "250.0", "-", "-"]]
