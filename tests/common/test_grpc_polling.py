"""``services.common.grpc_polling``: the engine's process reads its sockets on
the grpc.aio poller thread (GRPC_EXPERIMENTS set before grpc loads), an
operator's setting wins, and a program that imported grpc already is left as
it is. Each case runs in a fresh interpreter: pytest's has grpc loaded."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from services.common.grpc_polling import EXPERIMENTS_ENV, THREAD_POOL_READS

REPO = Path(__file__).resolve().parents[2]
OFF = ",".join(f"-{name}" for name in THREAD_POOL_READS)


def _python(code: str, **env: str) -> str:
    """Runs ``code`` in a fresh interpreter (no GRPC_EXPERIMENTS unless given);
    returns its stdout."""
    base = {k: v for k, v in os.environ.items() if k != EXPERIMENTS_ENV}
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, cwd=REPO, capture_output=True, text=True,
        timeout=60,
        env={**base, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'services' / 'gen'}", **env})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_engine_process_reads_on_the_poller_thread() -> None:
    # `python -m services.engine` (here with --help, which exits after parsing):
    # the variable is set before grpc is imported, so gRPC core reads it.
    out = _python(
        "import os, runpy, sys\n"
        "sys.argv = ['services.engine', '--help']\n"
        "try:\n"
        "    runpy.run_module('services.engine', run_name='__main__', alter_sys=True)\n"
        "except SystemExit:\n"
        "    pass\n"
        f"print('|' + os.environ.get({EXPERIMENTS_ENV!r}, 'unset'))\n")
    assert out.rsplit("|", 1)[1] == OFF


def test_importing_the_engine_main_changes_nothing() -> None:
    # `llmesh up --engine-arg=--help` imports build_parser: its process (and the
    # services it starts) keep gRPC's default.
    out = _python("import os, services.engine.__main__\n"
                  f"print(os.environ.get({EXPERIMENTS_ENV!r}, 'unset'))")
    assert out == "unset"


def test_an_operator_setting_wins_and_late_calls_do_nothing() -> None:
    out = _python(
        "import os\n"
        "from services.common.grpc_polling import read_on_poller\n"
        "print(read_on_poller(), os.environ['GRPC_EXPERIMENTS'])\n",
        GRPC_EXPERIMENTS="event_engine_fork")
    assert out == "False event_engine_fork"
    out = _python(
        "import os, grpc\n"
        "from services.common.grpc_polling import read_on_poller\n"
        "print(read_on_poller(), os.environ.get('GRPC_EXPERIMENTS', 'unset'))\n")
    assert out == "False unset"
    out = _python(
        "import os\n"
        "from services.common.grpc_polling import read_on_poller\n"
        "print(read_on_poller(), os.environ['GRPC_EXPERIMENTS'])\n")
    assert out == f"True {OFF}"
