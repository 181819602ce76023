"""Weight-only quantization (``torch_backend/quant.py``) on the real SmolLM2 GGUF:
the Q4_1 blocks reach the int4 kernel without requantizing, the kernels compute
what their dequantized weights say, and the flags parse."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import gguf
import pytest
import torch

from services.engine.config import EngineConfig, add_engine_arguments, engine_config_from_args
from services.engine.torch_backend.backend import resolve_quantization
from services.engine.torch_backend.gguf_loader import GGUFModel, Q4_1Blocks, dequantize
from services.engine.torch_backend.model import LlamaModel
from services.engine.torch_backend.model_runner import ModelRunner
from services.engine.torch_backend.quant import (
    REFINED_LOGITS,
    Int4Projection,
    Int8Projection,
    check_mode,
)

pytestmark = pytest.mark.model

BF16_EPS = 2.0 ** -8  # bf16 keeps 8 significant bits: rounding error <= 2^-9 relative


def test_q4_1_blocks_are_the_gguf_values(model_path: object) -> None:
    """Splitting the raw bytes into d, m, q reproduces gguf's own dequantization
    bit for bit, and q holds 4-bit values."""
    reader = gguf.GGUFReader(str(model_path))
    tensors = [t for t in reader.tensors if t.name in (
        "blk.0.attn_q.weight", "blk.0.ffn_down.weight", "blk.29.ffn_gate.weight")]
    assert len(tensors) == 3
    for tensor in tensors:
        blocks = Q4_1Blocks.from_tensor(tensor)
        assert blocks.d.dtype == blocks.m.dtype == torch.float16
        assert int(blocks.q.max()) <= 15 and int(blocks.q.min()) >= 0
        assert torch.equal(blocks.dequantize(), torch.from_numpy(dequantize(tensor)))


def test_int4_packing_keeps_q_exactly(gguf_q4_1: GGUFModel, gguf_model: GGUFModel) -> None:
    """The fused Q/K/V of layer 0 (Q/K rows un-permuted) and layer 17's down
    projection as the int4 kernel holds them: the same 4-bit values as the GGUF,
    scale = d and zero = m + 8 d rounded to bf16, and (so) the dense weights
    of the regular loader up to that scale rounding."""
    cases = {
        "qkv": (["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.0.self_attn.v_proj.weight"]),
        "down": ["model.layers.17.mlp.down_proj.weight"],
    }
    for names in cases.values():
        blocks = Q4_1Blocks.cat([gguf_q4_1.q4_1[name] for name in names])
        projection = Int4Projection.from_q4_1(blocks)
        assert torch.equal(projection.unpack_values(), blocks.q.to(torch.int32))
        scale, zero = projection.scales_and_zeros.permute(2, 1, 0)  # [out, in / 32] each
        d, m = blocks.d.float(), blocks.m.float()
        assert torch.equal(scale, d.to(torch.bfloat16))
        assert torch.equal(zero, (m + 8 * d).to(torch.bfloat16))
        dense = torch.cat([gguf_model.state_dict[name] for name in names])
        bound = BF16_EPS * (8 * d.abs() + (m + 8 * d).abs())  # per block
        error = (projection.dequantize() - dense).abs().view(*d.shape, 32)
        assert bool((error <= bound[..., None]).all())
        assert float(error.max()) > 0  # the scales are rounded: not claimed exact


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_int4_kernel_computes_its_dequantized_weights(gguf_q4_1: GGUFModel, rows: int) -> None:
    """``_weight_int4pack_mm_for_cpu`` output equals ``x @ W.T`` computed in fp64 from
    the kernel's dequantized weight and the same bf16 input, within the bf16
    rounding of the output."""
    projection = Int4Projection.from_q4_1(gguf_q4_1.q4_1["model.layers.5.mlp.gate_proj.weight"])
    x = torch.randn(rows, projection.in_features, generator=torch.Generator().manual_seed(rows))
    x = x.to(torch.bfloat16)
    got = projection(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, projection.out_features)
    reference = x.double() @ projection.dequantize().double().T
    tolerance = BF16_EPS * reference.abs() + 1e-4 * float(reference.abs().max())
    assert bool(((got.double() - reference).abs() <= tolerance).all())


def test_int8_kernel_computes_its_dequantized_weights(gguf_model: GGUFModel) -> None:
    weight = gguf_model.state_dict["model.layers.3.self_attn.o_proj.weight"]
    projection = Int8Projection.from_dense(weight)
    step = projection.scales.float()[:, None]
    assert bool(((projection.dequantize() - weight).abs() <= 0.5 * step * (1 + 1e-6)).all())
    x = torch.randn(5, weight.shape[1], generator=torch.Generator().manual_seed(0))
    x = x.to(torch.bfloat16)
    reference = x.double() @ projection.dequantize().double().T
    tolerance = BF16_EPS * reference.abs() + 1e-4 * float(reference.abs().max())
    assert bool(((projection(x).double() - reference).abs() <= tolerance).all())


@pytest.mark.parametrize("quant_kernel", ["native", "torch"])
def test_decode_weight_bytes_counts_what_a_step_reads(
        smollm2_by_mode: Callable[..., LlamaModel], quant_kernel: str) -> None:
    """Projections (int4: half a byte per weight + a 2-byte scale and zero per
    32, bf16 for ``torch``, the GGUF's fp16 ``d`` and ``m`` for ``native``; int8:
    a byte per weight + a scale per row, bf16 for ``torch``, fp32 for
    ``native``), the LM head (int8 per row with the same scales, plus the fp32
    rows of the refined top logits, in the quantized modes; the fp32 embedding
    otherwise) and the norms. SmolLM2's output sizes are multiples of 16, so
    the native layouts' tiles hold no padding."""
    model = smollm2_by_mode("int4", quant_kernel=quant_kernel)
    assert model.quant_kernel == quant_kernel
    config = model.config
    hidden, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = [(q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter)]
    vocab = config.vocab_size
    assert all(n % 16 == 0 for n, _ in shapes) and vocab % 16 == 0
    norms = (2 * config.num_layers + 1) * hidden * 4
    row_scale = 4 if quant_kernel == "native" else 2  # fp32 / bf16 per int8 row
    int8_head = vocab * hidden + row_scale * vocab + REFINED_LOGITS * hidden * 4
    int4 = sum(n * k // 2 + (k // 32) * n * 2 * 2 for n, k in shapes) * config.num_layers
    int8 = sum(n * k + row_scale * n for n, k in shapes) * config.num_layers
    dense = sum(n * k * 4 for n, k in shapes) * config.num_layers
    assert model.decode_weight_bytes() == int4 + int8_head + norms
    int8_model = smollm2_by_mode("int8", quant_kernel=quant_kernel)
    assert int8_model.quant_kernel == quant_kernel
    assert int8_model.decode_weight_bytes() == int8 + int8_head + norms
    fp32_model = smollm2_by_mode("none", quant_kernel=quant_kernel)
    assert fp32_model.quant_kernel is None
    assert fp32_model.decode_weight_bytes() == dense + vocab * hidden * 4 + norms


def parse(argv: list[str], environ: dict[str, str] | None = None) -> EngineConfig:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_engine_arguments(parser, environ or {})
    return engine_config_from_args(parser.parse_args(argv))


def test_quant_kernel_flag_and_environment() -> None:
    """``--quant-kernel`` (default ``auto``) and ``LLMESH_ENGINE_QUANT_KERNEL``;
    the flag wins; unknown values are refused."""
    assert EngineConfig().quant_kernel == parse([]).quant_kernel == "auto"
    assert parse(["--quant-kernel", "torch"]).quant_kernel == "torch"
    assert parse(["--quant-kernel", "native"]).quant_kernel == "native"
    assert parse([], {"LLMESH_ENGINE_QUANT_KERNEL": "torch"}).quant_kernel == "torch"
    assert parse(["--quant-kernel", "native"],
                 {"LLMESH_ENGINE_QUANT_KERNEL": "torch"}).quant_kernel == "native"
    with pytest.raises(ValueError, match="LLMESH_ENGINE_QUANT_KERNEL"):
        parse([], {"LLMESH_ENGINE_QUANT_KERNEL": "cuda"})
    with pytest.raises((argparse.ArgumentError, SystemExit)):
        parse(["--quant-kernel", "fast"])


def test_dense_prefill_flag_and_environment() -> None:
    """``--[no-]dense-prefill`` and ``LLMESH_ENGINE_DENSE_PREFILL`` (``auto``, the
    default None, may be set explicitly)."""
    assert EngineConfig().dense_prefill is None and parse([]).dense_prefill is None
    assert parse(["--dense-prefill"]).dense_prefill is True
    assert parse(["--no-dense-prefill"]).dense_prefill is False
    assert parse([], {"LLMESH_ENGINE_DENSE_PREFILL": "1"}).dense_prefill is True
    assert parse([], {"LLMESH_ENGINE_DENSE_PREFILL": "auto"}).dense_prefill is None
    assert parse(["--no-dense-prefill"], {"LLMESH_ENGINE_DENSE_PREFILL": "on"}).dense_prefill is False
    with pytest.raises(ValueError, match="LLMESH_ENGINE_DENSE_PREFILL"):
        parse([], {"LLMESH_ENGINE_DENSE_PREFILL": "maybe"})


def test_quantization_flag_and_environment() -> None:
    assert EngineConfig().quantization == parse([]).quantization == "auto"
    assert resolve_quantization(EngineConfig()).quantization == "int4"  # SmolLM2: Llama
    assert resolve_quantization(EngineConfig(dtype="bfloat16")).quantization == "none"
    assert resolve_quantization(EngineConfig(quantization="int8")).quantization == "int8"
    assert parse(["--quantization", "int8"]).quantization == "int8"
    assert parse([], {"LLMESH_ENGINE_QUANTIZATION": "none"}).quantization == "none"
    assert parse(["--quantization", "int4"],
                 {"LLMESH_ENGINE_QUANTIZATION": "none"}).quantization == "int4"
    with pytest.raises(ValueError, match="LLMESH_ENGINE_QUANTIZATION"):
        parse([], {"LLMESH_ENGINE_QUANTIZATION": "int3"})
    with pytest.raises((argparse.ArgumentError, SystemExit)):
        parse(["--quantization", "fp8"])


def test_contradictory_modes_are_refused(model_path: object) -> None:
    cpu = torch.device("cpu")
    check_mode("int4", torch.float32, cpu)
    check_mode("none", torch.bfloat16, cpu)
    with pytest.raises(ValueError, match="--dtype"):
        check_mode("int4", torch.bfloat16, cpu)
    with pytest.raises(ValueError, match="CPU"):
        check_mode("int8", torch.float32, torch.device("cuda"))
    with pytest.raises(ValueError, match="quantization must be one of"):
        check_mode("int2", torch.float32, cpu)
    with pytest.raises(ValueError, match="--dtype"):  # refused before loading anything
        ModelRunner.from_gguf(model_path, dtype="bfloat16", quantization="int8")  # type: ignore[arg-type]
