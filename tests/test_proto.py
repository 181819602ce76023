"""The protobuf contract: buf lint is clean and the committed generated code is fresh."""

from __future__ import annotations

import filecmp
import importlib.metadata as metadata
import re
import subprocess
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

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


#: What writes services/gen and the descriptor set: pinned exactly in constraints.txt.
GENERATORS = ("grpcio-tools", "mypy-protobuf", "buf-bin")


def pinned() -> dict[str, str]:
    """constraints.txt as name -> exact version (a pin that is not ``==`` fails)."""
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.split("#")[0].strip():
            requirement = Requirement(line.split("#")[0])
            (spec,) = requirement.specifier
            assert spec.operator == "==", f"{line}: constraints.txt pins exact versions"
            pins[requirement.name] = spec.version
    return pins


def min_version(specifier: SpecifierSet) -> str:
    """The version in ``specifier``'s ``>=`` clause."""
    (lower,) = (spec.version for spec in specifier if spec.operator == ">=")
    return lower


def test_the_code_generators_are_pinned_installed_and_stamped_in_the_stubs() -> None:
    """The drift test above compares with what the installed generators write:
    they must be the pinned ones, and the committed stubs theirs (a new
    grpcio-tools release must not fail CI; updating the pin is a commit)."""
    pins = pinned()
    assert set(GENERATORS) <= set(pins)
    for name in GENERATORS:
        assert metadata.version(name) == pins[name], f"{name}: run make install"
    assert _buf("--version").stdout.strip() == pins["buf-bin"]
    stamped = {re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", path.read_text()).group(1)
               for path in (ROOT / "services" / "gen").rglob("*_pb2_grpc.py")}
    assert stamped == {pins["grpcio-tools"]}, "run make generate with the pinned grpcio-tools"
    # ... and the runtime that pyproject.toml allows is one the stubs accept.
    (grpc_version,) = stamped
    (gencode,) = {re.search(r"Protobuf Python Version: (\S+)", path.read_text()).group(1)
                  for path in (ROOT / "services" / "gen").rglob("*_pb2.py")}
    runtime = {Requirement(r).name: Requirement(r).specifier for r in tomllib.loads(
        (ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    assert min_version(runtime["grpcio"]) == grpc_version
    assert min_version(runtime["protobuf"]) == gencode
    makefile = (ROOT / "Makefile").read_text()
    assert "CONSTRAINTS := constraints.txt" in makefile
    installs = re.findall(r"^\t.*pip install.*$|^PIP_INSTALL := .*$", makefile, re.M)
    assert installs and all("-c $(CONSTRAINTS)" in line for line in installs), installs


def test_envoy_descriptor_set_is_fresh(tmp_path: Path) -> None:
    out = tmp_path / "descriptor.binpb"
    result = _buf("build", "--path", "proto/llmesh", "--exclude-source-info", "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert out.read_bytes() == (ROOT / "envoy" / "llmesh_descriptor.binpb").read_bytes()


def test_rpcs_no_llmesh_service_calls_are_deprecated_and_name_their_successor() -> None:
    """Issue 32's dead paths: the engine's one-request ``Generate`` (the router
    uses ``Multiplex``) and the tokenizer's ``Detokenize`` (the router decodes in
    process). Deprecated, not deleted, so outside callers keep working."""
    from llmesh.v1 import engine_pb2, tokenizer_pb2

    for module, service, method, successor in (
            (engine_pb2, "EngineService", "Generate", "Multiplex"),
            (tokenizer_pb2, "TokenizerService", "Detokenize", "GetTokenizer")):
        rpc = module.DESCRIPTOR.services_by_name[service].methods_by_name[method]
        assert rpc.GetOptions().deprecated, f"{service}.{method}"
        proto = (ROOT / "proto" / "llmesh" / "v1" / Path(module.__file__).name.replace(
            "_pb2.py", ".proto")).read_text()
        comment = proto[:proto.index(f"rpc {method}(")].rsplit("rpc ", 1)[-1]
        assert f"call {successor} " in comment.replace("Call", "call"), comment
