"""Batch-invariant arithmetic: a token's numbers must not depend on its batch.

With in-flight batching a token is computed beside a varying set of other
tokens: alone in a decode step, inside a prefill chunk of any length, after a
prefix-cache hit, or again after a preemption. Greedy output is reproducible
only if every kernel gives a row bit-identical results whatever the other rows
(vLLM's batch-invariant mode; Thinking Machines, "Defeating Nondeterminism in
LLM Inference", 2025).

Measured on this project's CPU builds (PyTorch 2.13, fp32, AVX-512):

* Projections (:func:`linear`) on CPU in fp32 go through oneDNN (the op behind
  ``torch.utils.mkldnn.MkldnnLinear``, dense weights, no copy): every ``M >= 2``
  rows give each row the same result at any offset (checked up to 2,048 rows);
  only ``M = 1`` differs. It was also ~2x faster than MKL's ``F.linear`` from
  2 rows up and slightly faster at 1 row. Hence :func:`padded_linear_rows`:
  one row becomes two.
* MKL's ``matmul`` (the attention products): a row's result depends on ``M``
  only when ``M < 12`` and ``M`` is not a multiple of 4 (M = 1 takes a GEMV
  path; M = 2, 3, 5-7, 9-11 give the tail rows different kernels). Every ``M``
  that is a multiple of 4 or at least 12 agrees with every other, at any row
  offset. Hence :func:`padded_rows`: pad such ``M`` up to the next multiple of 4.
* The reduction over keys in ``probs @ V`` changes its blocking with the
  number of keys, so the product is taken in fixed chunks of
  :data:`KEY_CHUNK` keys and the chunks are summed in order (exactly zero for
  keys a query does not see). ``q @ K^T`` reduces over ``head_dim`` only and
  was invariant to the number of keys once ``M`` follows the rule above.
* Row-wise and element-wise kernels (RMSNorm, SiLU, RoPE, softmax over
  -inf-masked rows padded to a multiple of :data:`KEY_CHUNK`) were invariant.

:func:`probe` re-checks the matmul rules for given shapes on the machine at
hand; the engine logs its verdict at start, and the exactness tests check the
whole model end to end. Other devices and dtypes (CUDA/cuBLAS, bf16) are not
covered by these rules.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import torch
import torch.nn.functional as F

#: Rows below this count take M-dependent kernels unless a multiple of ROW_TILE.
MIN_FREE_ROWS = 12
#: Row multiple that keeps small matmuls on the M-independent kernel.
ROW_TILE = 4
#: Keys per chunk of the attention-weighted sum over values.
KEY_CHUNK = 32


Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Projection(Protocol):
    """A ready projection ``x [rows, in_features] -> [rows, out]`` (see ``quant.py``)."""

    input_dtype: torch.dtype
    in_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


def onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` through oneDNN (CPU, fp32; ``x`` contiguous ``[rows, in]``)."""
    return torch._C._nn.mkldnn_linear(x.to_mkldnn(), weight, None).to_dense()


def select_linear(device: torch.device, dtype: torch.dtype) -> Linear:
    """The projection kernel for ``device``/``dtype``: oneDNN on CPU in fp32 (where
    it is available), else ``F.linear``."""
    if device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available():
        return onednn_linear
    return F.linear


def padded_linear_rows(num_rows: int, linear: Linear = onednn_linear) -> int:
    """Rows to give ``linear`` for ``num_rows`` rows so each row's result does not
    depend on the count: 1 → 2 for oneDNN, :func:`padded_rows` for ``F.linear``."""
    if linear is onednn_linear:
        return 2 if num_rows == 1 else num_rows
    return padded_rows(num_rows)


_padded_linear_rows = padded_linear_rows


def padded_rows(num_rows: int) -> int:
    """Rows to give an MKL matmul of ``num_rows`` rows so each row's result does
    not depend on the count (see the module docstring)."""
    if num_rows >= MIN_FREE_ROWS or num_rows % ROW_TILE == 0:
        return num_rows
    return num_rows + ROW_TILE - num_rows % ROW_TILE


def probe(weight_shapes: Iterable[tuple[int, int]], head_dim: int = 64,
          max_rows: int = 40, device: str = "cpu",
          dtype: torch.dtype = torch.float32,
          projections: Iterable[tuple[str, Projection]] = (),
          padded_linear_rows: Callable[[int], int] | None = None) -> list[str]:
    """Checks the rules on this machine: for each ``(out, in)`` weight shape, the
    rows of ``linear(x[:m], W)`` (``m`` padded by :func:`padded_linear_rows`,
    offsets 0 and 1) against the same rows in a ``max_rows`` batch; likewise
    for each named ready ``projection`` (e.g. the model's quantized ones, with
    random inputs in its ``input_dtype``, rows padded by ``padded_linear_rows``,
    default none); and ``q @ K^T`` / chunked ``P @ V`` rows in ``dtype``
    against other row and key counts.

    Returns:
      one message per violated case (empty when the rules hold).
    """
    generator = torch.Generator(device=device).manual_seed(0)
    failures: list[str] = []

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=device, dtype=dtype)

    def check(name: str, apply: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
              pad: Callable[[int], int]) -> None:
        reference = apply(x)
        for rows in range(1, max_rows):
            for offset in (0, 1):
                padded = pad(rows)
                got = apply(x[offset:offset + padded])[:rows]
                if not torch.equal(got, reference[offset:offset + rows]):
                    failures.append(f"{name}: {rows} rows (padded to {padded}) "
                                    f"at offset {offset}")

    linear = select_linear(torch.device(device), dtype)
    for out_features, in_features in weight_shapes:
        weight = randn(out_features, in_features)
        check(f"linear {out_features}x{in_features}", lambda x: linear(x, weight),
              randn(max_rows + 1, in_features), lambda rows: _padded_linear_rows(rows, linear))
    for name, projection in projections:
        x = randn(max_rows + 1, projection.in_features).to(projection.input_dtype)
        check(name, projection, x, padded_linear_rows or (lambda rows: rows))
    q, k, v = randn(max_rows, head_dim), randn(4 * KEY_CHUNK, head_dim), randn(
        4 * KEY_CHUNK, head_dim)
    reference = q @ k[:KEY_CHUNK].T
    probs = torch.rand(max_rows, KEY_CHUNK, generator=generator, device=device, dtype=dtype)
    pv_reference = probs @ v[:KEY_CHUNK]
    for rows in range(1, max_rows):
        padded = padded_rows(rows)
        for num_keys in (KEY_CHUNK, 2 * KEY_CHUNK, 4 * KEY_CHUNK):
            scores = (q[:padded] @ k[:num_keys].T)[:rows, :KEY_CHUNK]
            if not torch.equal(scores, reference[:rows]):
                failures.append(f"q @ K^T: {rows} rows, {num_keys} keys")
        if not torch.equal((probs[:padded] @ v[:KEY_CHUNK])[:rows], pv_reference[:rows]):
            failures.append(f"P @ V: {rows} rows")
    return failures
