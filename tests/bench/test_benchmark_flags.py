"""The benchmarks' own command lines (benchmarks/contention.py,
peer_llamacpp.py, conversations.py, llama_contention.py): a bad flag value is
an argparse error naming the flag, an unreachable or failed server ends in one
line and exit status 1 (no traceback), and conversations.py shows a failed
bench run's stderr and leaves no temporary folder behind."""

from __future__ import annotations

import importlib
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from benchmarks import conversations
from services.cli.mesh import REPO_ROOT, MeshStartError, child_env, free_port


@pytest.mark.parametrize(("script", "argv", "message"), [
    ("contention.py", ["--busy", "abc"],
     "argument --busy: expected a whole number >= 0, got 'abc'"),
    ("contention.py", ["--concurrency", "0"], "argument --concurrency: must be >= 1, got 0"),
    ("peer_llamacpp.py", ["--num-warmups", "-1"], "argument --num-warmups: must be >= 0"),
    ("conversations.py", ["--repeats", "0"], "argument --repeats: must be >= 1, got 0"),
    ("conversations.py", ["--kv-cache-bytes", "lots"], "argument --kv-cache-bytes: expected a "
                                                       "size like 1GiB"),
])
def test_a_bad_flag_is_a_usage_error_naming_it(script: str, argv: list[str], message: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    # The script's own main() in process: argparse's exit 2 and message are the
    # same as from the command line (whose entry point calls main()), without
    # a Python start and the script's imports per case (~1.3 CPU-s each).
    main = importlib.import_module(f"benchmarks.{script.removesuffix('.py')}").main
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--print-shape" if script != "conversations.py" else "--quick"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and message in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize(("script", "argv", "message"), [
    ("contention.py", ["--llmesh-url", "127.0.0.1:{port}", "--llama-url",
                       "http://127.0.0.1:{port}", "--busy", "0", "--quota", "0",
                       "--concurrency", "1", "--rounds", "1", "--settle-seconds", "0",
                       "--out-dir", "{tmp}"],
     ("contention: stopped: llmesh bench exited with 1 (llmesh bench: cannot reach llmesh at "
      "127.0.0.1:{port}: UNAVAILABLE: ")),
    ("llama_contention.py", ["--server", "{tmp}/no-llama-server", "--requests", "1"],
     ("llama_contention: cannot start {tmp}/no-llama-server: No such file or directory")),
    ("llama_contention.py", ["--server", "/bin/false", "--requests", "1"],
     "llama_contention: llama-server did not become ready (exit 1)"),
])
def test_an_unreachable_server_is_one_line_and_exit_1(script: str, argv: list[str],
                                                      message: str, tmp_path: Path) -> None:
    fill = {"port": free_port("127.0.0.1"), "tmp": tmp_path}
    done = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / script),
                           *[a.format(**fill) for a in argv]],
                          capture_output=True, text=True, env=child_env(), timeout=120,
                          check=False)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1].startswith(message.format(**fill)), done.stderr


def test_a_failed_bench_run_shows_its_stderr(tmp_path: Path,
                                             capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(conversations.BenchFailed, match="exited 1"):
        conversations.bench("127.0.0.1:1", ["--num-prompts", "1", "--request-timeout", "5"],
                            tmp_path / "result.json")
    assert "llmesh bench: cannot reach llmesh at 127.0.0.1:1" in capfd.readouterr().err


def test_no_temporary_folder_is_left_behind(monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Path) -> None:
    def fail(*_: object) -> dict:
        raise conversations.BenchFailed("llmesh bench exited 1")

    def interrupt(*_: object) -> dict:
        raise KeyboardInterrupt

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(conversations, "run_mode", fail)
    assert conversations.main(["--quick"]) == 1
    monkeypatch.setattr(conversations, "run_mode", interrupt)
    with pytest.raises(KeyboardInterrupt):
        conversations.main(["--quick"])
    assert list(tmp_path.iterdir()) == []


def test_a_mesh_that_does_not_start_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    def mesh_failed(*_: object) -> dict:
        raise MeshStartError("engine-0 exited with code 1 while starting; full log: e.log\n"
                             "--- last lines ---\nValueError: ...")

    monkeypatch.setattr(conversations, "run_mode", mesh_failed)
    assert conversations.main(["--quick"]) == 1
    assert capsys.readouterr().err.splitlines() == [(
        "conversations: engine-0 exited with code 1 while starting; full log: e.log; "
        "--out-dir DIR keeps the meshes' logs")]
