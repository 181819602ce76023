"""Helpers for the launcher tests: stand-in services, test Envoy settings, PID checks.

Imported as ``cli_helpers`` (pytest puts this folder on ``sys.path``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from pathlib import Path

from services.cli.envoy_config import DESCRIPTOR_RELATIVE, REPO_ROOT, EnvoySettings
from services.cli.mesh import ServiceProcess, child_env

FAKE_SERVICE = Path(__file__).with_name("fake_service.py")
ROLES = ("tokenizer", "cache", "retriever", "engine", "router")


def fake_command(role: str, *extra: str) -> list[str]:
    """Command line that runs the stand-in for ``role``."""
    return [sys.executable, str(FAKE_SERVICE), "--role", role, *extra]


def fake_commands(**extra: list[str]) -> dict[str, list[str]]:
    """``Mesh(commands=...)`` running stand-ins for every role (``extra[role]`` appended)."""
    return {role: fake_command(role, *extra.get(role, [])) for role in ROLES}


def alive(pid: int) -> bool:
    """True while ``pid`` is a live process (a zombie counts as dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_all_dead(pids: Iterable[int], timeout_s: float = 10.0) -> list[int]:
    """Waits until no pid in ``pids`` is alive; returns the ones still alive."""
    pids = list(pids)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(alive(pid) for pid in pids):
            return []
        time.sleep(0.05)
    return [pid for pid in pids if alive(pid)]


def start_fake_router(run_dir: Path, *extra: str) -> ServiceProcess:
    """Starts the stand-in router on a free port and waits for its port file."""
    run_dir.mkdir(parents=True, exist_ok=True)
    service = ServiceProcess(
        name="router",
        argv=fake_command("router", "--port", "0", "--metrics-port", "-1",
                          "--port-file", str(run_dir / "router.json"), *extra),
        host="127.0.0.1",
        log_path=run_dir / "router.log",
        port_file=run_dir / "router.json",
    )
    service.spawn(child_env(), REPO_ROOT)
    deadline = time.monotonic() + 30
    while not service.read_port_file():
        assert service.exit_code() is None, service.log_path.read_text()
        assert time.monotonic() < deadline, "stand-in router did not bind"
        time.sleep(0.05)
    return service


def envoy_settings(router_port: int, **overrides: object) -> EnvoySettings:
    """Settings for a test Envoy: free ports, absolute descriptor."""
    values: dict[str, object] = dict(
        ingress_port=0, admin_port=0, router_port=router_port,
        descriptor_path=str(REPO_ROOT / DESCRIPTOR_RELATIVE),
    )
    values.update(overrides)
    return EnvoySettings(**values)  # type: ignore[arg-type]
