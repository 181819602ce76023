"""The Grafana dashboard and the Prometheus configs in deploy/ match the metrics
the mesh really exports.

The dashboard's PromQL is parsed for metric names, and each must be exported
by some endpoint of the running mesh (the union of every ``/metrics`` and
Envoy's ``/stats/prometheus``); only the GPU gauges may be absent, and only
where no GPU is visible. Where a ``prometheus`` binary is installed, a real
Prometheus scrapes the mesh with the local config and evaluates every panel
query.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
from pathlib import Path

import grpc
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from services.cli.mesh import Mesh
from services.common.gpu_telemetry import GPU_METRIC_NAMES, open_gpus
from services.common.scrape_targets import (
    JOBS,
    LOCAL_CONFIG,
    file_sd_groups,
    write_prometheus_config,
)
from services.retriever.metrics import RetrieverMetrics
from tests.e2e.mesh_client import chat_request, generate
from tests.observability.observability_scrape import (
    Scrape,
    all_names,
    fetch,
    scrape_all,
    wait_until,
)

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "llmesh-dashboard.json"
K8S_CONFIG = REPO / "deploy" / "prometheus" / "prometheus.yml"
LOCAL_CONFIG_FILE = REPO / "deploy" / "prometheus" / "prometheus-local.yml"

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_VALUES = re.compile(r"label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)")
_KEYWORDS = frozenset({
    "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile",
    "count_values", "group", "and", "or", "unless", "offset", "bool", "inf", "nan",
    "group_left", "group_right",
})


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (functions, keywords, label
    names, strings, ranges and template variables left out)."""
    text = _STRING.sub('""', expr)
    text = _MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    text = re.sub(r"\$\w+", " ", text)
    names = set()
    for match in _IDENT.finditer(text):
        rest = text[match.end():].lstrip()
        if rest.startswith("(") or match.group(0) in _KEYWORDS:
            continue
        names.add(match.group(0))
    return names


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels() -> list[dict]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def exprs() -> list[str]:
    return [t["expr"] for p in panels() for t in p["targets"]]


def used_names() -> set[str]:
    names = set().union(*(metric_names(e) for e in exprs()))
    for variable in dashboard()["templating"]["list"]:
        query = variable.get("query")
        text = query.get("query", "") if isinstance(query, dict) else str(query or "")
        names.update(_LABEL_VALUES.findall(text))
    return names


# --------------------------------------------------------------------------- #
# The parser of this test.


def test_metric_names_ignores_functions_labels_and_variables() -> None:
    expr = ('histogram_quantile(0.99, sum by (le, method) (rate(llmesh:a_bucket{job="x", '
            'model_name=~"$model_name"}[$__rate_interval]))) / on (job) group_left '
            'sum(envoy_b_total{envoy_cluster_name="router"}) - 1')
    assert metric_names(expr) == {"llmesh:a_bucket", "envoy_b_total"}


# --------------------------------------------------------------------------- #
# The dashboard on its own.


def test_dashboard_is_well_formed() -> None:
    board = dashboard()
    assert board["uid"] and board["title"] == "llmesh"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    for panel in panels():
        assert panel["title"] and panel["description"], panel["id"]
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"}, panel["title"]
        assert panel["fieldConfig"]["defaults"]["unit"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]


def test_dashboard_covers_what_the_issue_asks_for() -> None:
    text = "\n".join(exprs())
    for histogram in ("llmesh:time_to_first_token_seconds", "llmesh:inter_token_latency_seconds",
                      "llmesh:e2e_request_latency_seconds", "llmesh:request_queue_time_seconds",
                      "envoy_cluster_upstream_rq_time"):
        assert re.search(rf"histogram_quantile\(0\.99, .*{re.escape(histogram)}_bucket", text), \
            f"no p99 of {histogram}"
    names = used_names()
    for name in ("llmesh:num_requests_running", "llmesh:num_requests_waiting",
                 "llmesh:kv_cache_usage_perc", "llmesh:prefix_cache_hits_total",
                 "llmesh:prefix_cache_queries_total", "llmesh:generation_tokens_total",
                 "llmesh:requests_total", "envoy_cluster_upstream_rq_total",
                 "envoy_cluster_upstream_rq_xx", "llmesh:gpu_utilization_perc",
                 "llmesh:gpu_memory_used_bytes", "llmesh:tokenizer_request_duration_seconds_bucket",
                 "llmesh:cache_request_duration_seconds_bucket"):
        assert name in names, name
    assert 'outcome!~"stop|length|cancelled"' in text  # the error rate


def test_dashboard_selects_the_jobs_the_configs_define() -> None:
    jobs = set(re.findall(r'job="([^"]+)"', "\n".join(exprs())))
    assert jobs == set(JOBS.values())
    assert all(n.startswith(("llmesh:", "envoy_")) for n in used_names()), used_names()


# --------------------------------------------------------------------------- #
# Prometheus configs.


def test_local_config_is_the_one_the_launcher_writes(tmp_path: Path) -> None:
    assert LOCAL_CONFIG_FILE.read_text() == LOCAL_CONFIG
    config = write_prometheus_config(
        tmp_path / "prometheus", {"router": "127.0.0.1:1", "engine-0": "127.0.0.1:2"},
        "http://127.0.0.1:3")
    assert config.read_text() == LOCAL_CONFIG
    groups = json.loads((tmp_path / "prometheus" / "targets.json").read_text())
    assert groups == [
        {"targets": ["127.0.0.1:1"], "labels": {"job": "llmesh-router", "service": "router"}},
        {"targets": ["127.0.0.1:2"], "labels": {"job": "llmesh-engine", "service": "engine-0"}},
        {"targets": ["127.0.0.1:3"], "labels": {"job": "llmesh-envoy", "service": "envoy",
                                                "__metrics_path__": "/stats/prometheus"}},
    ]
    scrape = yaml.safe_load(config.read_text())["scrape_configs"][0]
    assert scrape["file_sd_configs"][0]["files"] == ["targets.json"]


def test_kubernetes_config_keeps_llmesh_pods_and_names_jobs_by_component() -> None:
    config = yaml.safe_load(K8S_CONFIG.read_text())
    (scrape,) = config["scrape_configs"]
    assert scrape["kubernetes_sd_configs"] == [{"role": "pod"}]
    relabel = {r.get("target_label"): r for r in scrape["relabel_configs"]}
    assert relabel["job"]["replacement"] == "llmesh-$1"
    assert relabel["job"]["source_labels"] == [
        "__meta_kubernetes_pod_label_app_kubernetes_io_component"]
    assert relabel["__metrics_path__"]["source_labels"] == [
        "__meta_kubernetes_pod_annotation_prometheus_io_path"]
    # job = llmesh-<component>: the jobs the dashboard selects on.
    assert {f"llmesh-{role}" for role in JOBS} == set(JOBS.values())
    address = relabel["__address__"]  # pod IP with the annotation's port
    match = re.fullmatch(address["regex"], "10.0.0.7:8080;9400")
    assert match is not None and address["replacement"] == "$1:$2"
    assert match.groups() == ("10.0.0.7", "9400")


@pytest.mark.parametrize("which", ["kubernetes", "local"])
def test_promtool_accepts_the_configs(which: str, tmp_path: Path) -> None:
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    if which == "local":
        path = write_prometheus_config(tmp_path, {"router": "127.0.0.1:1"}, "127.0.0.1:2")
    else:
        path = K8S_CONFIG
    result = subprocess.run(["promtool", "check", "config", str(path)], capture_output=True,
                            text=True, timeout=30)
    if "kubernetes_sd_configs not found" in result.stdout + result.stderr:
        pytest.skip("this promtool was built without Kubernetes discovery (Debian's)")
    assert result.returncode == 0, result.stdout + result.stderr


# --------------------------------------------------------------------------- #
# Against the live mesh.


@pytest.fixture(scope="module")
def live_names(mesh: Mesh, ingress_channel: grpc.Channel) -> set[str]:
    # Envoy creates some stats on first use (gRPC and response-code counters).
    assert generate(ingress_channel, chat_request("Hi.", max_tokens=2)).last is not None
    return all_names(scrape_all(mesh).values())


def retriever_names() -> set[str]:
    """What the retriever exports (the shared mesh runs without ``--retrieval``):
    its metrics in a fresh registry, every labelled one touched once."""
    metrics = RetrieverMetrics.create(CollectorRegistry())
    metrics.query_stage.labels("total").observe(0.001)
    metrics.cache_lookup("result", hit=True)
    metrics.embed_batch_size.observe(1)
    metrics.embedded_texts.labels("query").inc()
    metrics.embed_seconds.labels("query").inc(0.01)
    metrics.chunks.labels("c").set(1)
    metrics.requests.labels("Query", "OK").inc()
    return Scrape.parse(generate_latest(metrics.registry).decode()).names


def test_the_retriever_exports_what_the_dashboard_reads_of_it() -> None:
    read = {name for name in used_names() if name.startswith("llmesh:retriever_")}
    assert read and not read - retriever_names()


@pytest.mark.mesh
def test_every_metric_the_dashboard_reads_is_exported(live_names: set[str]) -> None:
    optional = set() if open_gpus() is not None else {
        f"{n}{s}" for n in GPU_METRIC_NAMES for s in ("", "_bucket")}
    optional |= retriever_names()
    missing = sorted(used_names() - live_names - optional)
    assert not missing, f"the dashboard reads metrics no endpoint exports: {missing}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _prometheus_api(base: str, path: str, **params: str) -> dict:
    query = urllib.parse.urlencode(params)
    return json.loads(fetch(f"{base}{path}?{query}" if query else f"{base}{path}"))


@pytest.mark.mesh
def test_real_prometheus_scrapes_the_mesh_and_evaluates_every_panel(
        mesh: Mesh, live_names: set[str], tmp_path: Path) -> None:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus is not installed (apt-get install prometheus)")
    addresses = {name: s.metrics_address for name, s in mesh.services.items()}
    config = write_prometheus_config(tmp_path / "prometheus", addresses, mesh.admin_url)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    with open(tmp_path / "prometheus.log", "wb") as log:
        process = subprocess.Popen(
            [binary, f"--config.file={config}", f"--web.listen-address=127.0.0.1:{port}",
             f"--storage.tsdb.path={tmp_path / 'data'}", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT)
    try:
        expected_jobs = {g["labels"]["job"] for g in file_sd_groups(addresses, mesh.admin_url)}

        def all_up() -> bool:
            try:
                result = _prometheus_api(base, "/api/v1/query", query="up == 1")
            except OSError:
                return False
            return {r["metric"]["job"] for r in result["data"]["result"]} == expected_jobs

        wait_until(all_up, 30.0, "Prometheus to scrape every target", poll_s=0.5)
        time.sleep(1.0)
        for expr in sorted(set(exprs())):
            query = expr.replace("$__rate_interval", "1m").replace("$model_name", ".*")
            result = _prometheus_api(base, "/api/v1/query", query=query)
            assert result["status"] == "success", (expr, result)
        series = _prometheus_api(base, "/api/v1/query",
                                 query='count by (job) ({job=~"llmesh-.*"})')["data"]["result"]
        assert {s["metric"]["job"] for s in series} == expected_jobs
    finally:
        process.terminate()
        process.wait(timeout=10)
