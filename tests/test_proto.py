"""The protobuf contract: buf lint is clean and the committed generated code is fresh."""

from __future__ import annotations

import filecmp
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _buf(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["buf", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_buf_lint_is_clean() -> None:
    result = _buf("lint")
    assert result.returncode == 0, result.stdout + result.stderr


def test_buf_format_is_clean() -> None:
    result = _buf("format", "-d", "--exit-code")
    assert result.returncode == 0, result.stdout + result.stderr


def test_generated_stubs_match_a_fresh_buf_generate(tmp_path: Path) -> None:
    result = _buf("generate", "--path", "proto/llmesh", "-o", str(tmp_path))
    assert result.returncode == 0, result.stderr
    fresh = tmp_path / "services" / "gen" / "llmesh" / "v1"
    committed = ROOT / "services" / "gen" / "llmesh" / "v1"
    fresh_files = sorted(p.name for p in fresh.iterdir())
    assert fresh_files, "buf generate produced nothing"
    match, mismatch, errors = filecmp.cmpfiles(fresh, committed, fresh_files, shallow=False)
    assert not mismatch and not errors, f"stale generated files (run `make generate`): {mismatch + errors}"


def test_envoy_descriptor_set_is_fresh(tmp_path: Path) -> None:
    out = tmp_path / "descriptor.binpb"
    result = _buf("build", "--path", "proto/llmesh", "--exclude-source-info", "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert out.read_bytes() == (ROOT / "envoy" / "llmesh_descriptor.binpb").read_bytes()
