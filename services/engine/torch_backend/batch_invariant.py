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

* Dense bf16 prompt projections (``--dense-prefill``) depend on the CPU, since
  oneDNN picks its bf16 kernel by ISA (PyTorch 2.13, oneDNN 3.12, forced with
  ``ONEDNN_MAX_CPU_ISA`` on a Zen 4): with avx512_bf16 (``AVX512_CORE_BF16``) it
  takes ``brg_matmul``, row-invariant from 2 rows; on AVX-512 without bf16
  (``AVX512_CORE``, ``AVX512_CORE_VNNI``: Intel Skylake-SP, Cascade Lake,
  Ice Lake) ``gemm:jit:bf16``, whose rows depend on ``M``
  and their offset (a 3072x576 weight: 50 of 78 cases of 1-39 rows at
  offsets 0 and 1); with AVX2 only, oneDNN has no bf16 and PyTorch's own
  reference GEMM runs (row-invariant, but 3-10x slower than fp32 oneDNN).
  Hence :func:`select_prompt_kernel`: bf16 ``F.linear`` where oneDNN takes
  bf16 and a probe of the model's own weights finds it row-invariant, else
  :data:`FP32_PROMPT` (the same bf16-rounded weights widened to fp32, through
  the fp32 oneDNN kernel above, which was row-invariant on every forced ISA).

:func:`probe` re-checks the matmul rules for given shapes on the machine at
hand; the engine logs its verdict at start, and the exactness tests check the
whole model end to end. Other devices and dtypes (CUDA/cuBLAS, bf16) are not
covered by these rules.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
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


def widened_onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for bf16 ``x`` ``[rows, in]`` and an fp32 ``weight``
    ``[out, in]`` (holding bf16 values, so every product is exact) through the
    fp32 oneDNN kernel, rounded to bf16 ``[rows, out]``; rows must be >= 2 to
    be row-invariant (:func:`prompt_rows`)."""
    return onednn_linear(x.float(), weight).to(torch.bfloat16)


@dataclass(frozen=True)
class PromptKernel:
    """How the dense prompt projections of a quantized model are applied
    (``LlamaModel.add_prompt_projections``): bf16 activations in, bf16 out,
    weights stored in :attr:`weight_dtype` (their values are bf16 either way),
    one prompt row computed as two.

    Attributes:
      name: ``bf16`` or ``fp32`` (logged at engine start).
      weight_dtype: dtype of the stored weights (2 or 4 bytes per weight).
      linear: ``linear(x, weight)``.
    """

    name: str
    weight_dtype: torch.dtype
    linear: Linear


#: bf16 ``F.linear``: oneDNN's bf16 GEMM (fast where the CPU has avx512_bf16 or AMX).
BF16_PROMPT = PromptKernel("bf16", torch.bfloat16, F.linear)
#: fp32 oneDNN on the bf16 weights widened to fp32 (:func:`widened_onednn_linear`).
FP32_PROMPT = PromptKernel("fp32", torch.float32, widened_onednn_linear)


def prompt_rows(num_rows: int) -> int:
    """Rows to give a :class:`PromptKernel` for ``num_rows`` rows: one row is
    computed as two (both kernels take an M-dependent path at one row)."""
    return max(num_rows, 2)


def select_prompt_kernel(weights: Sequence[torch.Tensor]) -> PromptKernel:
    """The prompt kernel for this CPU (see the module docstring): :data:`BF16_PROMPT`
    where oneDNN computes bf16 (``torch.ops.mkldnn._is_mkldnn_bf16_supported``:
    AVX-512 or newer, or as ``ONEDNN_MAX_CPU_ISA`` allows) and :func:`probe_rows`
    finds every row of each of ``weights`` (bf16 ``[out, in]``, e.g. one layer's
    projections) independent of the row count; else :data:`FP32_PROMPT`, or
    :data:`BF16_PROMPT` where oneDNN is not built in (non-x86 builds: not
    covered by these rules, the engine's probe reports)."""
    if not torch.backends.mkldnn.is_available():
        return BF16_PROMPT
    if not _onednn_takes_bf16():
        return FP32_PROMPT  # PyTorch's reference bf16 GEMM: invariant, but slow
    for weight in weights:
        if probe_rows("bf16 prompt", lambda x, w=weight: F.linear(x, w),
                      weight.shape[1], torch.bfloat16, prompt_rows, stop_at_first=True):
            return FP32_PROMPT
    return BF16_PROMPT


def _onednn_takes_bf16() -> bool:
    """Whether PyTorch hands bf16 matmuls to oneDNN here (False with AVX2 only,
    or as ``ONEDNN_MAX_CPU_ISA`` caps it); True where PyTorch cannot say."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return True


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


def probe_rows(name: str, apply: Callable[[torch.Tensor], torch.Tensor], in_features: int,
               dtype: torch.dtype, padded: Callable[[int], int], max_rows: int = 40,
               device: str = "cpu", stop_at_first: bool = False) -> list[str]:
    """Checks that ``apply`` (``[rows, in_features]`` -> ``[rows, out]``) gives
    each row the same bits whatever the row count: the rows of
    ``apply(x[offset:offset + padded(m)])[:m]`` for ``m`` in ``1..max_rows - 1``
    and offsets 0 and 1 against the same rows of ``apply(x)``, ``x`` random
    ``[max_rows + 1, in_features]`` in ``dtype`` (seeded, the same every call).

    Returns:
      one message per violated case (only the first with ``stop_at_first``;
      empty when every row agrees).
    """
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(max_rows + 1, in_features, generator=generator, device=device).to(dtype)
    reference = apply(x)
    failures: list[str] = []
    for rows in range(1, max_rows):
        for offset in (0, 1):
            count = padded(rows)
            got = apply(x[offset:offset + count])[:rows]
            if not torch.equal(got, reference[offset:offset + rows]):
                failures.append(f"{name}: {rows} rows (padded to {count}) at offset {offset}")
                if stop_at_first:
                    return failures
    return failures


def probe(weight_shapes: Iterable[tuple[int, int]], head_dim: int = 64,
          max_rows: int = 40, device: str = "cpu",
          dtype: torch.dtype = torch.float32,
          projections: Iterable[tuple[str, Projection]] = (),
          padded_linear_rows: Callable[[int], int] | None = None) -> list[str]:
    """Checks the rules on this machine (:func:`probe_rows`): for each ``(out, in)``
    weight shape, ``linear(x, W)`` (rows padded by :func:`padded_linear_rows`);
    likewise each named ready ``projection`` (e.g. the model's quantized ones,
    with inputs in its ``input_dtype``, rows padded by ``padded_linear_rows``,
    default none); and ``q @ K^T`` / chunked ``P @ V`` rows in ``dtype``
    against other row and key counts.

    Returns:
      one message per violated case (empty when the rules hold).
    """
    generator = torch.Generator(device=device).manual_seed(0)
    failures: list[str] = []

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=device, dtype=dtype)

    linear = select_linear(torch.device(device), dtype)
    for out_features, in_features in weight_shapes:
        weight = randn(out_features, in_features)
        failures += probe_rows(f"linear {out_features}x{in_features}",
                               lambda x, w=weight: linear(x, w), in_features, dtype,
                               lambda rows: _padded_linear_rows(rows, linear), max_rows, device)
    for name, projection in projections:
        failures += probe_rows(name, projection, projection.in_features, projection.input_dtype,
                               padded_linear_rows or (lambda rows: rows), max_rows, device)
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
