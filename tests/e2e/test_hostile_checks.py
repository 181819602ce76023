"""The hostile tests' process checks without a mesh: finding Envoy by its
config path, telling a dead (zombie) PID from a live one, and the problem
lines the soak scripts print."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from tests.e2e.hostile_checks import (
    ENVOY,
    Watched,
    alive,
    envoy_pid,
    problems,
    watched_from_run_dir,
)

_SLEEP = "import time; time.sleep(60)"


def test_envoy_is_found_by_its_config_path_and_a_run_dir_lists_every_process(
        tmp_path: Path) -> None:
    # A stand-in started the way the launcher starts Envoy: ``... -c RUN_DIR/envoy.yaml``.
    fake = subprocess.Popen([sys.executable, "-c", _SLEEP, "-c", str(tmp_path / "envoy.yaml")])
    other = subprocess.Popen([sys.executable, "-c", _SLEEP, "-c",
                              str(tmp_path / "other" / "envoy.yaml")])
    try:
        deadline = time.monotonic() + 10
        while envoy_pid(tmp_path) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert envoy_pid(tmp_path) == fake.pid
        (tmp_path / "router.json").write_text(json.dumps(
            {"pid": 4242, "grpc_port": 50051, "metrics_port": 9400}))
        (tmp_path / "engine-0.json").write_text(json.dumps(
            {"pid": 4343, "grpc_port": 50061, "metrics_port": 9461}))
        (tmp_path / "prometheus.json").write_text("{}")  # not a service's port file
        (tmp_path / "envoy-admin-address").write_text("127.0.0.1:9901\n")
        processes, engines = watched_from_run_dir(tmp_path)
        assert processes == [Watched("engine-0", 4343, "127.0.0.1:50061"),
                             Watched("router", 4242, "127.0.0.1:50051"),
                             Watched(ENVOY, fake.pid, "http://127.0.0.1:9901")]
        assert engines == ["127.0.0.1:50061"]
    finally:
        for process in (fake, other):
            process.kill()
            process.wait()
    assert envoy_pid(tmp_path) is None


def test_a_dead_process_is_a_problem_even_before_it_is_reaped() -> None:
    running = subprocess.Popen([sys.executable, "-c", _SLEEP])
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 10
        while alive(exited.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert Path(f"/proc/{exited.pid}").exists()  # a zombie: not reaped yet
        assert not alive(exited.pid)
        assert alive(running.pid)
        # Nothing serves on these addresses: the live ones are not SERVING / ready.
        found = problems([Watched("router", running.pid, "127.0.0.1:1"),
                          Watched("tokenizer", exited.pid, "127.0.0.1:1"),
                          Watched(ENVOY, running.pid, "http://127.0.0.1:1")])
        assert found == ["router is not SERVING",
                         f"tokenizer (pid {exited.pid}) is gone: it died or restarted",
                         "envoy is not ready (admin /ready)"]
    finally:
        running.kill()
        running.wait()
        exited.wait()


def test_the_soak_client_starts_without_the_mesh_launcher() -> None:
    """``benchmarks/soak.py`` starts a fresh ``--client`` process for each
    SIGKILLed client (10 of the CI soak's 500 requests); importing the launcher
    (Envoy's config types) cost each ~1.3 s of CPU on 2 cores."""
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, benchmarks.soak; "
         "print(sorted(m for m in sys.modules if m.startswith(('services.cli', 'envoy_data'))))"],
        cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=60)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "[]"
