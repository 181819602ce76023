"""Host memory that engines' KV caches take, checked against ``MemAvailable``.

Two things an engine fills from host memory at its own request: its KV cache
on the CPU (``--kv-cache-bytes``, default 1 GiB, zero-filled at start) and the
in-memory KV offload tier (``--kv-offload-bytes`` without ``--kv-offload-dir``;
host memory on CUDA too). Each engine refuses its own cache and tier above
``MemAvailable`` when it starts; :func:`check_engines_host_memory` refuses
their sum for several engines started at once (``llmesh up``), which each
pass alone while together they would push the host into swap or the OOM
killer. Like vLLM's refusal of a ``--gpu-memory-utilization`` that does not
fit, the message names the flags and the numbers. Model weights and
activations are not counted (the check is about what the flags ask for).

Torch-free: ``llmesh up`` imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from services.engine.config import EngineConfig


def available_host_memory_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes; None where it cannot be read."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass(frozen=True)
class HostKVBytes:
    """One engine's KV bytes in host memory.

    Attributes:
      kv_cache: its KV cache (torch backend on the CPU; 0 on CUDA, whose cache
        is GPU memory, and for tensorrt_llm).
      kv_offload: its in-memory offload tier (0: none, or disk-backed).
    """

    kv_cache: int
    kv_offload: int

    @property
    def total(self) -> int:
        return self.kv_cache + self.kv_offload


def host_kv_bytes(config: EngineConfig) -> HostKVBytes:
    """The host memory ``config``'s engine fills with KV (see :class:`HostKVBytes`)."""
    if config.backend != "torch":
        return HostKVBytes(0, 0)
    cache = config.kv_budget_bytes() if config.device == "cpu" else 0
    offload = (config.kv_offload_bytes or 0) if config.kv_offload_dir is None else 0
    return HostKVBytes(cache, offload)


def check_engines_host_memory(each: HostKVBytes, engines: int, available: int | None) -> None:
    """Refuses ``engines`` engines of ``each`` whose KV caches and in-memory
    tiers together exceed ``available`` bytes (None: unknown, nothing is refused).

    Raises:
      ValueError: one line naming the flags, one engine's bytes, the sum and
        what is available.
    """
    total = each.total * engines
    if available is None or total <= available:
        return
    flags = [f"--{flag} {n}" for flag, n in (("kv-cache-bytes", each.kv_cache),
                                             ("kv-offload-bytes", each.kv_offload)) if n]
    raise ValueError(
        f"{engines} engine(s) x ({' + '.join(flags)}) = {total} bytes ({_gib(total)}) of KV "
        f"cache in host memory exceed the {available} bytes ({_gib(available)}) available on "
        f"this host (MemAvailable); lower --kv-cache-bytes / --kv-offload-bytes, start fewer "
        f"--engines, or give --kv-offload-dir for a disk-backed tier")


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"
