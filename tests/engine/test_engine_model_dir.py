"""A broken ``--model-path`` as ``python -m services.engine`` meets it: one line
naming the file and the fault, exit code 2, before any port is bound (the
directory's files are checked without reading weights); a fault only the
weights show is one ``engine_load_failed`` line after binding, exit code 1."""

from __future__ import annotations

import functools
import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from benchmarks.random_checkpoint import save_tiny_llama
from tests.engine.engine_cli import finish, run_all, start_engine

PROG = "python -m services.engine: error: "
LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
         "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 256,
         "max_position_embeddings": 128, "eos_token_id": 2}


def run_engine(*argv: str) -> subprocess.CompletedProcess[str]:
    return finish(start_engine("--metrics-port", "0", *argv))


def one_error_line(done: subprocess.CompletedProcess[str]) -> str:
    """The single line on stderr, after the program's prefix."""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(PROG), done.stderr[-2000:]
    return lines[0].removeprefix(PROG)


def write(directory: Path, files: dict[str, str | dict]) -> Path:
    directory.mkdir()
    for name, content in files.items():
        (directory / name).write_text(content if isinstance(content, str) else json.dumps(content))
    return directory


def shards(directory: Path) -> Path:
    """An index naming two shards, the second missing."""
    index = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                            "model.norm.weight": "model-00002-of-00002.safetensors"}}
    write(directory, {"config.json": LLAMA, "model.safetensors.index.json": index,
                      "model-00001-of-00002.safetensors": ""})
    return directory


def not_gguf(path: Path) -> Path:
    path = path.with_suffix(".gguf")
    path.write_text("not a GGUF")
    return path


CASES: dict[str, tuple[Callable[[Path], Path], str]] = {
    "no config.json": (lambda d: write(d, {"model.safetensors": ""}), "no config.json in {d}"),
    "empty directory": (lambda d: write(d, {}), "no config.json in {d}"),
    "bad JSON": (lambda d: write(d, {"config.json": '{"architectures": ['}),
                 "{d}/config.json: invalid JSON"),
    "unsupported architecture": (
        lambda d: write(d, {"config.json": {**LLAMA, "architectures": ["MambaForCausalLM"]},
                            "model.safetensors": ""}),
        "{d}/config.json: architectures ['MambaForCausalLM'] are not supported"),
    "missing shard": (shards, "{d}/model.safetensors.index.json names the shard "
                              "model-00002-of-00002.safetensors, which is missing"),
    "no weights": (lambda d: write(d, {"config.json": LLAMA}),
                   "{d}: no model.safetensors and no model.safetensors.index.json"),
    "no such path": (lambda d: d.with_suffix(".gguf"),
                     "no GGUF file or checkpoint directory at {d}"),
    "not a GGUF file": (not_gguf, "{d}: not a GGUF file"),
}


@pytest.fixture(scope="module")
def broken_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each case's broken model path (:data:`CASES`), in a folder of its own."""
    return {case: make(tmp_path_factory.mktemp("broken-model-path") / "model")
            for case, (make, _) in CASES.items()}


@pytest.fixture(scope="module")
def broken_runs(broken_paths: dict[str, Path]) -> dict[str, subprocess.CompletedProcess[str]]:
    """The engine started on each case's path, all at once (:func:`run_all`)."""
    return run_all({case: functools.partial(start_engine, "--metrics-port", "0",
                                      "--model-path", str(path))
                    for case, path in broken_paths.items()})


@pytest.mark.parametrize("case", list(CASES))
def test_a_broken_model_path_is_one_line_and_exit_code_2(
        case: str, broken_paths: dict[str, Path],
        broken_runs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    path, message = broken_paths[case], CASES[case][1]
    done = broken_runs[case]
    assert done.returncode == 2, done.stderr[-2000:]
    assert message.format(d=path) in one_error_line(done)
    assert done.stdout == ""  # refused before any port was bound ("listening" is logged)


def test_a_truncated_shard_is_one_engine_load_failed_line(tmp_path: Path) -> None:
    path = save_tiny_llama(tmp_path / "tiny", max_shard_size="2MB")
    shard = sorted(path.glob("model-*.safetensors"))[-1]
    with shard.open("r+b") as file:
        file.truncate(file.seek(0, 2) - 8)
    done = run_engine("--model-path", str(path), "--kv-cache-bytes", "1MB")
    assert done.returncode == 1
    events = [json.loads(line) for line in (done.stdout + done.stderr).splitlines()]
    # info lines of the start (e.g. the thread governor's engine_threads) may come between
    assert [e["event"] for e in events if e["level"] != "info"] == ["engine_load_failed"]
    assert events[0]["event"] == "listening" and events[-1]["event"] == "engine_load_failed"
    assert events[-1]["error"].startswith(f"{shard}: not a valid safetensors file")
    assert "Traceback" not in done.stdout + done.stderr


#: ``--backend tensorrt_llm`` arguments → the start of the refusal.
TENSORRT_CASES = {
    (): "the tensorrt_llm backend needs --model-path",
    ("--model-path", "/models/x.Q4_1.gguf"): "/models/x.Q4_1.gguf is a GGUF file",
    ("--model-path", "/models/absent"): "no checkpoint directory at /models/absent",
}


@pytest.fixture(scope="module")
def tensorrt_runs(tmp_path_factory: pytest.TempPathFactory
                  ) -> dict[str, subprocess.CompletedProcess[str]]:
    """The tensorrt_llm engine started with each of :data:`TENSORRT_CASES`'
    arguments, all at once, with a stand-in ``tensorrt_llm`` package on the path."""
    root = tmp_path_factory.mktemp("tensorrt")
    fake = root / "tensorrt_llm"  # found by check_available; never imported
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    return run_all({" ".join(argv): functools.partial(
        start_engine, "--metrics-port", "0", "--backend", "tensorrt_llm", *argv,
        python_path=root)
        for argv in TENSORRT_CASES})


@pytest.mark.parametrize(("argv", "message"), list(TENSORRT_CASES.items()))
def test_tensorrt_llm_refuses_a_bad_model_path_before_binding(
        argv: tuple[str, ...], message: str,
        tensorrt_runs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    done = tensorrt_runs[" ".join(argv)]
    assert done.returncode == 2
    assert one_error_line(done).startswith(message)
    assert done.stdout == ""


def test_a_kv_cache_beyond_the_host_s_memory_is_refused_at_start(tmp_path: Path) -> None:
    """A KV budget beyond the host's available memory is refused before it is
    allocated (engine_load_failed naming --kv-cache-bytes), not zero-filled into
    swap or the OOM killer."""
    available = next(int(line.split()[1]) * 1024
                     for line in Path("/proc/meminfo").read_text().splitlines()
                     if line.startswith("MemAvailable:"))
    path = save_tiny_llama(tmp_path / "tiny")
    done = run_engine("--model-path", str(path), "--kv-cache-bytes", str(available + 2**30))
    assert done.returncode == 1, (done.stdout + done.stderr)[-2000:]
    events = [json.loads(line) for line in (done.stdout + done.stderr).splitlines()]
    assert events[-1]["event"] == "engine_load_failed"
    assert events[-1]["error"].startswith(f"--kv-cache-bytes {available + 2**30} exceeds")
    assert "Traceback" not in done.stdout + done.stderr
