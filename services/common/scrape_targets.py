"""Prometheus scrape targets of a running mesh (ports are only known once bound).

:func:`write_prometheus_config` writes, into one folder, a ready-to-use
``prometheus.yml`` (a copy of ``deploy/prometheus/prometheus-local.yml``)
and the ``targets.json`` it reads through ``file_sd_configs``: every
service's ``/metrics`` and Envoy's ``/stats/prometheus`` (through its
read-only ``ops`` listener: the admin interface stays on loopback), each with the
``job`` the Grafana dashboard selects on (:data:`JOBS`) and a ``service``
label (``engine-0``...). Then::

    prometheus --config.file RUN_DIR/prometheus/prometheus.yml

Prometheus re-reads ``targets.json`` when it changes, so a restarted mesh
only rewrites that file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: Prometheus job of each role; the dashboard and docs/observability.md use these.
JOBS = {
    "router": "llmesh-router",
    "tokenizer": "llmesh-tokenizer",
    "cache": "llmesh-cache",
    "engine": "llmesh-engine",
    "retriever": "llmesh-retriever",
    "envoy": "llmesh-envoy",
}

ENVOY_METRICS_PATH = "/stats/prometheus"
#: The text of ``deploy/prometheus/prometheus-local.yml`` (a test keeps the two
#: equal; an installed package has no deploy/ folder).
LOCAL_CONFIG = """\
# Prometheus for a mesh on one machine (`llmesh up`, or `Mesh` in tests).
#
# The services bind free ports, so the targets are not written here but in
# targets.json beside this file, by services.common.scrape_targets
# (write_prometheus_config(RUN_DIR / "prometheus", ...)), one group per
# service with the job the dashboard selects on:
#   llmesh-router, llmesh-tokenizer, llmesh-cache, llmesh-engine,
#   llmesh-retriever                                              (/metrics)
#   llmesh-envoy                                                  (/stats/prometheus)
# Run: prometheus --config.file RUN_DIR/prometheus/prometheus.yml
global:
  scrape_interval: 5s
  evaluation_interval: 5s
scrape_configs:
  - job_name: llmesh
    scrape_timeout: 4s
    file_sd_configs:
      - files: [targets.json]
        refresh_interval: 5s
"""


def job_of(service: str) -> str:
    """The job of a service name: its role, ``engine-3`` → ``llmesh-engine``.

    Raises:
      KeyError: an unknown role.
    """
    return JOBS[service.split("-", 1)[0]]


def file_sd_groups(metrics_addresses: Mapping[str, str],
                   envoy_stats: str | None = None) -> list[dict[str, Any]]:
    """Prometheus ``file_sd`` target groups.

    Args:
      metrics_addresses: service name (``router``, ``engine-0``...) → ``host:port``
        of its ``/metrics``; a service without one (metrics port -1) is left out
        by passing no entry.
      envoy_stats: ``host:port`` (or ``http://host:port``) that serves Envoy's
        ``/stats/prometheus``: its ``ops`` listener (``llmesh up --ops-port``).
    """
    groups: list[dict[str, Any]] = [
        {"targets": [address], "labels": {"job": job_of(name), "service": name}}
        for name, address in metrics_addresses.items()
    ]
    if envoy_stats:
        groups.append({
            "targets": [envoy_stats.removeprefix("http://").rstrip("/")],
            "labels": {"job": JOBS["envoy"], "service": "envoy",
                       "__metrics_path__": ENVOY_METRICS_PATH},
        })
    return groups


def write_prometheus_config(folder: Path, metrics_addresses: Mapping[str, str],
                            envoy_stats: str | None = None) -> Path:
    """Writes ``folder/prometheus.yml`` and ``folder/targets.json``; returns the
    config's path. ``targets.json`` is replaced atomically (Prometheus may be
    reading it)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "prometheus.yml"
    config.write_text(LOCAL_CONFIG)
    targets = folder / "targets.json"
    partial = folder / "targets.json.tmp"
    partial.write_text(json.dumps(file_sd_groups(metrics_addresses, envoy_stats), indent=2)
                       + "\n")
    os.replace(partial, targets)
    return config
