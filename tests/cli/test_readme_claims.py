"""What the README tells a user about the CLI and the test suite holds."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: The reason every test that needs Prometheus (``prometheus`` or ``promtool``) skips with.
NEEDS_PROMETHEUS = "is not installed (apt-get install prometheus)"


def _readme() -> str:
    return " ".join((ROOT / "README.md").read_text().split())


def _functions(path: Path) -> dict[str, str]:
    """The source of each function defined in ``path``, by name."""
    source = path.read_text()
    return {node.name: ast.get_source_segment(source, node) or ""
            for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _tests_needing_prometheus() -> list[str]:
    """Node ids of the tests in tests/observability that skip without Prometheus."""
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "tests/observability"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    sources: dict[str, dict[str, str]] = {}
    needing = []
    for node in (line for line in listed.stdout.splitlines() if "::" in line):
        path, _, rest = node.partition("::")
        name = rest.split("::")[-1].split("[")[0]
        if path not in sources:
            sources[path] = _functions(ROOT / path)
        if NEEDS_PROMETHEUS in sources[path][name]:
            needing.append(node)
    return needing


def test_readme_says_how_many_tests_skip_without_prometheus() -> None:
    match = re.search(r"`make test` does not install Prometheus: without it (\d+) tests in "
                      r"`tests/observability` skip", _readme())
    assert match is not None, "README: the make test paragraph must name the Prometheus skips"
    needing = _tests_needing_prometheus()
    assert int(match.group(1)) == len(needing), needing
    assert "CI installs it with apt" in _readme()


def test_readme_states_the_cli_address_precedence_and_bypass_cache() -> None:
    text = _readme()
    assert ("the mesh address: `--url`, else `LLMESH_URL`, else `127.0.0.1:$LLMESH_PORT`, "
            "else `127.0.0.1:8080`") in text
    assert "`--bypass-cache`" in text and "`response_cache=replay`" in text
