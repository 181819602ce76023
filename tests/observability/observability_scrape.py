"""Scraping helpers for the observability tests: every ``/metrics`` of a mesh
and Envoy's ``/stats/prometheus``, parsed with prometheus_client's parser."""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from services.cli.mesh import Mesh

#: Sample suffixes of each metric type, for families that have no sample yet.
_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_count", "_sum"),
    "gaugehistogram": ("_bucket", "_gcount", "_gsum"),
    "summary": ("_count", "_sum", ""),
}


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def _unescape(value: str) -> str:
    return re.sub(r'\\[\\"n]', lambda m: _UNESCAPE[m.group(0)], value)


@dataclass(frozen=True)
class Scrape:
    """One endpoint's exposition: samples by (name, labels) and every metric name
    it exports (sample names, and the names a family without samples will have).

    Names are the series names Prometheus stores. prometheus_client's parser
    (used here to check that the text is valid) renames counters to the
    OpenMetrics form: Envoy's ``envoy_cluster_upstream_rq{envoy_response_code=
    "200"}`` would come back as ``envoy_cluster_upstream_rq_total``, the name
    of another Envoy counter; so samples are read from the text itself.
    """

    samples: Mapping[tuple[str, frozenset[tuple[str, str]]], float]
    names: frozenset[str]

    def __repr__(self) -> str:  # short, for assertion messages
        return f"Scrape({len(self.samples)} samples)"

    @classmethod
    def parse(cls, text: str) -> Scrape:
        families = list(text_string_to_metric_families(text))  # raises on invalid text
        samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            match = _SAMPLE.match(line)
            if match is None:
                raise ValueError(f"unreadable sample line: {line!r}")
            name, labels, value = match.groups()
            pairs = frozenset((k, _unescape(v)) for k, v in _LABEL.findall(labels or ""))
            samples[(name, pairs)] = float(value)
        names = {name for name, _ in samples}
        for family in families:  # families with no sample yet (labelled, never used)
            if not family.samples:
                names.update(family.name + suffix
                             for suffix in _SUFFIXES.get(family.type, ("",)))
        return cls(samples, frozenset(names))

    def sum(self, name: str, **labels: str) -> float:
        """Sum of the samples named ``name`` whose labels include ``labels``."""
        wanted = set(labels.items())
        return sum(value for (n, lbls), value in self.samples.items()
                   if n == name and wanted <= lbls)

    def exact(self, name: str, **labels: str) -> float:
        """The sample named ``name`` with exactly ``labels`` (0 when absent)."""
        return self.samples.get((name, frozenset(labels.items())), 0.0)

    def values(self, name: str) -> list[float]:
        """Every sample named ``name``."""
        return [value for (n, _), value in self.samples.items() if n == name]


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def endpoints(mesh: Mesh) -> dict[str, str]:
    """Scrape URL of every service and of Envoy, by name (``envoy`` for Envoy)."""
    urls = {name: f"http://{service.metrics_address}/metrics"
            for name, service in mesh.services.items() if service.metrics_port not in (None, -1)}
    urls["envoy"] = f"{mesh.admin_url}/stats/prometheus"
    return urls


def scrape_all(mesh: Mesh) -> dict[str, Scrape]:
    """One scrape of every endpoint, by name."""
    return {name: Scrape.parse(fetch(url)) for name, url in endpoints(mesh).items()}


def delta(before: Mapping[str, Scrape], after: Mapping[str, Scrape], where: str, name: str,
          **labels: str) -> float:
    """How much ``name`` (summed over the series matching ``labels``) moved at ``where``."""
    return after[where].sum(name, **labels) - before[where].sum(name, **labels)


def all_names(scrapes: Iterable[Scrape]) -> set[str]:
    """Union of the metric names of several scrapes."""
    names: set[str] = set()
    for scrape in scrapes:
        names |= scrape.names
    return names


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str,
               poll_s: float = 0.05) -> None:
    """Polls ``condition`` until it holds; AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(poll_s)
