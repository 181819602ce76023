"""The native integer-dot kernels (``kernels/int_matmul.c``: Q4_1 or int8 weights
times activations quantized to int16 per row and 32 inputs) and their Python
side (``native.q4_1_matmul`` / ``q8_matmul``, ``quant.pack_q4_1`` /
``pack_int8`` and the projections): the packed layouts hold the weights
exactly, the kernels compute what the quantization says (against a float64
emulation of it) and stay close to the dense matmul, every row is independent
of the others in the call, edge cases and bad arguments, the LM head, and the
``--quant-kernel`` choice. The bit-exact comparison with a scalar C reference
on random shapes is in ``kernels/kernel_harness.c`` (``intmm``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.torch_backend import native
from services.engine.torch_backend.backend import check_config
from services.engine.torch_backend.gguf_loader import GGUFModel, Q4_1Blocks
from services.engine.torch_backend.model_runner import ModelRunner
from services.engine.torch_backend.native import load_library
from services.engine.torch_backend.quant import (
    QUANT_KERNELS,
    REFINED_LOGITS,
    Int4Projection,
    Int8LMHead,
    Int8Projection,
    NativeInt4Projection,
    NativeInt8Projection,
    pack_int8,
    pack_q4_1,
    quantize_projection,
    resolve_quant_kernel,
)

BF16_EPS = 2.0 ** -8  # bf16 keeps 8 significant bits: rounding error <= 2^-8 relative
#: The kernels' activation grid: int16 values in [-QMAX, QMAX], d = block max / QMAX.
QMAX = 32767.0
#: The smallest block maximum the kernels quantize (``MIN_AMAX``, 1e-30f in
#: ``int_matmul.c``): a block whose largest |x| is below it counts as zeros.
MIN_AMAX = float(torch.tensor(1e-30, dtype=torch.float32))
FLT_MAX = float(torch.finfo(torch.float32).max)
#: The kernels' fp32 rounding against a float64 evaluation of the same
#: quantized sums, as a fraction of the sum of the terms' magnitudes: at most
#: ~2 roundings of 2^-24 per block (the product of the scales, the FMAs, int8's
#: int-to-float conversion and final scale), 37 * 2^-24 ~ 2.2e-6 for 18 blocks;
#: measured 1.3e-7.
FP32_TOLERANCE = 3e-6
#: (out_features, in_features) of the layout tests: partial tiles (40, 17, 1), a
#: whole one (16), one block to SmolLM2's hidden size (576 inputs).
SHAPES = [(40, 32), (17, 64), (16, 576), (40, 576), (1, 32), (33, 96)]
KERNELS = ["q4_1", "q8"]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", autouse=True)
def library() -> None:
    load_library()  # a build failure fails the module, it does not skip it


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_blocks(out_features: int, in_features: int, seed: int = 0) -> Q4_1Blocks:
    """Q4_1 blocks as a GGUF holds them: fp16 d > 0, m about -8 d (values centred
    on 0), q uniform in 0..15."""
    gen = generator(seed)
    blocks = in_features // 32
    q = torch.randint(0, 16, (out_features, in_features), generator=gen, dtype=torch.uint8)
    d = (torch.rand(out_features, blocks, generator=gen) * 0.02 + 0.001).half()
    m = (-d.float() * (torch.rand(out_features, blocks, generator=gen) * 4 + 6)).half()
    return Q4_1Blocks(d, m, q)


def activations(rows: int, in_features: int, seed: int = 1,
                dtype: torch.dtype = torch.float32, outlier: bool = True) -> torch.Tensor:
    """Gaussian rows at scales 1e-2..1e2 (row by row), with an outlier column as
    real activations have (``outlier``), in ``dtype``."""
    gen = generator(seed)
    x = torch.randn(rows, in_features, generator=gen)
    x *= 10.0 ** (torch.arange(rows) % 5 - 2).float()[:, None]
    if outlier:
        x[:, 3] *= 20
    return x.to(dtype)


def fp32(t: torch.Tensor) -> torch.Tensor:
    """``t`` (float64) rounded to the nearest fp32, back in float64."""
    return t.float().double()


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels' activation quantization, bit for bit: per row and block of
    32 (x widened to fp32), ``d = max|x| / 32767`` (0 below :data:`MIN_AMAX`,
    NaN if the block holds a NaN or an infinity), ``qa = round_half_even(x *
    (1 / d))`` clamped to ``[-32767, 32767]`` (int16), ``sa = d * sum(qa)``.
    Each fp32 operation is done in float64 and rounded once to fp32: exact for
    the products, and correctly rounded for the two divisions too (float64 has
    more than 2 * 24 + 2 bits, so the double rounding is innocuous).

    Returns:
      ``qa`` ``[rows, in / 32, 32]``, ``d`` and ``sa`` ``[rows, in / 32]``, all
      float64 holding the kernel's fp32 / int16 values.
    """
    values = x.float().double().view(x.shape[0], -1, 32)
    amax = values.abs().amax(-1)
    finite = (values.abs() <= FLT_MAX).all(-1)
    d = torch.where(amax < MIN_AMAX, torch.zeros_like(amax), fp32(amax / QMAX))
    d = torch.where(finite, d, torch.full_like(d, float("nan")))
    inverse = torch.where(finite & (d != 0), fp32(1.0 / d), torch.zeros_like(d))
    qa = torch.round(fp32(values * inverse[..., None])).clamp(-QMAX, QMAX)
    return qa, d, fp32(d * qa.sum(-1))


def reference_q4_1(x: torch.Tensor, blocks: Q4_1Blocks) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``sum_b d da isum_b + m sa_b`` for the quantized ``x``, and the same
    sum of absolute terms (the scale of the kernel's fp32 rounding)."""
    qa, da, sa = quantize_activations(x)
    out = blocks.q.shape[0]
    q = blocks.q.double().view(out, -1, 32)
    isum = torch.einsum("obi,rbi->rob", q, qa)  # [rows, out, blocks]
    weighted = isum * (blocks.d.double()[None] * da[:, None])
    offset = blocks.m.double()[None] * sa[:, None]
    return (weighted + offset).sum(-1), (weighted.abs() + offset.abs()).sum(-1)


def reference_q8(x: torch.Tensor, projection: NativeInt8Projection
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`reference_q4_1` for int8 weights: ``scale * sum_b da isum_b``
    (the signed int8 values times the int16 activations, no offset)."""
    qa, da, _ = quantize_activations(x)
    qw = (projection.dequantize().double() / projection.scales.double()[:, None]).round()
    isum = torch.einsum("obi,rbi->rob", qw.view(qw.shape[0], -1, 32), qa)
    terms = isum * da[:, None] * projection.scales.double()[None, :, None]
    return terms.sum(-1), terms.abs().sum(-1)


def int8_projection(out_features: int, in_features: int, seed: int = 2,
                    out_dtype: torch.dtype = torch.float32) -> NativeInt8Projection:
    weight = torch.randn(out_features, in_features, generator=generator(seed))
    return NativeInt8Projection.from_dense(weight, out_dtype)


def kernel_call(kernel: str, out_features: int, in_features: int, out_dtype: torch.dtype
                ) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> x @ W.T`` on ``kernel`` for a fixed random W."""
    if kernel == "q4_1":
        packed = NativeInt4Projection.from_q4_1(random_blocks(out_features, in_features)).packed
        return lambda x: native.q4_1_matmul(x, packed, out_features, out_dtype)
    projection = int8_projection(out_features, in_features, out_dtype=out_dtype)
    return lambda x: native.q8_matmul(x, projection.packed, projection.scales, out_dtype)


# ------------------------------------------------------------------ packed layouts


@pytest.mark.parametrize(("out_features", "in_features"), [
    shape
    for shape in SHAPES])
def test_q4_1_packing_round_trips_the_blocks(out_features: int, in_features: int) -> None:
    """``pack_q4_1`` then ``unpack`` gives back q, d and m exactly (out_features not
    a multiple of the 16-feature tile included), ``dequantize`` is bit for bit
    ``Q4_1Blocks.dequantize`` (gguf's values), and the tile's padding features
    are zero."""
    blocks = random_blocks(out_features, in_features, seed=out_features + in_features)
    projection = NativeInt4Projection.from_q4_1(blocks)
    tiles = -(-out_features // native.Q4_TILE)
    assert projection.packed.shape == (tiles, in_features // 32, native.Q4_RECORD)
    assert projection.packed.dtype == torch.uint8 and projection.packed.is_contiguous()
    assert (projection.out_features, projection.in_features) == (out_features, in_features)
    q, d, m = projection.unpack()
    assert q.dtype == torch.uint8 and d.dtype == m.dtype == torch.float16
    assert torch.equal(q, blocks.q) and torch.equal(d, blocks.d) and torch.equal(m, blocks.m)
    assert torch.equal(projection.dequantize(), blocks.dequantize())
    assert projection.nbytes == tiles * (in_features // 32) * native.Q4_RECORD
    padded = NativeInt4Projection(projection.packed, tiles * native.Q4_TILE)
    q_all, d_all, m_all = padded.unpack()
    assert not q_all[out_features:].any() and not d_all[out_features:].float().any()
    assert not m_all[out_features:].float().any()


def test_q4_1_packing_is_the_layout_the_kernel_reads() -> None:
    """Byte for byte the record of ``int_matmul.c``'s header, independently of
    ``unpack``: per tile of 16 features and block of 32 inputs, the 16 fp16 d,
    the 16 fp16 m, then 4 chunks of 64 bytes. Pair group ``g`` is inputs ``2g``
    and ``2g + 1``, value ``2j + t`` = ``q[j, 2g + t]``; chunk ``c``'s byte ``k``
    (``k < 32``) holds value ``k`` of group ``4c`` in its low nibble and of
    group ``4c + 2`` in its high one, byte ``32 + k`` groups ``4c + 1`` and
    ``4c + 3``. Padding features (20..31 here) are zero nibbles."""
    out_features, in_features = 20, 64
    blocks = random_blocks(out_features, in_features, seed=5)
    packed = pack_q4_1(blocks.q, blocks.d, blocks.m)
    assert packed.shape == (2, in_features // 32, 320)
    for j in range(2 * native.Q4_TILE):
        tile, jj = divmod(j, 16)
        for b in range(in_features // 32):
            record = packed[tile, b]
            if j >= out_features:
                for c in range(4):
                    for half in range(2):
                        at = 64 + 64 * c + 32 * half + 2 * jj
                        assert record[at:at + 2].tolist() == [0, 0], (j, b, c)
                continue
            assert record[2 * jj:2 * jj + 2].view(torch.float16).item() == blocks.d[j, b].item()
            assert record[32 + 2 * jj:34 + 2 * jj].view(torch.float16).item() == (
                blocks.m[j, b].item())
            q = blocks.q[j, 32 * b:32 * b + 32].tolist()
            for c in range(4):
                for half in range(2):  # bytes 0-31: groups 4c / 4c + 2; 32-63: 4c + 1 / 4c + 3
                    low_group, high_group = 4 * c + half, 4 * c + half + 2
                    for t in range(2):
                        byte = int(record[64 + 64 * c + 32 * half + 2 * jj + t])
                        assert byte & 0x0F == q[2 * low_group + t], (j, b, c, half, t)
                        assert byte >> 4 == q[2 * high_group + t], (j, b, c, half, t)


def test_q4_1_from_dense_rounds_to_the_nearest_level() -> None:
    """``NativeInt4Projection.from_dense`` (dense GGUF projections): per group of
    32, ``m`` the minimum and ``d`` the range / 15 in fp16, every weight within
    half a step (plus the fp16 rounding of m) of its dequantized value."""
    weight = torch.randn(40, 96, generator=generator(3))
    projection = NativeInt4Projection.from_dense(weight)
    q, d, m = projection.unpack()
    assert int(q.max()) <= 15
    step = d.float().repeat_interleave(32, dim=1)
    error = (projection.dequantize() - weight).abs()
    assert bool((error <= 0.5 * step * 1.01 + 1e-3 * weight.abs()).all())
    groups = weight.view(40, 3, 32)
    assert torch.equal(m, groups.amin(-1).half())


@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_int8_packing_matches_the_int8_projection(out_features: int, in_features: int) -> None:
    """``NativeInt8Projection.from_dense`` holds the int8 values and scales of
    ``Int8Projection.from_dense`` (its dequantized weight is bit for bit the
    same), scales in fp32, the layout of ``int_matmul.c`` (byte ``32 g + 2 j +
    t`` of a record = ``q[j, 2g + t]`` as a two's complement int8 byte, no
    offset) and zero bytes as padding features."""
    weight = torch.randn(out_features, in_features, generator=generator(in_features))
    torch_projection = Int8Projection.from_dense(weight)
    projection = NativeInt8Projection.from_dense(weight)
    tiles, blocks = -(-out_features // native.Q4_TILE), in_features // 32
    assert projection.packed.shape == (tiles, blocks, native.Q8_RECORD)
    assert projection.packed.dtype == torch.uint8 and projection.packed.is_contiguous()
    assert projection.scales.dtype == torch.float32
    assert torch.equal(projection.scales, torch_projection.scales.float())
    assert torch.equal(projection.dequantize(), torch_projection.dequantize())
    assert projection.nbytes == tiles * blocks * native.Q8_RECORD + 4 * out_features
    bytes_ = (torch_projection.weight.int() & 0xFF).view(out_features, blocks, 16, 2)  # j b g t
    for j in (0, out_features // 2, out_features - 1):
        tile, jj = divmod(j, 16)
        record = projection.packed[tile].int()  # [blocks, 512]
        for g in (0, 1, 7, 15):
            for t in range(2):
                assert torch.equal(record[:, 32 * g + 2 * jj + t], bytes_[j, :, g, t]), (j, g, t)
        got = projection.packed[tile].view(blocks, 16, 16, 2)[:, :, jj].view(torch.int8)
        assert torch.equal(got, torch_projection.weight[j].view(blocks, 16, 2))
    padding = projection.packed[-1].view(blocks, 16, 16, 2)[:, :, out_features - (tiles - 1) * 16:]
    assert not padding.any()
    assert torch.equal(pack_int8(torch_projection.weight), projection.packed)
    one = pack_int8(torch.tensor([[-1, -128, 127, 1] + [0] * 28], dtype=torch.int8))[0, 0]
    assert one[[0, 1, 32, 33]].tolist() == [0xFF, 0x80, 0x7F, 0x01]  # groups 0 and 1, j = 0
    assert one.sum() == 0xFF + 0x80 + 0x7F + 0x01  # nothing else set


# ------------------------------------------------------------------ the arithmetic


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize(("rows", "out_features", "in_features"),
                         [(5, 40, 64), (3, 17, 32), (7, 100, 576)])
def test_q4_1_kernel_computes_the_quantized_product(rows: int, out_features: int,
                                                    in_features: int, x_dtype: torch.dtype,
                                                    out_dtype: torch.dtype) -> None:
    """``q4_1_matmul`` equals a float64 evaluation of ``sum_b d da_b isum_b + m
    sa_b`` over the activations quantized as the kernel does (int16 per 32
    inputs, emulated bit for bit by :func:`quantize_activations`): within
    :data:`FP32_TOLERANCE` of the terms' magnitude (the fp32 accumulation),
    plus the bf16 rounding of the output."""
    blocks = random_blocks(out_features, in_features, seed=rows)
    x = activations(rows, in_features, seed=rows, dtype=x_dtype)
    got = native.q4_1_matmul(x, pack_q4_1(blocks.q, blocks.d, blocks.m), out_features,
                             out_dtype)
    assert got.dtype == out_dtype and got.shape == (rows, out_features)
    reference, magnitude = reference_q4_1(x, blocks)
    tolerance = FP32_TOLERANCE * magnitude.amax(-1, keepdim=True)
    if out_dtype == torch.bfloat16:
        tolerance = tolerance + BF16_EPS * reference.abs()
    assert bool(((got.double() - reference).abs() <= tolerance).all())


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize(("rows", "out_features", "in_features"),
                         [(5, 40, 64), (3, 17, 32), (7, 100, 576)])
def test_q8_kernel_computes_the_quantized_product(rows: int, out_features: int,
                                                  in_features: int, x_dtype: torch.dtype,
                                                  out_dtype: torch.dtype) -> None:
    """``q8_matmul`` equals float64 ``scale * sum_b da_b isum_b`` over the
    int16-quantized activations and the signed int8 weights (no offset), within
    :data:`FP32_TOLERANCE` of the terms' magnitude plus the bf16 rounding of the
    output."""
    projection = int8_projection(out_features, in_features, seed=rows, out_dtype=out_dtype)
    x = activations(rows, in_features, seed=rows, dtype=x_dtype)
    got = projection(x)
    assert got.dtype == out_dtype and got.shape == (rows, out_features)
    reference, magnitude = reference_q8(x, projection)
    tolerance = FP32_TOLERANCE * magnitude.amax(-1, keepdim=True)
    if out_dtype == torch.bfloat16:
        tolerance = tolerance + BF16_EPS * reference.abs()
    assert bool(((got.double() - reference).abs() <= tolerance).all())


#: Relative error (2-norm) of a row of the kernels' output against the dense
#: product with the same (dequantized) weights, for Gaussian activations (no
#: outlier column), by output dtype. fp32 out: the int16 rounding of the
#: activations (half a step of max / 32767 per value), measured 1.4e-5 to
#: 2.8e-5 (both kernels, fp32 or bf16 in, 5 seeds). bf16 out: the output's
#: rounding dominates, measured 1.2e-3 to 2.0e-3. A scale off by 127/128, or
#: by 1/16384 with fp32 out, swapped pair members or nibble halves (> 100%) or
#: a dropped m term (60%) fail them. (The exact activation grid, to the last
#: bit, is checked by :func:`test_activations_round_half_to_even` and the C
#: harness.)
DENSE_BOUND = {torch.float32: 5e-5, torch.bfloat16: 3e-3}
#: ... and at least this (the activations are rounded: not claimed exact;
#: the fp32 accumulation alone would be ~1e-7).
DENSE_FLOOR = {torch.float32: 5e-6, torch.bfloat16: 5e-4}


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("kernel", KERNELS)
def test_kernels_are_close_to_the_dense_product(kernel: str, x_dtype: torch.dtype,
                                                out_dtype: torch.dtype) -> None:
    """Against ``x @ W.T`` in float64 with the dequantized weights, each row's
    relative error is that of rounding the activations to int16 per 32 values
    (plus, for bf16 out, the output's rounding) (:data:`DENSE_BOUND`): the
    scales, the layout and the m term are right."""
    rows, out_features, in_features = 10, 96, 576
    x = activations(rows, in_features, seed=11, dtype=x_dtype, outlier=False)
    if kernel == "q4_1":
        blocks = random_blocks(out_features, in_features, seed=12)
        weight = blocks.dequantize()
        got = native.q4_1_matmul(x, pack_q4_1(blocks.q, blocks.d, blocks.m), out_features,
                                 out_dtype)
    else:
        projection = int8_projection(out_features, in_features, seed=12, out_dtype=out_dtype)
        weight = projection.dequantize()
        got = projection(x)
    dense = x.double() @ weight.double().T
    error = (got.double() - dense).norm(dim=-1) / dense.norm(dim=-1)
    assert float(error.max()) < DENSE_BOUND[out_dtype]
    assert float(error.min()) > DENSE_FLOOR[out_dtype]


@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("kernel", KERNELS)
def test_activations_round_half_to_even(kernel: str, x_dtype: torch.dtype) -> None:
    """With identity weights (q4: d = 1, m = 0, one-hot q; int8: one-hot, scale
    1) the fp32 output is the quantized activation ``qa * d`` itself (one
    rounding to fp32). fp32 in: a block whose max is 32767 (d = 1) keeps
    integers and rounds halves to even (2.5 -> 2, 3.5 -> 4, -2.5 -> -2, 0.5 ->
    0, 32766.5 -> 32766); one whose max is 65534 (d = 2) halves its values
    first (5 -> 2.5 -> 2 -> 4 out, -65533 -> -32766.5 -> -32766 -> -65532).
    bf16 in (32767 is no bf16): max 32768 gives d = 1 + 2^-15 and 1 / d = 1 -
    2^-15 exactly, so x * (1 / d) = x - x 2^-15: 32768 -> 32767 (the max is
    +-32767, never clamped further), 16384 -> 16383.5 (a tie) -> 16384, 2.5 ->
    2.49992 -> 2, 3.5 -> 3; max 65536 (d = 2 + 2^-14) the same halved."""
    if x_dtype == torch.float32:
        first = [32767.0, 2.5, 3.5, -2.5, 0.5, 1.5, -0.5, -1.5, 32766.5, -32766.5, 7.0, -7.25]
        second = [65534.0, 5.0, 7.0, -5.0, 1.0, 3.0, -65533.0, 12.5]
        qa_first = [32767, 2, 4, -2, 0, 2, 0, -2, 32766, -32766, 7, -7]
        qa_second = [32767, 2, 4, -2, 0, 2, -32766, 6]
        scales = (1.0, 2.0)
    else:
        first = [32768.0, 16384.0, -16384.0, 2.5, 3.5, -2.5, 1.5, 0.5, 24576.0, -32768.0, 7.0]
        second = [65536.0, 32768.0, -32768.0, 5.0, 7.0, -65536.0, 3.0, 1.0]
        qa_first = [32767, 16384, -16384, 2, 3, -2, 1, 0, 24575, -32767, 7]
        qa_second = [32767, 16384, -16384, 2, 3, -32767, 1, 0]
        scales = (1.0 + 2.0 ** -15, 2.0 + 2.0 ** -14)
    x = torch.tensor([first + [0.0] * (32 - len(first)) + second + [0.0] * (32 - len(second))])
    assert torch.equal(x.to(x_dtype).float(), x)  # exact in either dtype
    x = x.to(x_dtype)
    qa = torch.tensor([qa_first + [0] * (32 - len(qa_first))
                       + qa_second + [0] * (32 - len(qa_second))], dtype=torch.float64)
    scale = torch.tensor(scales, dtype=torch.float64).repeat_interleave(32)
    expected = (qa * scale).float()  # qa * d exact in float64, rounded once to fp32
    emulated, d, _ = quantize_activations(x)  # the emulation agrees with the hand values
    assert torch.equal(emulated.view(1, 64), qa)
    assert torch.equal(d[0], torch.tensor(scales, dtype=torch.float64))
    eye = torch.eye(64)
    if kernel == "q4_1":
        ones = torch.ones(64, 2, dtype=torch.float16)
        got = native.q4_1_matmul(x, pack_q4_1(eye.to(torch.uint8), ones, 0 * ones), 64,
                                 torch.float32)
    else:
        got = native.q8_matmul(x, pack_int8(eye.to(torch.int8)), torch.ones(64), torch.float32)
    assert torch.equal(got, expected)


# ------------------------------------------------------------------ row invariance


@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("kernel", KERNELS)
def test_rows_do_not_depend_on_the_batch(kernel: str, x_dtype: torch.dtype) -> None:
    """For 1 to 13 rows at several offsets in 24, and for all 24 at once (the
    kernel quantizes more than 16 rows in parallel), on 1 thread or the
    default: every row's output bit-equals that row computed alone. bf16 out
    (the projections) and fp32 out (the LM head's ranking)."""
    rows, out_features, in_features = 24, 72, 96  # 5 feature tiles, the last partial
    x = activations(rows, in_features, seed=21, dtype=x_dtype)
    threads = torch.get_num_threads()
    for out_dtype in DTYPES:
        apply = kernel_call(kernel, out_features, in_features, out_dtype)
        alone = torch.cat([apply(x[r:r + 1]) for r in range(rows)])
        try:
            for num_threads in sorted({1, threads}):
                torch.set_num_threads(num_threads)
                assert torch.equal(apply(x), alone)
                for count in range(1, 14):
                    for offset in sorted({0, 1, 5, rows - count}):
                        got = apply(x[offset:offset + count])
                        assert torch.equal(got, alone[offset:offset + count]), (
                            count, offset, num_threads, out_dtype)
        finally:
            torch.set_num_threads(threads)


@pytest.mark.parametrize("kernel", KERNELS)
def test_prompt_rows_share_each_weight_widening_and_stay_invariant(kernel: str) -> None:
    """A prompt's rows go through the kernel in chunks of
    ``int_matmul_row_chunk()`` rows (at least 32) that share each widening
    of a block's weights (the 4-row tiles before re-widened every block per 4
    rows: ~10 % of a 128-row call); rows across two whole
    chunks and a partial one, on 1 thread or the default, bit-equal each row
    computed alone."""
    chunk = native.int_matmul_row_chunk()
    assert chunk >= 32
    rows, out_features, in_features = 2 * chunk + 5, 40, 96
    x = activations(rows, in_features, seed=23)
    apply = kernel_call(kernel, out_features, in_features, torch.bfloat16)
    alone = torch.cat([apply(x[r:r + 1]) for r in range(rows)])
    threads = torch.get_num_threads()
    try:
        for num_threads in sorted({1, threads}):
            torch.set_num_threads(num_threads)
            assert torch.equal(apply(x), alone), num_threads
            assert torch.equal(apply(x[3:3 + chunk + 1]), alone[3:3 + chunk + 1]), num_threads
    finally:
        torch.set_num_threads(threads)


# ------------------------------------------------------------------ edge cases


@pytest.mark.parametrize("kernel", KERNELS)
def test_zero_rows(kernel: str) -> None:
    """No rows: an empty ``[0, out]`` result in the asked dtype."""
    for out_dtype in DTYPES:
        got = kernel_call(kernel, 40, 64, out_dtype)(torch.zeros(0, 64, dtype=torch.bfloat16))
        assert got.shape == (0, 40) and got.dtype == out_dtype


@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("kernel", KERNELS)
def test_zero_rows_and_blocks_and_negative_zeros(kernel: str, x_dtype: torch.dtype) -> None:
    """An all-zero row (and an all -0.0 one) gives exactly 0 (d = 0: no NaN from
    1 / d; sa = 0 so q4's m term vanishes too); a zero block adds nothing (its
    row equals the row without that block); -0.0 quantizes as 0."""
    apply = kernel_call(kernel, 40, 96, torch.float32)
    x = activations(4, 96, seed=31)
    x[0] = 0.0
    x[1] = -0.0
    x[2, 32:64] = 0.0
    x[3, ::3] = -0.0
    x = x.to(x_dtype)
    got = apply(x)
    assert torch.equal(got[:2], torch.zeros(2, 40))
    if kernel == "q4_1":  # the reference without the zero block is the same number
        blocks = random_blocks(40, 96)
        reference, magnitude = reference_q4_1(x[2:3], blocks)
        kept = Q4_1Blocks(blocks.d[:, [0, 2]].contiguous(), blocks.m[:, [0, 2]].contiguous(),
                          torch.cat((blocks.q[:, :32], blocks.q[:, 64:]), dim=1))
        reduced, _ = reference_q4_1(torch.cat((x[2:3, :32], x[2:3, 64:]), dim=1), kept)
        assert torch.equal(reference, reduced)
        tolerance = FP32_TOLERANCE * magnitude.max()
        assert bool(((got[2].double() - reference[0]).abs() <= tolerance).all())
    positive = x.clone()
    positive[positive == 0] = 0.0  # -0.0 -> +0.0
    assert torch.equal(apply(positive.contiguous()), got)
    assert not got.isnan().any()


@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("kernel", KERNELS)
def test_huge_and_tiny_magnitudes(kernel: str, x_dtype: torch.dtype) -> None:
    """Activations around 1e30 and 1e-26 stay finite and as accurate as usual
    (d = max / 32767 neither overflows nor underflows there, nor does 1 / d),
    and scaling a row by a power of two (2^100, 2^-90) scales its fp32 output
    by exactly that: every step of the quantization and accumulation is
    scale-free. (Blocks whose max is below 1e-30 count as zeros: see
    :func:`test_a_nan_activation_makes_its_row_nan`; 2^-100 ~ 7.9e-31 would
    be one.)"""
    apply = kernel_call(kernel, 40, 96, torch.float32)
    x = activations(3, 96, seed=41, dtype=x_dtype, outlier=False)
    base = apply(x)
    weight = (random_blocks(40, 96).dequantize() if kernel == "q4_1"
              else int8_projection(40, 96).dequantize())
    for factor in (2.0 ** 100, 2.0 ** -90, 1e30, 1e-26):
        scaled = (x.float() * factor).to(x_dtype)
        block_max = scaled.float().abs().view(3, -1, 32).amax(-1)
        assert float(block_max.min()) > 10 * MIN_AMAX, factor  # every block quantized
        got = apply(scaled)
        assert bool(got.isfinite().all()), factor
        dense = scaled.double() @ weight.double().T
        error = (got.double() - dense).norm(dim=-1) / dense.norm(dim=-1)
        assert float(error.max()) < DENSE_BOUND[torch.float32], factor
        if factor in (2.0 ** 100, 2.0 ** -90):
            assert torch.equal(got, base * factor), factor


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_nan_activation_makes_its_row_nan(kernel: str) -> None:
    """A NaN or an infinity in a row makes that row's outputs NaN, as ``x @ W.T``
    would for NaN (an infinity gives NaN here, not +-inf: the block's scale is
    undefined); other rows are unaffected. A block whose largest |x| is below
    1e-30 (:data:`MIN_AMAX`; 1 / d would overflow a little further down)
    counts as zeros, one at exactly 1e-30 is quantized: rows whose every block
    has its max at the fp32 just below 1e-30, or at 2^-100, give exact zeros
    (quantized they would give ~1e-31), one at 1e-30 the emulated product."""
    apply = kernel_call(kernel, 40, 64, torch.float32)
    x = activations(3, 64, seed=51)
    expected_rest = apply(x[2:])
    x[0, 5] = float("nan")
    x[1, 40] = float("-inf")
    got = apply(x)
    assert torch.equal(got[2:], expected_rest)
    assert bool(got[:2].isnan().all())
    shape = activations(1, 64, seed=52).view(2, 32)
    shape = shape / shape.abs().amax(-1, keepdim=True)  # each block's max |x| is exactly 1
    below = torch.nextafter(torch.tensor(MIN_AMAX), torch.tensor(0.0))
    rows = torch.stack([(shape * target).view(64)
                        for target in (below, torch.tensor(MIN_AMAX), torch.tensor(2.0 ** -100))])
    assert rows.view(3, 2, 32).abs().amax(-1).tolist() == [[float(below)] * 2, [MIN_AMAX] * 2,
                                                            [2.0 ** -100] * 2]
    got = apply(rows)
    assert torch.equal(got[[0, 2]], torch.zeros(2, 40))
    assert bool((got[1] != 0).any()) and bool(got[1].isfinite().all())
    if kernel == "q4_1":
        reference, magnitude = reference_q4_1(rows[1:2], random_blocks(40, 64))
    else:
        reference, magnitude = reference_q8(rows[1:2], int8_projection(40, 64))
    assert float(magnitude.max()) > 0
    assert bool(((got[1].double() - reference[0]).abs() <= FP32_TOLERANCE * magnitude.max()).all())


def test_bad_arguments_are_refused_with_a_message() -> None:
    """An input of another width than the packed weights (48: not even a
    multiple of 32) or not 2-D, packed weights of another shape (tiles for
    another out_features, no blocks), dtype or layout, other input or output
    dtypes, non-contiguous tensors, no output features (the C kernel's own
    refusal): ValueError, saying what is expected."""
    packed4 = NativeInt4Projection.from_q4_1(random_blocks(40, 64)).packed
    int8 = int8_projection(40, 64)
    x = activations(3, 64)
    cases: list[tuple[Callable[[], object], str]] = [
        (lambda: native.q4_1_matmul(x[:, :48].contiguous(), packed4, 40, torch.float32),
         "integer matmul"),
        (lambda: native.q4_1_matmul(x[0], packed4, 40, torch.float32), "integer matmul"),
        (lambda: native.q4_1_matmul(x, packed4, 17, torch.float32), "packed uint8"),
        (lambda: native.q4_1_matmul(x, packed4[:, :1].contiguous(), 40, torch.float32),
         "integer matmul"),
        (lambda: native.q4_1_matmul(x, packed4.view(torch.int8), 40, torch.float32),
         "packed uint8"),
        (lambda: native.q4_1_matmul(x, packed4.transpose(0, 1), 40, torch.float32),
         "packed uint8"),
        (lambda: native.q4_1_matmul(x, packed4[..., :256].contiguous(), 40, torch.float32),
         "packed uint8"),
        (lambda: native.q4_1_matmul(x.half(), packed4, 40, torch.float32), "fp32/bf16"),
        (lambda: native.q4_1_matmul(x.double(), packed4, 40, torch.float32), "fp32/bf16"),
        (lambda: native.q4_1_matmul(torch.randn(64, 3).T, packed4, 40, torch.float32),
         "contiguous"),
        (lambda: native.q4_1_matmul(x, packed4, 40, torch.float16), "out fp32/bf16"),
        (lambda: native.q4_1_matmul(torch.zeros(3, 0), packed4[:, :0], 40, torch.float32),
         "integer matmul"),
        (lambda: native.q4_1_matmul(x, packed4[:0], 0, torch.float32), "integer matmul"),
        (lambda: native.q8_matmul(x[:, :48].contiguous(), int8.packed, int8.scales,
                                  torch.float32), "integer matmul"),
        (lambda: native.q8_matmul(x, packed4, int8.scales, torch.float32), "packed uint8"),
        (lambda: native.q8_matmul(x, int8.packed, int8.scales[:17], torch.float32),
         "packed uint8"),
        (lambda: native.q8_matmul(x, int8.packed, int8.scales, torch.int8), "out fp32/bf16"),
        (lambda: native.q8_matmul(x.half(), int8.packed, int8.scales, torch.float32),
         "fp32/bf16"),
        (lambda: native.q8_matmul(torch.zeros(3, 0), int8.packed[:, :0], int8.scales,
                                  torch.float32), "integer matmul"),
        (lambda: native.q8_matmul(x, int8.packed[:0], int8.scales[:0], torch.float32),
         "integer matmul"),
    ]
    for index, (call, message) in enumerate(cases):
        with pytest.raises(ValueError, match=message) as caught:
            call()
        assert "got" in str(caught.value) or "refused" in str(caught.value), index


def test_bad_scales_are_refused_with_a_message() -> None:
    """``q8_matmul``'s scales must be fp32, contiguous, one per output feature
    of the packed weights: ValueError otherwise."""
    int8 = int8_projection(40, 64)
    x = activations(3, 64)
    for scales in (int8.scales.double(), int8.scales.bfloat16(), int8.scales[None],
                   torch.stack((int8.scales, int8.scales), 1)[:, 0],  # strided
                   int8.scales[:32]):  # 2 tiles, the weights have 3
        with pytest.raises(ValueError, match="scales fp32|packed uint8"):
            native.q8_matmul(x, int8.packed, scales, torch.float32)
    for scales in (int8.scales.double(), torch.stack((int8.scales, int8.scales), 1)[:, 0]):
        with pytest.raises(ValueError, match="scales fp32"):
            native.q8_matmul(x, int8.packed, scales, torch.float32)


# ------------------------------------------------------------------ projections and the LM head


def test_projections_call_their_kernels(gguf_q4_1: GGUFModel) -> None:
    """``quantize_projection`` builds the native projections for ``native`` and
    PyTorch's for ``torch``; the native ones take bf16 and give bf16 (fp32 for
    an LM head ranking), and compute what ``q4_1_matmul`` / ``q8_matmul`` do
    with the real blocks of a SmolLM2 projection."""
    blocks = gguf_q4_1.q4_1["model.layers.5.mlp.gate_proj.weight"]
    dense = blocks.dequantize()
    native4 = quantize_projection("int4", None, blocks, "native")
    native8 = quantize_projection("int8", dense, None, "native")
    assert isinstance(native4, NativeInt4Projection) and isinstance(native8, NativeInt8Projection)
    assert isinstance(quantize_projection("int4", None, blocks, "torch"), Int4Projection)
    assert isinstance(quantize_projection("int8", dense, None, "torch"), Int8Projection)
    assert isinstance(quantize_projection("int4", dense, None, "native"), NativeInt4Projection)
    x = activations(4, blocks.shape[1], dtype=torch.bfloat16, outlier=False)
    for projection in (native4, native8):
        got = projection(x)
        assert got.dtype == torch.bfloat16 and got.shape == (4, blocks.shape[0])
        weight = projection.dequantize()
        dense_out = x.double() @ weight.double().T
        error = (got.double() - dense_out).norm(dim=-1) / dense_out.norm(dim=-1)
        assert float(error.max()) < DENSE_BOUND[torch.bfloat16]
    assert torch.equal(native4.dequantize(), dense)
    assert torch.equal(native4(x), native.q4_1_matmul(x, native4.packed, native4.out_features,
                                                      torch.bfloat16))


@pytest.mark.model
@pytest.mark.parametrize("kernel", ["torch", "native"])
def test_lm_head_top_logits_are_the_dense_ones(gguf_model: GGUFModel, kernel: str) -> None:
    """The int8 head (its ranking on ``kernel``) recomputes each row's largest
    logits from the fp32 table: they match the dense fp32 head (bit-exact is
    not claimed: another summation order); the rest are the int8 kernel's,
    within its error."""
    table = gguf_model.state_dict["model.embed_tokens.weight"]
    head = Int8LMHead.from_dense(table, kernel)
    assert isinstance(head.ranking, NativeInt8Projection if kernel == "native"
                      else Int8Projection)
    assert head.nbytes == head.ranking.nbytes + REFINED_LOGITS * table.shape[1] * 4
    x = torch.randn(3, table.shape[1], generator=generator(1))
    got, dense = head(x), x @ table.T
    assert got.dtype == torch.float32
    top = dense.topk(8, dim=-1).indices  # well inside the 64 the int8 logits pick
    torch.testing.assert_close(got.gather(1, top), dense.gather(1, top), rtol=1e-5, atol=1e-4)
    assert torch.equal(got.argmax(-1), dense.argmax(-1))
    assert float((got - dense).abs().max()) < 0.05 * float(dense.abs().max())


# ------------------------------------------------------------------ choosing the kernel


def test_resolve_quant_kernel() -> None:
    """``torch`` stays ``torch``; ``auto`` and ``native`` are ``native`` where the
    kernels build (here); anything else is refused with the choices."""
    assert QUANT_KERNELS == ("auto", "native", "torch")
    assert resolve_quant_kernel("torch") == "torch"
    assert resolve_quant_kernel("auto") == "native"
    assert resolve_quant_kernel("native") == "native"
    for bad in ("cuda", "", "Native"):
        with pytest.raises(ValueError, match="must be one of"):
            resolve_quant_kernel(bad)


def test_without_a_compiler_auto_falls_back_and_native_is_refused(
        tmp_path: Path, kernel_env: pytest.MonkeyPatch) -> None:
    """With no C compiler and no built library: ``auto`` is ``torch``,
    ``native`` a ValueError that says why and names ``--quant-kernel``, and the
    engine's config check refuses ``--quant-kernel native`` (not with
    ``--quantization none``, which runs no quantized kernel)."""
    kernel_env.setenv("LLMESH_KERNEL_CACHE", str(tmp_path))
    kernel_env.setenv("CC", "no-such-cc")
    assert resolve_quant_kernel("auto") == "torch"
    assert resolve_quant_kernel("torch") == "torch"
    with pytest.raises(ValueError, match="--quant-kernel native: no C compiler 'no-such-cc'"):
        resolve_quant_kernel("native")
    with pytest.raises(ValueError, match="--quant-kernel torch"):
        resolve_quant_kernel("native")
    with pytest.raises(ValueError, match="--quant-kernel"):
        check_config(EngineConfig(quant_kernel="native"))
    check_config(EngineConfig(quant_kernel="auto"))
    check_config(EngineConfig(quant_kernel="native", quantization="none"))


def test_the_config_check_refuses_unknown_kernels() -> None:
    """An unknown ``quant_kernel`` is refused whatever the quantization."""
    for quantization in ("int4", "int8", "none"):
        with pytest.raises(ValueError, match="must be one of"):
            check_config(EngineConfig(quant_kernel="fast", quantization=quantization))
    check_config(EngineConfig(quant_kernel="torch"))


@pytest.mark.model
@pytest.mark.parametrize("quant_kernel", ["native", "torch"])
def test_a_loaded_model_runs_and_probes_its_kernel(model_path: Path, quant_kernel: str) -> None:
    """``ModelRunner.from_gguf(..., quant_kernel=)`` builds every int4 projection
    and the LM head's ranking on that kernel, says so in ``model.quant_kernel``,
    and the batch-invariance probe (the model's own layer-0 projections and
    head, 1 to 39 rows at offsets 0 and 1 against a 40-row batch) passes."""
    runner = ModelRunner.from_gguf(model_path, quantization="int4", quant_kernel=quant_kernel)
    model = runner.model
    assert model.quant_kernel == quant_kernel
    int4 = NativeInt4Projection if quant_kernel == "native" else Int4Projection
    assert all(isinstance(p, int4) for layer in model.layers for p in layer.projections)
    assert isinstance(model.head, Int8LMHead)
    assert isinstance(model.head.ranking, NativeInt8Projection if quant_kernel == "native"
                      else Int8Projection)
    assert runner.probe_batch_invariance() == []
