"""services.engine.host_memory: the host memory engines fill with KV, and the
refusal of engines that fit one by one but not together."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.engine.config import GIB, EngineConfig
from services.engine.host_memory import (
    HostKVBytes,
    available_host_memory_bytes,
    check_engines_host_memory,
    host_kv_bytes,
)


@pytest.mark.parametrize(("config", "expected"), [
    (EngineConfig(), HostKVBytes(GIB, 0)),  # the CPU default: 1 GiB
    (EngineConfig(kv_cache_bytes=3 * GIB, kv_offload_bytes=5 * GIB), HostKVBytes(3 * GIB, 5 * GIB)),
    (EngineConfig(kv_offload_bytes=5 * GIB, kv_offload_dir=Path("/tmp")), HostKVBytes(GIB, 0)),
    (EngineConfig(device="cuda", kv_offload_bytes=5 * GIB), HostKVBytes(0, 5 * GIB)),
    (EngineConfig(backend="tensorrt_llm", kv_cache_bytes=3 * GIB), HostKVBytes(0, 0)),
])
def test_host_kv_bytes_counts_the_cpu_cache_and_the_in_memory_tier(
        config: EngineConfig, expected: HostKVBytes) -> None:
    assert host_kv_bytes(config) == expected


def test_engines_that_fit_alone_are_refused_together_naming_flags_and_numbers() -> None:
    each = HostKVBytes(GIB, 2 * GIB)
    check_engines_host_memory(each, 1, 4 * GIB)  # one fits
    check_engines_host_memory(each, 2, None)  # MemAvailable unknown: nothing refused
    with pytest.raises(ValueError) as refused:
        check_engines_host_memory(each, 2, 4 * GIB)
    assert str(refused.value) == (
        f"2 engine(s) x (--kv-cache-bytes {GIB} + --kv-offload-bytes {2 * GIB}) = {6 * GIB} "
        f"bytes (6.00 GiB) of KV cache in host memory exceed the {4 * GIB} bytes (4.00 GiB) "
        "available on this host (MemAvailable); lower --kv-cache-bytes / --kv-offload-bytes, "
        "start fewer --engines, or give --kv-offload-dir for a disk-backed tier")


def test_mem_available_is_read_from_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 16 kB\nMemAvailable:      8 kB\n")
    assert available_host_memory_bytes(meminfo) == 8192
    assert available_host_memory_bytes(tmp_path / "none") is None
