"""``python -m services.tokenizer`` as a process: loads, turns SERVING, answers, drains."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from llmesh.v1 import tokenizer_pb2, tokenizer_pb2_grpc

from services.tokenizer.__main__ import build_parser
from services.tokenizer.model_parts import GEMMA3_CHAT_TEMPLATE
from services.tokenizer.tokenizer import DEFAULT_CHAT_ROLES

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parents[2]


def test_flags() -> None:
    args = build_parser().parse_args([])
    assert args.model_path is None  # resolved to default_model_path() at start
    assert (args.inline_encode_max_chars, args.encode_threads, args.port) == (2048, 2, 0)
    args = build_parser().parse_args(["--model-path", "/m.gguf", "--model-name", "m",
                                      "--encode-threads", "4", "--port", "7001"])
    assert (args.model_path, args.model_name, args.encode_threads, args.port) == (
        Path("/m.gguf"), "m", 4, 7001)
    assert (args.chat_template, args.chat_roles) == (None, DEFAULT_CHAT_ROLES)
    args = build_parser().parse_args(["--chat-template", str(GEMMA3_CHAT_TEMPLATE),
                                      "--chat-roles", "system, user,assistant,developer"])
    assert args.chat_template == GEMMA3_CHAT_TEMPLATE and GEMMA3_CHAT_TEMPLATE.is_file()
    assert args.chat_roles == ("system", "user", "assistant", "developer")
    for bad in (" , ", "user,a b"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--chat-roles", bad])


def _directory(path: Path, *names: str, config: str = "{}") -> Path:
    path.mkdir()
    for name in names:  # the check reads no tokenizer: placeholders do
        (path / name).write_text(config if name.endswith("config.json") else "{}")
    return path


def _text_file(path: Path) -> Path:
    path.write_text("not a GGUF")
    return path


#: A broken --model-path → the start of its one error line ({p}: the path).
BROKEN_MODEL_PATHS = {
    "empty directory": (lambda p: _directory(p), "{p}: no tokenizer.json or tokenizer.model"),
    "no tokenizer files": (lambda p: _directory(p, "config.json", "model.safetensors"),
                           "{p}: no tokenizer.json or tokenizer.model"),
    "bad config.json": (lambda p: _directory(p, "tokenizer.json", "config.json", config="{x"),
                        "{p}/config.json: invalid JSON"),
    "bad tokenizer_config.json": (
        lambda p: _directory(p, "tokenizer.json", "tokenizer_config.json", config="[]"),
        "{p}/tokenizer_config.json: expected a JSON object"),
    "no such path": (lambda p: p, "no GGUF file or checkpoint directory at {p}"),
    "not a GGUF file": (lambda p: _text_file(p.with_suffix(".gguf")), "{p}: not a GGUF file"),
}


@pytest.mark.parametrize("case", list(BROKEN_MODEL_PATHS))
def test_a_broken_model_path_is_one_line_and_exit_code_2(case: str, tmp_path: Path) -> None:
    make, message = BROKEN_MODEL_PATHS[case]
    path = make(tmp_path / "model")
    done = subprocess.run(
        [sys.executable, "-m", "services.tokenizer", "--model-path", str(path), "--port", "0",
         "--metrics-port", "0"], cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'services' / 'gen'}"})
    assert done.returncode == 2
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr[-2000:]
    assert lines[0].startswith(f"python -m services.tokenizer: error: {message.format(p=path)}")
    assert done.stdout == ""  # refused before any port was bound ("listening" is logged)


def test_process_serves_and_drains_on_sigterm(tmp_path: Path) -> None:
    port_file = tmp_path / "ports.json"
    env = dict(os.environ,
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "services" / "gen")]))
    process = subprocess.Popen(
        [sys.executable, "-m", "services.tokenizer", "--port", "0", "--metrics-port", "0",
         "--port-file", str(port_file), "--drain-seconds", "2"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not port_file.exists() or not port_file.read_text():
            assert process.poll() is None, process.communicate()[1].decode()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        ports = json.loads(port_file.read_text())
        with grpc.insecure_channel(f"127.0.0.1:{ports['grpc_port']}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            request = health_pb2.HealthCheckRequest(service="llmesh.v1.TokenizerService")
            while health.Check(request, timeout=5).status != health_pb2.HealthCheckResponse.SERVING:
                assert process.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
            stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
            info = stub.GetTokenizerInfo(tokenizer_pb2.GetTokenizerInfoRequest(), timeout=5)
            assert info.model == "SmolLM2-135M-Instruct" and info.has_chat_template
            ids = stub.Tokenize(tokenizer_pb2.TokenizeRequest(text="Hello 👋"), timeout=5).token_ids
            replies = stub.Detokenize(iter([tokenizer_pb2.DetokenizeRequest(
                token_ids=ids, flush=True)]), timeout=5)
            assert [r.text for r in replies] == ["Hello 👋"]
        metrics = urllib.request.urlopen(
            f"http://127.0.0.1:{ports['metrics_port']}/metrics", timeout=5).read().decode()
        assert 'llmesh:tokenizer_requests_total{code="OK",method="Tokenize"} 1.0' in metrics
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        logs = process.stderr.read().decode() if process.stderr else ""
        events = [json.loads(line)["event"] for line in logs.splitlines() if line.startswith("{")]
        assert events.index("tokenizer_ready") < events.index("serving") < events.index("stopped")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
