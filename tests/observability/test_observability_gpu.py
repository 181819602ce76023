"""GPU telemetry: absent without error on a CPU host; exact gauges from NVML
where a GPU is (NVML stood in for by a fake module here); the server kit's
``--gpu-telemetry`` switch."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from services.common.gpu_telemetry import (
    GPU_METRIC_NAMES,
    GpuCollector,
    open_gpus,
    register_gpu_telemetry,
)
from services.common.server import ServerConfig, add_server_arguments, server_config_from_args


class FakeNvml:
    """The parts of pynvml the collector uses, over a list of fake devices."""

    class NVMLError(Exception):
        pass

    class NVMLError_LibraryNotFound(NVMLError):  # noqa: N801 - pynvml's name
        pass

    def __init__(self, devices: list[dict], *, init_error: type[Exception] | None = None):
        self.devices = devices
        self.init_error = init_error
        self.initialised = False

    def nvmlInit(self) -> None:  # noqa: N802 - pynvml's name
        if self.init_error is not None:
            raise self.init_error("no NVML")
        self.initialised = True

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> dict:  # noqa: N802
        return self.devices[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> dict:  # noqa: N802
        return next(d for d in self.devices if d["uuid"] == uuid)

    def nvmlDeviceGetIndex(self, handle: dict) -> int:  # noqa: N802
        return self.devices.index(handle)

    def nvmlDeviceGetUUID(self, handle: dict) -> bytes:  # noqa: N802
        return handle["uuid"].encode()  # older pynvml returns bytes

    def nvmlDeviceGetUtilizationRates(self, handle: dict) -> SimpleNamespace:  # noqa: N802
        if handle.get("util") is None:
            raise self.NVMLError("not supported")
        return SimpleNamespace(gpu=handle["util"], memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle: dict) -> SimpleNamespace:  # noqa: N802
        if handle.get("lost"):
            raise self.NVMLError("GPU is lost")
        return SimpleNamespace(used=handle["used"], total=handle["total"], free=0)


def _devices() -> list[dict]:
    return [
        {"uuid": "GPU-aaa", "util": 37, "used": 1_000, "total": 8_000},
        {"uuid": "GPU-bbb", "util": None, "used": 2_000, "total": 8_000},  # MIG: no utilisation
    ]


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in registry.collect() for s in family.samples}


def test_absent_without_error_on_this_host_when_it_has_no_gpu() -> None:
    registry = CollectorRegistry()
    collector = register_gpu_telemetry(registry)
    if collector is not None:
        pytest.skip("this host has a GPU (see test_gauges_from_nvml for the values)")
    assert open_gpus() is None
    assert not any(name.startswith("llmesh:gpu") for name, _ in _samples(registry))
    assert b"llmesh:gpu" not in generate_latest(registry)


@pytest.mark.parametrize("error", ["import", "library", "no devices"])
def test_no_gpu_means_nothing_registered(error: str, monkeypatch: pytest.MonkeyPatch) -> None:
    registry = CollectorRegistry()
    if error == "import":
        monkeypatch.setitem(__import__("sys").modules, "pynvml", None)  # ImportError
        assert register_gpu_telemetry(registry) is None
    elif error == "library":
        nvml = FakeNvml(_devices(), init_error=FakeNvml.NVMLError_LibraryNotFound)
        assert register_gpu_telemetry(registry, nvml=nvml, env={}) is None
    else:
        assert register_gpu_telemetry(registry, nvml=FakeNvml([]), env={}) is None
    assert _samples(registry) == {}


def test_gauges_from_nvml() -> None:
    registry = CollectorRegistry()
    collector = register_gpu_telemetry(registry, nvml=FakeNvml(_devices()), env={})
    assert isinstance(collector, GpuCollector)
    samples = {k: v for k, v in _samples(registry).items() if k[0].startswith("llmesh:gpu")}
    a = (("gpu", "0"), ("uuid", "GPU-aaa"))
    b = (("gpu", "1"), ("uuid", "GPU-bbb"))
    assert samples == {
        ("llmesh:gpu_utilization_perc", a): 0.37,
        ("llmesh:gpu_memory_used_bytes", a): 1_000,
        ("llmesh:gpu_memory_total_bytes", a): 8_000,
        ("llmesh:gpu_memory_used_bytes", b): 2_000,
        ("llmesh:gpu_memory_total_bytes", b): 8_000,
    }
    assert {name for name, _ in samples} == set(GPU_METRIC_NAMES)


def test_a_device_that_fails_is_left_out_and_the_scrape_still_works() -> None:
    devices = _devices()
    nvml = FakeNvml(devices)
    registry = CollectorRegistry()
    register_gpu_telemetry(registry, nvml=nvml, env={})
    devices[0]["lost"] = True
    devices[0]["util"] = None
    text = generate_latest(registry).decode()
    assert 'uuid="GPU-aaa"' not in text and 'uuid="GPU-bbb"' in text


@pytest.mark.parametrize(("visible", "uuids"), [
    ("1", ["GPU-bbb"]),
    ("GPU-bbb,0", ["GPU-bbb", "GPU-aaa"]),
    ("", []),
    ("0,-1,1", ["GPU-aaa"]),  # CUDA stops at the first invalid index
])
def test_cuda_visible_devices_limits_what_is_reported(visible: str, uuids: list[str]) -> None:
    collector = open_gpus(FakeNvml(_devices()), env={"CUDA_VISIBLE_DEVICES": visible})
    got = [d.uuid for d in collector.devices] if collector is not None else []
    assert got == uuids


def test_server_kit_switch() -> None:
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    default = server_config_from_args("engine", parser.parse_args([]))
    assert default.gpu_telemetry is None and default.exports_gpu_telemetry
    assert not server_config_from_args("router", parser.parse_args([])).exports_gpu_telemetry
    assert server_config_from_args("router", parser.parse_args(
        ["--gpu-telemetry"])).exports_gpu_telemetry
    assert not server_config_from_args("engine", parser.parse_args(
        ["--no-gpu-telemetry"])).exports_gpu_telemetry
    assert ServerConfig(name="cache").exports_gpu_telemetry is False
