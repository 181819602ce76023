"""The batch-invariant value sum is split into row tiles without changing a bit."""

from __future__ import annotations

import pytest
import torch

from services.engine.torch_backend.batch_invariant import KEY_CHUNK, MIN_FREE_ROWS
from services.engine.torch_backend.paged_kv import (
    VALUE_SUM_TILE_ROWS,
    _chunked_value_sum,
    _row_tiles,
)


@pytest.mark.parametrize("rows", [4, 12, 48, 49, 59, 60, 61, 303, 768])
def test_row_tiles_cover_every_row_once_and_split_tiles_are_never_small(rows: int) -> None:
    tiles = _row_tiles(rows)
    assert tiles[0][0] == 0 and tiles[-1][1] == rows
    assert all(a[1] == b[0] for a, b in zip(tiles, tiles[1:]))
    if len(tiles) > 1:
        assert all(MIN_FREE_ROWS <= end - start < VALUE_SUM_TILE_ROWS + MIN_FREE_ROWS
                   for start, end in tiles)


@pytest.mark.parametrize("rows", [60, 303, 768])
def test_tiled_value_sum_equals_each_rows_own_computation_bit_for_bit(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    keys = 5 * KEY_CHUNK
    probs = torch.softmax(torch.randn(3, 1, rows, keys, generator=gen), dim=-1)
    values = torch.randn(3, 1, keys, 64, generator=gen)
    tiled = _chunked_value_sum(probs, values)
    # Reference: the same chunked scan on one 48-row window at a time, taken from a
    # different offset so every row sits at another position in its matmul.
    for start in range(0, rows - VALUE_SUM_TILE_ROWS + 1, 37):
        window = _chunked_value_sum(probs[:, :, start:start + VALUE_SUM_TILE_ROWS], values)
        assert torch.equal(window, tiled[:, :, start:start + VALUE_SUM_TILE_ROWS])
    assert torch.allclose(tiled, probs @ values, atol=1e-5)
