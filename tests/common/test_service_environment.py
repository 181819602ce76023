"""Every service refuses a bad value in the environment variables it reads
as it refuses a bad flag: exit 2, one line naming the variable and its value,
no traceback (``python -m services.<role>``, as ``llmesh up`` starts them)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.cli.mesh import REPO_ROOT, child_env

#: Each service's command line, nothing started before it parses its flags
#: (the router needs its upstream addresses, never dialled here).
SERVICES = {
    "tokenizer": [],
    "cache": [],
    "retriever": [],
    "engine": [],
    "router": ["--tokenizer", "127.0.0.1:9", "--engine", "127.0.0.1:9"],
}


def _refusal(role: str, environ: dict[str, str]) -> str:
    """Runs ``python -m services.ROLE`` with ``environ`` added; asserts exit 2
    and no traceback; returns its last stderr line."""
    result = subprocess.run(
        [sys.executable, "-m", f"services.{role}", "--port", "0", "--metrics-port", "-1",
         *SERVICES[role]],
        capture_output=True, text=True, cwd=REPO_ROOT, env=child_env(environ), timeout=120)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    return result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("role", sorted(SERVICES))
def test_a_bad_log_level_variable_is_refused_naming_it(role: str) -> None:
    """QA: ``LLMESH_LOG_LEVEL=FOO`` was a KeyError traceback at start (the
    choices of ``--log-level`` are not checked against a default)."""
    assert _refusal(role, {"LLMESH_LOG_LEVEL": "FOO"}) == (
        f"python -m services.{role}: error: argument --log-level: LLMESH_LOG_LEVEL='FOO': "
        "choose one of debug, info, warning, error, critical")


def test_a_bad_engine_variable_is_a_usage_error() -> None:
    """An ``LLMESH_ENGINE_*`` value the engine cannot parse exits 2 as its
    flag would (it was 1, as for a model that failed to load)."""
    assert _refusal("engine", {"LLMESH_ENGINE_MAX_NUM_SEQS": "0"}) == (
        "python -m services.engine: error: LLMESH_ENGINE_MAX_NUM_SEQS='0': must be in "
        "[1, 16384], got 0")
