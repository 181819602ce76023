"""The CPU KV pool is zero-filled without writing it at start
(``paged_kv.lazy_zeros``): memory is taken where blocks are written, not for
the whole pool when the engine starts."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from services.engine.torch_backend.paged_kv import PagedKVCache


@dataclass(frozen=True)
class Shape:
    num_layers: int = 4
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64


def resident_bytes() -> int:
    """This process's resident memory now (``/proc/self/statm``)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_cpu_kv_pool_is_zero_and_resident_only_where_written() -> None:
    before = resident_bytes()
    cache = PagedKVCache(Shape(), num_blocks=4096, block_size=16)  # type: ignore[arg-type]
    assert cache.nbytes == 2 * 4 * 3 * 4096 * 16 * 64 * 4  # 384 MiB
    allocated = resident_bytes() - before
    assert allocated < cache.nbytes // 8, (allocated, cache.nbytes)
    assert not cache.k[:, :, :64].any() and not cache.v[:, :, -64:].any()  # zeros
    slots = torch.arange(16 * 7, 16 * 8)  # block 7
    keys = torch.randn(16, 3, 64)
    values = torch.randn(16, 3, 64)
    cache.write(2, slots, keys, values)
    assert torch.equal(cache.v[2, :, 7], values.transpose(0, 1))
    assert torch.equal(cache.k[2, :, 7], keys.transpose(0, 1))
    assert not cache.v[2, :, 6].any() and not cache.v[2, :, 8].any()
    assert resident_bytes() - before < cache.nbytes // 4
