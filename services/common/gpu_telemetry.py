"""GPU telemetry from NVML (``nvidia-ml-py``) as Prometheus gauges.

Read at scrape time by a custom collector (no thread, nothing per request):

* ``llmesh:gpu_utilization_perc{gpu, uuid}``: fraction of the last sample
  period in which a kernel ran, 0..1 (NVML's percentage / 100, on the same
  0..1 scale as ``llmesh:kv_cache_usage_perc``);
* ``llmesh:gpu_memory_used_bytes{gpu, uuid}`` and
  ``llmesh:gpu_memory_total_bytes{gpu, uuid}``: device memory, bytes.

``gpu`` is NVML's device index, ``uuid`` the device's UUID. Only the devices
this process may use are reported: those named by ``CUDA_VISIBLE_DEVICES``
(indices or ``GPU-`` UUIDs) when it is set, else all of them.

Without a GPU (no ``pynvml`` module, no NVML library, no driver, no device)
:func:`register_gpu_telemetry` registers nothing and returns None: the gauges
are simply absent, never an error. A device that stops answering (or does
not support a query, e.g. utilisation on a MIG slice) is left out of that
scrape; the collector never raises.

The server kit registers it in the engine by default (``--gpu-telemetry``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import prometheus_client
import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = structlog.get_logger()

UTILIZATION = "llmesh:gpu_utilization_perc"
MEMORY_USED = "llmesh:gpu_memory_used_bytes"
MEMORY_TOTAL = "llmesh:gpu_memory_total_bytes"
#: The metric names this module may export.
GPU_METRIC_NAMES = (UTILIZATION, MEMORY_USED, MEMORY_TOTAL)
_LABELS = ["gpu", "uuid"]


@dataclass(frozen=True)
class GpuDevice:
    """One NVML device: its index, UUID and handle."""

    index: int
    uuid: str
    handle: Any


class GpuCollector(Collector):
    """Yields the GPU gauges for ``devices`` at each scrape (see the module doc)."""

    def __init__(self, nvml: ModuleType, devices: list[GpuDevice]) -> None:
        self._nvml = nvml
        self.devices = list(devices)

    def collect(self) -> Iterator[Metric]:
        nvml = self._nvml
        util = GaugeMetricFamily(UTILIZATION, "GPU utilisation (time a kernel ran), 0..1.",
                                 labels=_LABELS)
        used = GaugeMetricFamily(MEMORY_USED, "GPU memory in use (bytes).", labels=_LABELS)
        total = GaugeMetricFamily(MEMORY_TOTAL, "GPU memory in all (bytes).", labels=_LABELS)
        for device in self.devices:
            labels = [str(device.index), device.uuid]
            try:
                util.add_metric(labels, nvml.nvmlDeviceGetUtilizationRates(device.handle).gpu
                                / 100.0)
            except nvml.NVMLError:
                pass  # not supported (MIG) or the device is gone: left out of this scrape
            try:
                memory = nvml.nvmlDeviceGetMemoryInfo(device.handle)
            except nvml.NVMLError:
                continue
            used.add_metric(labels, float(memory.used))
            total.add_metric(labels, float(memory.total))
        yield util
        yield used
        yield total

    def describe(self) -> Iterator[Metric]:
        """The families without samples: registering never queries NVML."""
        for name in GPU_METRIC_NAMES:
            yield GaugeMetricFamily(name, name, labels=_LABELS)


def _as_text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _visible_handles(nvml: ModuleType, env: Mapping[str, str]) -> list[Any]:
    """NVML handles of the devices ``CUDA_VISIBLE_DEVICES`` allows (all when unset)."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
    handles = []
    for entry in (e.strip() for e in visible.split(",")):
        if not entry:
            continue
        if entry.lstrip("-").isdigit():
            if int(entry) < 0:
                break  # CUDA stops at the first invalid index
            handles.append(nvml.nvmlDeviceGetHandleByIndex(int(entry)))
        elif entry.startswith("GPU-"):
            handles.append(nvml.nvmlDeviceGetHandleByUUID(entry))
        # MIG-... slices: no per-slice utilisation in NVML; not reported.
    return handles


def open_gpus(nvml: ModuleType | None = None,
              env: Mapping[str, str] | None = None) -> GpuCollector | None:
    """A collector for this process's GPUs, or None when there is none.

    Args:
      nvml: the ``pynvml`` module (tests pass a stand-in); default: imported now.
      env: the environment to read ``CUDA_VISIBLE_DEVICES`` from (default: os.environ).
    """
    if nvml is None:
        try:
            import pynvml as nvml  # noqa: PLC0415 - optional, only where a GPU may be
        except ImportError:
            return None
    try:
        nvml.nvmlInit()
        handles = _visible_handles(nvml, os.environ if env is None else env)
        devices = [GpuDevice(nvml.nvmlDeviceGetIndex(h), _as_text(nvml.nvmlDeviceGetUUID(h)), h)
                   for h in handles]
    except (nvml.NVMLError, OSError) as err:  # no library, driver, device or permission
        log.debug("gpu_telemetry_unavailable", reason=type(err).__name__)
        return None
    return GpuCollector(nvml, devices) if devices else None


def register_gpu_telemetry(registry: CollectorRegistry | None = None, *,
                           nvml: ModuleType | None = None,
                           env: Mapping[str, str] | None = None) -> GpuCollector | None:
    """Registers the GPU gauges in ``registry`` (default: the process registry)
    when this process sees a GPU; returns the collector, or None (nothing
    registered) without one."""
    collector = open_gpus(nvml, env)
    if collector is None:
        return None
    (prometheus_client.REGISTRY if registry is None else registry).register(collector)
    log.info("gpu_telemetry", gpus=[d.index for d in collector.devices])
    return collector
