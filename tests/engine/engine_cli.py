"""``python -m services.engine`` as a child process, for the tests of its
refusals: one start, or several side by side (a module's refusals run at
once rather than one after another: a refusal the torch backend's
``start_checks`` makes costs ~0.5 s of one core, one that needs torch or
another backend ~2.5 s)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def start_engine(*argv: str, python_path: Path | None = None,
                 environ: Mapping[str, str] | None = None) -> subprocess.Popen[str]:
    """``python -m services.engine --port 0 ARGV`` from the repository, stdout
    and stderr piped; ``python_path`` first on PYTHONPATH, ``environ`` added."""
    paths = [*([python_path] if python_path else []), REPO, REPO / "services" / "gen"]
    return subprocess.Popen(
        [sys.executable, "-m", "services.engine", "--port", "0", *argv],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **(environ or {}),
             "PYTHONPATH": os.pathsep.join(map(str, paths))})


def finish(process: subprocess.Popen[str], timeout_s: float = 120.0
           ) -> subprocess.CompletedProcess[str]:
    """Waits for a started engine to exit.

    Raises:
      subprocess.TimeoutExpired: it ran ``timeout_s`` seconds (then it is killed).
    """
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def run_all(starts: Mapping[str, Callable[[], subprocess.Popen[str]]]
            ) -> dict[str, subprocess.CompletedProcess[str]]:
    """Starts every engine of ``starts`` at once and waits for each, by key;
    none is left running when this returns or raises."""
    processes: dict[str, subprocess.Popen[str]] = {}
    try:
        for key, start in starts.items():
            processes[key] = start()
        return {key: finish(process) for key, process in processes.items()}
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.communicate()
