"""``llmesh bench`` against a minimal OpenAI-compatible server on loopback.

The stub waits 50 ms before the first token and 10 ms between tokens, one
token (" hello") per chunk, so the figures the bench reports can be checked
against what the server did.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.bench.tokenizer import BenchTokenizer
from services.cli.main import main as llmesh
from tests.bench.bench_checks import check_consistent
from tests.bench.openai_stub import TOKEN_TEXT, StubOpenAIServer

pytestmark = [pytest.mark.model, pytest.mark.usefixtures("cached_tokenizer")]

def bench(tmp_path: Path, *args: str) -> dict[str, Any]:
    """Runs ``llmesh bench ...`` in-process; returns the result JSON."""
    result_file = tmp_path / "result.json"
    code = llmesh(["bench", *args, "--result-file", str(result_file), "--disable-tqdm"])
    assert code == 0
    return json.loads(result_file.read_text())


def test_completions_figures_match_the_servers_timing(
        openai_stub: StubOpenAIServer, bench_tokenizer: BenchTokenizer, tmp_path: Path) -> None:
    result = bench(tmp_path, "--backend", "openai", "--base-url", openai_stub.url,
                   "--random-input-len", "40", "--random-output-len", "12",
                   "--num-prompts", "8", "--max-concurrency", "4", "--num-warmups", "2",
                   "--goodput", "ttft:1000", "e2el:5000", "--save-detailed")
    check_consistent(result)
    assert result["completed"] == 8 and result["failed"] == 0
    assert result["model_id"] == openai_stub.model and result["backend"] == "openai"
    assert len(openai_stub.bodies) == 10  # 2 warm-ups, not counted, + 8
    body = openai_stub.bodies[-1]
    assert body["stream"] is True and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 12 and body["temperature"] == 0.0
    # Token counts: as requested, as the server reported, as the tokenizer counts the text.
    assert result["output_lens"] == [12] * 8
    assert result["server_completion_tokens"] == [12] * 8
    for text in result["generated_texts"]:
        assert text == TOKEN_TEXT * 12
        assert len(bench_tokenizer.encode(text)) == 12
    # Prompts: exactly the requested length, by the bench and by the server.
    assert result["input_lens"] == [40] * 8 == result["server_prompt_tokens"]
    # Timing: 50 ms to the first token, 10 ms between tokens (generous bounds).
    assert 50 <= result["median_ttft_ms"] <= 250
    assert min(result["ttfts"]) >= 0.049
    assert 9 <= result["median_itl_ms"] <= 40
    assert 9 <= result["median_tpot_ms"] <= 40
    assert 160 <= result["median_e2el_ms"] <= 700  # 50 + 11 * 10 ms
    assert result["max_concurrent_requests"] <= 4
    assert result["goodput"] == result["request_goodput"] == pytest.approx(
        result["request_throughput"])
    assert Path(tmp_path / "result.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chat_without_usage_counts_with_the_tokenizer(
        openai_stub: StubOpenAIServer, tmp_path: Path) -> None:
    openai_stub.report_usage = False
    result = bench(tmp_path, "--backend", "openai-chat", "--base-url", openai_stub.url,
                   "--dataset-name", "conversations", "--conversations-output-len", "6",
                   "--num-prompts", "6", "--max-concurrency", "3")
    check_consistent(result)
    assert result["completed"] == 6
    assert result["output_lens"] == [6] * 6  # the tokenizer's count of " hello" * 6
    assert result["server_completion_tokens"] == [None] * 6
    body = openai_stub.bodies[-1]
    assert body["messages"][-1]["role"] == "user"
    assert body["max_completion_tokens"] == 6
    # The role-only first delta comes at once; the first token 50 ms later.
    assert min(result["ttfts"]) >= 0.049


def test_errors_are_counted_by_status(openai_stub: StubOpenAIServer, tmp_path: Path) -> None:
    openai_stub.fail_every = 3
    result = bench(tmp_path, "--backend", "openai", "--base-url", openai_stub.url,
                   "--random-input-len", "8", "--random-output-len", "3",
                   "--num-prompts", "9", "--request-rate", "200", "--seed", "2")
    check_consistent(result)
    assert result["completed"] == 6 and result["failed"] == 3
    assert result["errors_by_status"] == {"HTTP 503": 3}
    assert sorted(result["errors"]) == [""] * 6 + ["HTTP 503"] * 3


def test_without_ignore_eos_the_server_decides_the_length(
        openai_stub: StubOpenAIServer, tmp_path: Path) -> None:
    result = bench(tmp_path, "--backend", "openai", "--base-url", openai_stub.url,
                   "--random-input-len", "8", "--random-output-len", "20",
                   "--num-prompts", "3", "--no-ignore-eos")
    assert "ignore_eos" not in openai_stub.bodies[-1]
    assert result["output_lens"] == [openai_stub.eos_after] * 3


def test_rate_sweep_writes_runs_and_the_plot(openai_stub: StubOpenAIServer,
                                              tmp_path: Path, capsys) -> None:
    result = bench(tmp_path, "--backend", "openai", "--base-url", openai_stub.url,
                   "--random-input-len", "16", "--random-output-len", "4",
                   "--num-prompts", "6", "--request-rate", "50,inf")
    assert result["sweep"] == "request_rate" and result["sweep_values"] == [50.0, "inf"]
    assert [run["request_rate"] for run in result["runs"]] == [50.0, "inf"]
    for run in result["runs"]:
        check_consistent(run)
        assert run["completed"] == 6
    out = capsys.readouterr().out
    assert out.count("Serving Benchmark Result") == 2
    assert "| request_rate | completed |" in out
    assert (tmp_path / "result.png").stat().st_size > 10_000


def test_bad_usage_exits_2(tmp_path: Path, capsys) -> None:
    for args in (["--request-rate", "0"], ["--goodput", "itl:5"],
                 ["--request-rate", "1,2", "--max-concurrency", "1,2"],
                 ["--metric-percentiles", "100"], ["--extra-body", "[1]"], ["--seed", "-1"],
                 ["--request-timeout", "0"], ["--port", "70000"]):
        assert llmesh(["bench", *args]) == 2
    assert "--goodput" in capsys.readouterr().err


def test_a_missing_or_malformed_dataset_file_is_one_line_exit_2(tmp_path: Path, capsys) -> None:
    """Checked with the flags, before the tokenizer loads or the target is
    called (it had been a traceback once the run started)."""
    malformed = tmp_path / "bad.json"
    for path, what in ((tmp_path / "missing.json", "cannot read it (No such file"),
                       (malformed, "not JSON"), (malformed, "no 'turns' key")):
        if what == "no 'turns' key":
            malformed.write_text('{"conversations": [{"id": "a"}]}')
        else:
            malformed.write_text("{")
        code = llmesh(["bench", "--dataset-name", "conversations", "--dataset-path", str(path)])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1, err
        assert err.startswith(f"llmesh bench: --dataset-path {path}: ") and what in err, err
    assert llmesh(["bench", "--dataset-path", str(malformed)]) == 2  # not the conversations
    assert "needs --dataset-name conversations" in capsys.readouterr().err


def test_unreachable_target_exits_1(tmp_path: Path, capsys) -> None:
    stub = StubOpenAIServer()
    stub.start()
    url = stub.url
    stub.stop()  # nothing listens there now
    assert llmesh(["bench", "--backend", "openai", "--base-url", url, "--num-prompts", "1",
                   "--disable-tqdm"]) == 1
    assert "cannot reach openai" in capsys.readouterr().err
