"""benchmarks/spec_default.py's summary of interleaved rounds: medians, ranges,
per-round ratios and accepted tokens, on hand-made rounds (no model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.spec_default import summarize


def _round(path: Path, index: int, ngram: float, suffix: float, same: bool = True) -> Path:
    report = {"round": index, "order": ["ngram", "suffix"], "load_before": [2.0, 1.0, 0.5],
              "load_after": [2.5, 1.2, 0.6],
              "repeated/1/ngram": {"tok_s": ngram, "acceptance_length": 2.0, "drafts": 100},
              "repeated/1/suffix": {"tok_s": suffix, "acceptance_length": 3.0,
                                    "drafts": 50 + index},
              "repeated/1/identical": same}
    out = path / f"round-{index}.json"
    out.write_text(json.dumps(report))
    return out


def test_summary_gives_medians_ranges_ratios_and_accepted_tokens(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = [_round(tmp_path, 0, 100.0, 110.0), _round(tmp_path, 1, 200.0, 180.0),
             _round(tmp_path, 2, 150.0, 300.0)]
    summarize(files)
    row = [line for line in capsys.readouterr().out.splitlines()
           if line.startswith("| repeated |")]
    # ratios per round 1.1, 0.9, 2.0; accepted n-gram 100 each, suffix 2 x (50..52)
    assert row == ["| repeated | 1 | 150.0 (100.0-200.0) | 180.0 (110.0-300.0) | "
                   "1.100 (0.900-2.000) | 100 (100-100) / 102 (100-104) | True |"]


def test_one_round_with_different_outputs_is_reported(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    summarize([_round(tmp_path, 0, 100.0, 100.0), _round(tmp_path, 1, 100.0, 100.0, same=False)])
    assert capsys.readouterr().out.rstrip().endswith("| False |")
