"""Weight-only quantized projections, on the engine's native integer-dot kernels
or PyTorch's own CPU kernels (``--quant-kernel``, :func:`resolve_quant_kernel`).

Modes (``--quantization``):

* ``none``: dense weights in the model's dtype (fp32: oneDNN, see
  :mod:`~services.engine.torch_backend.batch_invariant`).
* ``int4``: every projection on the GGUF's Q4_1 blocks as they are: natively
  :class:`NativeInt4Projection` (``kernels/int_matmul.c``: bf16 activations
  quantized to int16 per 32 inputs, exact integer dot products, fp16 ``d`` and
  ``m``), or :class:`Int4Projection` on ``torch.ops.aten._weight_int4pack_mm_for_cpu``
  (group size 32, a bf16 scale and zero per group and output row, bf16
  activations; :meth:`Int4Projection.from_q4_1`).
* ``int8``: every projection with int8 weights, one scale per output row,
  symmetric, requantized from the dequantized GGUF weights:
  :class:`NativeInt8Projection` or :class:`Int8Projection` on
  ``torch.ops.aten._weight_int8pack_mm`` (bf16 activations).

In both quantized modes the LM head (tied to the Q8_0 token embedding) is
:class:`Int8LMHead`: int8 per output row to rank the vocabulary (the largest
single read of a decode step, 49,152 x 576: 28 MB instead of 57 MB in bf16,
~3x faster at one row), then each row's top 64 logits recomputed in fp32 from
the dense table; the perplexity effect is measured in ``docs/engine.md``.

The Q4_1 → PyTorch int4 mapping. A Q4_1 block holds 32 values ``w = d * q + m``
with ``q`` in ``0..15`` (``gguf_loader.Q4_1Blocks``). PyTorch's int4 kernel computes a
weight as ``(q - 8) * scale + zero`` per group of 32 along the input dim
(``int4mm_kernel.cpp``; checked by ``tests/engine/test_quant.py``), so
``scale = d`` and ``zero = m + 8 * d`` give the same weight with the same
``q``. The kernel only takes scale/zero in the activation dtype, and it is
fast only for bf16 (fp16/fp32 activations take a ~50x slower path here), so
``d`` and ``m + 8 d`` are rounded from fp16 to bf16 (relative error <= 2^-9,
against the 4-bit step ``d`` itself): the values ``q`` are exact, the scales
are the nearest bf16.

Batch invariance (probed by ``batch_invariant.probe`` with ``quantization``):
every kernel here gives each row the same bits for any number of rows at any
offset (the native ones by construction; PyTorch's measured for 1..40 rows
with ``ONEDNN_MAX_CPU_ISA`` at AVX512_CORE_BF16, AVX512_CORE_VNNI and AVX2),
so quantized projections need no row padding. Dense prompt projections take
the kernel ``batch_invariant.select_prompt_kernel`` finds invariant here.
"""

from __future__ import annotations

from typing import Protocol

import torch

from services.engine.torch_backend import native
from services.engine.torch_backend.batch_invariant import Linear
from services.engine.torch_backend.gguf_loader import Q4_1_BLOCK, Q4_1Blocks
from services.engine.torch_backend.start_checks import QUANT_KERNELS, check_quantization

#: Activation dtype of the quantized kernels.
ACTIVATION_DTYPE = torch.bfloat16
#: Values per scale/zero group of the int4 kernel.
INT4_GROUP = Q4_1_BLOCK
#: ``inner_k_tiles`` argument of ``_convert_weight_to_int4pack_for_cpu``.
INT4_INNER_K_TILES = 2
# The kernels' overloads, looked up once (``torch.ops.aten.x`` resolves two
# namespaces and an overload on every call: ~2 us each, 121 calls a step).
_INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default
_INT8_MM = torch.ops.aten._weight_int8pack_mm.default


class Projection(Protocol):
    """``y = x @ W.T`` for ``x`` ``[rows, in_features]`` in :attr:`input_dtype`."""

    input_dtype: torch.dtype
    in_features: int
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    @property
    def nbytes(self) -> int:
        """Bytes read from memory by one call (weights, scales, zeros)."""
        ...


class DenseProjection:
    """A dense ``[out, in]`` weight applied by ``kernel`` (``F.linear`` or oneDNN)
    to inputs in ``input_dtype`` (default the weight's; a prompt projection's
    fp32 weight takes bf16 inputs, see ``batch_invariant.PromptKernel``).

    Holds the weight tensor itself (a model Parameter), so moving the model
    with ``.to()`` keeps it bound.
    """

    def __init__(self, weight: torch.Tensor, kernel: Linear,
                 input_dtype: torch.dtype | None = None) -> None:
        self.weight = weight
        self.kernel = kernel
        self.input_dtype = input_dtype or weight.dtype
        self.out_features, self.in_features = (int(n) for n in weight.shape)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes


class Int4Projection:
    """Group-wise int4 weights on ``_weight_int4pack_mm_for_cpu``; bf16 in, bf16 out.

    Attributes:
      packed: ``[out, in / 2]`` uint8, the kernel's packed layout.
      scales_and_zeros: ``[in / 32, out, 2]`` bf16; weight ``(q - 8) * scale + zero``.
    """

    input_dtype = ACTIVATION_DTYPE

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor) -> None:
        self.packed = packed
        self.scales_and_zeros = scales_and_zeros
        self.out_features = int(scales_and_zeros.shape[1])
        self.in_features = int(scales_and_zeros.shape[0]) * INT4_GROUP

    @classmethod
    def from_values(cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
                    ) -> Int4Projection:
        """Packs ``q`` ``[out, in]`` (integers 0..15) with per-group ``scale`` and
        ``zero`` ``[out, in / 32]`` (weight ``(q - 8) * scale + zero``)."""
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q.to(torch.int32).contiguous(), INT4_INNER_K_TILES)
        scales_and_zeros = torch.stack((scale.t(), zero.t()), dim=-1).to(ACTIVATION_DTYPE)
        return cls(packed, scales_and_zeros.contiguous())

    @classmethod
    def from_q4_1(cls, blocks: Q4_1Blocks) -> Int4Projection:
        """The GGUF's Q4_1 blocks as they are: same ``q``, ``scale = d``,
        ``zero = m + 8 d`` (computed in fp32, then rounded to bf16)."""
        d, m = blocks.d.float(), blocks.m.float()
        return cls.from_values(blocks.q, d, m + 8 * d)

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> Int4Projection:
        """Round-to-nearest asymmetric int4 per group of 32 (min/max), for dense
        weights (a GGUF whose projections are not Q4_1)."""
        rows, cols = weight.shape
        groups = weight.float().view(rows, cols // INT4_GROUP, INT4_GROUP)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / 15).clamp(min=1e-8)
        q = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15)
        return cls.from_values(q.view(rows, cols), scale, low + 8 * scale)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _INT4_MM(x, self.packed, INT4_GROUP, self.scales_and_zeros)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_and_zeros.nbytes

    def unpack_values(self) -> torch.Tensor:
        """The stored ``q`` ``[out, in]`` (int32, 0..15), read back through the
        kernel itself: an identity input with scale 1 and zero 8 yields
        ``(q - 8) * 1 + 8 = q`` exactly."""
        eye = torch.eye(self.in_features, dtype=ACTIVATION_DTYPE)
        unit = torch.empty_like(self.scales_and_zeros)
        unit[..., 0], unit[..., 1] = 1, 8
        values = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, INT4_GROUP, unit)
        return values.t().to(torch.int32)

    def dequantize(self) -> torch.Tensor:
        """The weight ``[out, in]`` in fp32 as the kernel sees it."""
        q = self.unpack_values().float().view(self.out_features, -1, INT4_GROUP)
        scale, zero = self.scales_and_zeros.float().permute(2, 1, 0)
        return ((q - 8) * scale[..., None] + zero[..., None]).view(self.out_features, -1)


def pack_q4_1(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Q4_1 values in the native kernel's layout (``kernels/int_matmul.c``).

    Args:
      q: ``[out, in]`` integers 0..15 (``in`` a multiple of 32).
      d, m: ``[out, in / 32]`` float16 scale and minimum (weight ``d * q + m``).

    Returns:
      ``[ceil(out / 16), in / 32, 320]`` uint8: per tile of 16 output features
      and block of 32 inputs, the 16 ``d``, the 16 ``m`` and 4 chunks of 64
      bytes. Pair group ``g`` (inputs ``2g``, ``2g + 1``) is 32 values, value
      ``2j + t`` = ``q[j, 2g + t]``; chunk ``c`` holds groups ``4c`` / ``4c + 2``
      in the low / high nibbles of its first 32 bytes and ``4c + 1`` / ``4c + 3``
      in its last 32. Features past ``out`` are zero.
    """
    rows, cols = q.shape
    tiles, blocks = -(-rows // native.Q4_TILE), cols // INT4_GROUP
    pad = tiles * native.Q4_TILE - rows

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.cat((t, t.new_zeros(pad, t.shape[1]))) if pad else t

    # A pair (inputs 2g, 2g + 1 of one feature) moves as one int16: half the
    # elements to transpose, and no byte of one nibble shifts into the next
    # (values are 0..15, so each byte of ``x << 4`` stays within its byte).
    pairs = padded(q.to(torch.uint8)).contiguous().view(torch.int16)
    groups = pairs.view(tiles, native.Q4_TILE, blocks, 16).permute(0, 2, 3, 1)
    groups = groups.reshape(tiles, blocks, 4, 4, native.Q4_TILE)  # [.., c, k, 16 pairs]
    # chunk c: groups 4c, 4c + 1 in the low nibbles, 4c + 2, 4c + 3 in the high ones
    nibbles = (groups[:, :, :, 0:2] | (groups[:, :, :, 2:4] << 4))
    nibbles = nibbles.reshape(tiles, blocks, -1).view(torch.uint8)

    def halves(t: torch.Tensor) -> torch.Tensor:
        t = padded(t.to(torch.float16)).view(tiles, native.Q4_TILE, blocks)
        return t.permute(0, 2, 1).contiguous().view(torch.uint8)

    return torch.cat((halves(d), halves(m), nibbles), dim=-1)


class NativeInt4Projection:
    """Q4_1 weights on the native integer-dot kernel (:func:`native.q4_1_matmul`):
    each row of bf16 activations quantized to int16 per 32 inputs, exact integer
    sums (AVX512-VNNI or AVX2), fp16 ``d`` and ``m`` as the GGUF stores them. bf16 in,
    bf16 out. Row-invariant by construction, and its cost stays nearly flat from
    1 to ~8 rows (``_weight_int4pack_mm_for_cpu`` works in blocks of 4 rows and
    costs 2.5x at 5), which is what a speculative verify step needs.

    Attributes:
      packed: ``[ceil(out / 16), in / 32, 320]`` uint8 (:func:`pack_q4_1`).
    """

    input_dtype = ACTIVATION_DTYPE

    def __init__(self, packed: torch.Tensor, out_features: int) -> None:
        self.packed = packed
        self.out_features = out_features
        self.in_features = int(packed.shape[1]) * INT4_GROUP
        self._matmul = native.IntMatmul(packed, out_features, ACTIVATION_DTYPE)

    @classmethod
    def from_q4_1(cls, blocks: Q4_1Blocks) -> NativeInt4Projection:
        """The GGUF's Q4_1 blocks exactly (same ``q``, fp16 ``d`` and ``m``)."""
        return cls(pack_q4_1(blocks.q, blocks.d, blocks.m), blocks.shape[0])

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> NativeInt4Projection:
        """Round-to-nearest asymmetric int4 per group of 32 (min/max) with fp16
        ``d`` and ``m``, for dense weights (a GGUF whose projections are not Q4_1)."""
        rows, cols = weight.shape
        groups = weight.float().view(rows, cols // INT4_GROUP, INT4_GROUP)
        low = groups.amin(-1).half()
        d = ((groups.amax(-1) - low.float()) / 15).clamp(min=1e-7).half()
        q = ((groups - low.float()[..., None]) / d.float()[..., None]).round().clamp(0, 15)
        return cls(pack_q4_1(q.view(rows, cols), d, low), rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q`` ``[out, in]`` (uint8), ``d`` and ``m`` ``[out, in / 32]`` (fp16)."""
        tiles, blocks, _ = self.packed.shape
        d = self.packed[..., :32].contiguous().view(torch.float16)  # [tiles, blocks, 16]
        m = self.packed[..., 32:64].contiguous().view(torch.float16)
        nibbles = self.packed[..., 64:].reshape(tiles, blocks, 4, 64)
        low, high = nibbles & 0x0F, nibbles >> 4
        groups = torch.stack((low[..., :32], low[..., 32:], high[..., :32], high[..., 32:]),
                             dim=3)  # [tiles, blocks, c, k, 32]: group 4c + k
        q = groups.reshape(tiles, blocks, 16, native.Q4_TILE, 2).permute(0, 3, 1, 2, 4)
        q = q.reshape(tiles * native.Q4_TILE, -1)

        def rows(t: torch.Tensor) -> torch.Tensor:
            return t.permute(0, 2, 1).reshape(tiles * native.Q4_TILE, blocks).contiguous()

        return (q[:self.out_features], rows(d)[:self.out_features],
                rows(m)[:self.out_features])

    def dequantize(self) -> torch.Tensor:
        """The weight ``[out, in]`` in fp32 (``d * q + m``)."""
        q, d, m = self.unpack()
        q = q.float().view(self.out_features, -1, INT4_GROUP)
        return (d.float()[..., None] * q + m.float()[..., None]).view(self.out_features, -1)


class Int8Projection:
    """Per-output-row symmetric int8 weights on ``_weight_int8pack_mm``; bf16 in/out.

    Attributes:
      weight: ``[out, in]`` int8.
      scales: ``[out]`` bf16; weight ``q * scale``.
    """

    input_dtype = ACTIVATION_DTYPE

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor) -> None:
        self.weight = weight
        self.scales = scales
        self.out_features, self.in_features = (int(n) for n in weight.shape)

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> Int8Projection:
        """Round-to-nearest with ``scale = max |w| / 127`` per row (rounded to bf16
        first, so the int8 values are fitted to the scale actually used)."""
        weight = weight.float()
        scales = (weight.abs().amax(dim=1) / 127).clamp(min=1e-8).to(ACTIVATION_DTYPE)
        q = (weight / scales.float()[:, None]).round().clamp(-128, 127).to(torch.int8)
        return cls(q.contiguous(), scales)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _INT8_MM(x, self.weight, self.scales)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scales.nbytes

    def dequantize(self) -> torch.Tensor:
        """The weight ``[out, in]`` in fp32 as the kernel sees it."""
        return self.weight.float() * self.scales.float()[:, None]


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """int8 values ``[out, in]`` (``in`` a multiple of 32) in the native kernel's
    layout (``kernels/int_matmul.c``): ``[ceil(out / 16), in / 32, 512]`` uint8
    (the int8 bytes), per tile of 16 output features and block of 32 inputs byte
    ``32 g + 2 j + t`` = ``q[j, 2g + t]``. Features past ``out`` are zero."""
    rows, cols = q.shape
    tiles, blocks = -(-rows // native.Q4_TILE), cols // INT4_GROUP
    values = q.to(torch.int8)
    if tiles * native.Q4_TILE > rows:
        values = torch.cat((values, values.new_zeros(tiles * native.Q4_TILE - rows, cols)))
    values = values.view(tiles, native.Q4_TILE, blocks, 16, 2).permute(0, 2, 3, 1, 4)
    return values.reshape(tiles, blocks, -1).contiguous().view(torch.uint8)


class NativeInt8Projection:
    """Per-output-row int8 weights (as :class:`Int8Projection`) on the native
    integer-dot kernel (:func:`native.q8_matmul`): activations quantized to int16
    per row and 32 inputs, exact integer sums. Row-invariant by construction.

    Attributes:
      packed: ``[ceil(out / 16), in / 32, 512]`` uint8 (:func:`pack_int8`).
      scales: ``[out]`` fp32; weight ``q * scale``.
      out_dtype: the output dtype (bf16 for the projections, fp32 for ranking
        the LM head's logits).
    """

    input_dtype = ACTIVATION_DTYPE

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor,
                 out_dtype: torch.dtype = ACTIVATION_DTYPE) -> None:
        self.packed = packed
        self.scales = scales
        self.out_dtype = out_dtype
        self.out_features = int(scales.shape[0])
        self.in_features = int(packed.shape[1]) * INT4_GROUP
        self._matmul = native.IntMatmul(packed, self.out_features, out_dtype, scales)

    @classmethod
    def from_dense(cls, weight: torch.Tensor, out_dtype: torch.dtype = ACTIVATION_DTYPE
                   ) -> NativeInt8Projection:
        """The same int8 values and scales as :meth:`Int8Projection.from_dense`."""
        quantized = Int8Projection.from_dense(weight)
        return cls(pack_int8(quantized.weight), quantized.scales.float(), out_dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales.nbytes

    def dequantize(self) -> torch.Tensor:
        """The weight ``[out, in]`` in fp32 as the kernel sees it."""
        tiles, blocks, _ = self.packed.shape
        values = self.packed.view(torch.int8).view(tiles, blocks, 16, native.Q4_TILE, 2)
        q = values.permute(0, 3, 1, 2, 4).reshape(tiles * native.Q4_TILE, -1)
        return q[:self.out_features].float() * self.scales[:, None]


class Int8LMHead:
    """The LM head: int8 per row to find each row's best candidates, the dense
    fp32 weights to compute them. fp32 in, fp32 out.

    Int8 logits are coarse (PyTorch's int8 kernel returns bf16, 0.125 apart
    between 16 and 32, where SmolLM2's top logits lie; the native kernel also
    quantizes the activations to int16), and the int8 weights move logits by a
    few hundredths. Both flipped real choices on the quality guard's chat
    prompts (an answer's first token at fp32 probabilities 0.080 / 0.077). So
    the kernel's logits only pick each row's :data:`REFINED_LOGITS` largest, and
    those are recomputed in fp32 from the fp32 input and the dense fp32 weights
    (for SmolLM2 the Q8_0 embedding table, which the model keeps anyway): the
    top logits are the fp32 model's, the tail keeps the int8 kernel's values.
    Reading 64 rows adds 147 KB a row to the 28 MB int8 read. Every step is
    row-wise (top-k, gather, multiply, a sum over ``in_features``), so rows stay
    batch-invariant (``batch_invariant.probe`` checks it with the model's head).

    Attributes:
      ranking: the int8 projection (:class:`Int8Projection` or
        :class:`NativeInt8Projection`) whose logits pick the candidates.
      dense: ``[out, in]`` fp32 weights (shared, not copied).
    """

    input_dtype = torch.float32

    def __init__(self, ranking: Int8Projection | NativeInt8Projection,
                 dense: torch.Tensor) -> None:
        self.ranking = ranking
        self.dense = dense
        self.out_features, self.in_features = ranking.out_features, ranking.in_features

    @classmethod
    def from_dense(cls, weight: torch.Tensor, kernel: str = "torch") -> Int8LMHead:
        """Per-row int8 of ``weight`` on ``kernel`` (``torch`` or ``native``)."""
        ranking = (NativeInt8Projection.from_dense(weight, torch.float32) if kernel == "native"
                   else Int8Projection.from_dense(weight))
        return cls(ranking, weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.ranking(x.to(self.ranking.input_dtype)).float()
        top = logits.topk(REFINED_LOGITS, dim=-1, sorted=False).indices  # [rows, k]
        exact = (self.dense[top] * x[:, None, :]).sum(-1)  # [rows, k, in] -> [rows, k]
        return logits.scatter_(1, top, exact)

    @property
    def nbytes(self) -> int:
        return self.ranking.nbytes + REFINED_LOGITS * self.in_features * self.dense.element_size()


#: Logits per row the int8 LM head recomputes in fp32 (:class:`Int8LMHead`).
REFINED_LOGITS = 64


def resolve_quant_kernel(choice: str) -> str:
    """``native`` or ``torch`` for the ``--quant-kernel`` ``choice``.

    Raises:
      ValueError: an unknown choice, or ``native`` where the kernels cannot be
        built or loaded (the message says why).
    """
    if choice not in QUANT_KERNELS:
        raise ValueError(f"quant kernel must be one of {QUANT_KERNELS}, got {choice!r}")
    if choice == "torch":
        return choice
    try:
        native.load_library()
    except native.NativeKernelUnavailable as exc:
        if choice == "native":
            raise ValueError(f"--quant-kernel native: {exc}; use --quant-kernel torch") from exc
        return "torch"
    return "native"


def quantize_projection(mode: str, dense: torch.Tensor | None,
                        blocks: Q4_1Blocks | None = None, quant_kernel: str = "torch"
                        ) -> Projection:
    """The projection for ``mode`` (``int4`` or ``int8``) from Q4_1 ``blocks``
    (used as they are for int4) or from the fp32 ``dense`` weight; int4 on
    ``quant_kernel`` (``native`` or ``torch``, see :func:`resolve_quant_kernel`).

    Raises:
      ValueError: an unknown mode, or neither source given.
    """
    if blocks is None and dense is None:
        raise ValueError("no weight given")
    if mode == "int4":
        kind = NativeInt4Projection if quant_kernel == "native" else Int4Projection
        return kind.from_q4_1(blocks) if blocks is not None else (
            kind.from_dense(dense))  # type: ignore[arg-type]
    if mode == "int8":
        kind8 = NativeInt8Projection if quant_kernel == "native" else Int8Projection
        return kind8.from_dense(blocks.dequantize() if blocks is not None else dense)
    raise ValueError(f"quantization must be int4 or int8 here, got {mode!r}")


def check_mode(quantization: str, dtype: torch.dtype, device: torch.device) -> None:
    """:func:`~services.engine.torch_backend.start_checks.check_quantization` of
    a model's torch ``dtype`` and ``device`` (ValueError: they contradict)."""
    check_quantization(quantization, str(dtype).removeprefix("torch."), str(device))
