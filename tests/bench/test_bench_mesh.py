"""``llmesh bench`` against the real mesh: through Envoy and straight to the router.

A few seconds of load with small lengths. The figures must be consistent,
and the token counts must agree three ways: what was asked (``ignore_eos``),
the token ids streamed back, and the mesh's own usage; prompt lengths cut
by the bench's tokenizer must equal the router's count.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.bench.datasets import synthetic_chats
from services.bench.tokenizer import BenchTokenizer
from services.cli.main import main as llmesh
from services.cli.mesh import Mesh
from tests.bench.bench_checks import check_consistent

pytestmark = [pytest.mark.model, pytest.mark.mesh]

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_bench_through_envoy(mesh: Mesh, tmp_path: Path) -> None:
    result_file = tmp_path / "envoy.json"
    command = [sys.executable, "-m", "services.cli", "bench",
               "--base-url", mesh.ingress_address,
               "--random-input-len", "32", "--random-output-len", "16",
               "--num-prompts", "8", "--max-concurrency", "2", "--num-warmups", "1",
               "--goodput", "ttft:60000", "e2el:120000",
               "--result-file", str(result_file), "--save-detailed", "--disable-tqdm"]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Serving Benchmark Result" in done.stdout
    result = json.loads(result_file.read_text())
    check_consistent(result)
    assert result["backend"] == "llmesh" and result["model_id"]
    assert result["completed"] == 8 and result["failed"] == 0
    assert result["max_concurrent_requests"] <= 2
    assert result["output_lens"] == [16] * 8 == result["server_completion_tokens"]
    assert result["finish_reasons"] == ["length"] * 8
    assert result["input_lens"] == [32] * 8 == result["server_prompt_tokens"]
    assert all(text for text in result["generated_texts"])
    assert result["goodput"] == pytest.approx(result["request_throughput"])
    assert result_file.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.usefixtures("cached_tokenizer")
def test_bench_straight_to_the_router_with_chat(mesh: Mesh, tmp_path: Path) -> None:
    result_file = tmp_path / "router.json"
    code = llmesh(["bench", "--base-url", mesh.router.grpc_address,
                   "--dataset-name", "conversations", "--conversations-output-len", "8",
                   "--num-prompts", "6", "--request-rate", "20", "--seed", "1",
                   "--result-file", str(result_file), "--disable-tqdm"])
    assert code == 0
    result = json.loads(result_file.read_text())
    check_consistent(result)
    assert result["completed"] == 6
    assert result["output_lens"] == [8] * 6 == result["server_completion_tokens"]
    # The chat template rendered by the bench counts what the router counted.
    assert result["input_lens"] == result["server_prompt_tokens"]


@pytest.mark.usefixtures("cached_tokenizer")
def test_bench_synthetic_conversations_feed_the_model_replies_back(
        mesh: Mesh, tmp_path: Path, bench_tokenizer: BenchTokenizer) -> None:
    result_file = tmp_path / "chats.json"
    code = llmesh(["bench", "--base-url", mesh.router.grpc_address,
                   "--dataset-name", "conversations", "--conversations-num", "2",
                   "--conversations-turns", "2", "--conversations-system-len", "48",
                   "--conversations-turn-len", "16", "--conversations-output-len", "6",
                   "--max-concurrency", "1", "--seed", "4", "--save-detailed",
                   "--result-file", str(result_file), "--disable-tqdm"])
    assert code == 0
    result = json.loads(result_file.read_text())
    check_consistent(result)
    assert result["completed"] == 4 and result["not_sent"] == 0
    # One user: both first turns, then both second turns.
    assert result["tags"] == ["conversations/c0/0", "conversations/c1/0",
                              "conversations/c0/1", "conversations/c1/1"]
    assert result["turns"] == [0, 0, 1, 1]
    assert [(row["turn"], row["completed"]) for row in result["per_turn"]] == [(0, 2), (1, 2)]
    assert result["output_lens"] == [6] * 4
    # Each second turn carries the reply the mesh gave to its first turn.
    chats = synthetic_chats(bench_tokenizer, 2, turns=2, system_len=48, turn_len=16,
                            output_len=6, seed=4)
    texts = result["generated_texts"]
    expected = [chats[0].request(bench_tokenizer, []), chats[1].request(bench_tokenizer, []),
                chats[0].request(bench_tokenizer, [texts[0]]),
                chats[1].request(bench_tokenizer, [texts[1]])]
    assert result["input_lens"] == [r.prompt_len for r in expected]
    assert result["input_lens"] == result["server_prompt_tokens"]
