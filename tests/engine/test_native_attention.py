"""The native paged attention kernel: right against a float64 reference, bit-identical
for a token whatever else the call holds, same cache contents as the PyTorch path,
clear errors, and the backend choice (``auto`` / ``native`` / ``torch``)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from services.engine.torch_backend import native
from services.engine.torch_backend.llama_config import LlamaConfig
from services.engine.torch_backend.model import LlamaModel
from services.engine.torch_backend.model_runner import ModelRunner, resolve_attention_backend
from services.engine.torch_backend.native import (
    NativeKernelUnavailable,
    load_library,
    unavailable_reason,
)
from services.engine.torch_backend.native_attention import NativeAttentionBatch
from services.engine.torch_backend.paged_kv import AttentionBatch, PagedKVCache, SeqAttention
from services.engine.torch_backend.rope import rope_tables, signed_sin


@dataclass(frozen=True)
class Shape:
    num_layers: int = 2
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    rope_theta: float = 10000.0
    uniform_attention: bool = True  # every layer attends alike (no sliding window)


SHAPE = Shape()
BLOCK = 16
LAYER = 1
SCALE = SHAPE.head_dim ** -0.5


@pytest.fixture(scope="module", autouse=True)
def library() -> None:
    load_library()  # a build failure fails the module, it does not skip it


def rope(shape: Shape = SHAPE, positions: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = rope_tables(shape, positions, "cpu", torch.float32)  # type: ignore[arg-type]
    return cos, signed_sin(sin)


class Sequences:
    """Random per-sequence QKV rows (``[tokens, (h + 2 kv) * d]``) and block tables."""

    def __init__(self, lengths: list[int], seed: int = 0, shape: Shape = SHAPE,
                 block_size: int = BLOCK) -> None:
        self.block_size = block_size
        gen = torch.Generator().manual_seed(seed)
        width = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
        self.qkv = [torch.randn(n, width, generator=gen) for n in lengths]
        blocks = list(range(sum(-(-n // block_size) for n in lengths)))
        random.Random(seed).shuffle(blocks)
        self.tables, at = [], 0
        for n in lengths:
            count = -(-n // block_size)
            self.tables.append(blocks[at:at + count])
            at += count
        self.num_blocks = len(blocks)


def run(cache: PagedKVCache, parts: list[tuple[int, int, int]], seqs: Sequences,
        dtype: torch.dtype = torch.float32, out_dtype: torch.dtype = torch.float32,
        padding: int = 0, backend: str = "native", shape: Shape = SHAPE) -> torch.Tensor:
    """One call over ``parts`` = (sequence, first token, tokens), rows in that order."""
    rows, slots, attn, positions = [], [], [], []
    size = seqs.block_size
    for seq, first, count in parts:
        table = seqs.tables[seq]
        rows.append(seqs.qkv[seq][first:first + count])
        slots.extend(table[p // size] * size + p % size for p in range(first, first + count))
        positions.extend(range(first, first + count))
        attn.append(SeqAttention(first, count, table))
    qkv = torch.cat(rows + [torch.zeros(padding, rows[0].shape[1])]).to(dtype)
    tables = rope(shape)
    if backend == "native":
        batch = NativeAttentionBatch(cache, attn, torch.tensor(slots), shape.num_heads, tables)
    else:
        batch = AttentionBatch(cache, attn, torch.tensor(slots),
                               shape.num_heads // shape.num_kv_heads,
                               torch.tensor(positions + [0] * padding), tables)
    return batch.attend(LAYER, qkv, SCALE, out_dtype).clone()


def reference(seqs: Sequences, seq: int, shape: Shape = SHAPE) -> torch.Tensor:
    """float64 causal GQA attention with RoPE over the whole sequence ``[n, h * d]``."""
    h, kv, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
    x = seqs.qkv[seq].double()
    n = x.shape[0]
    cos, sin = (t[:n].double().unsqueeze(1) for t in rope(shape))

    def rotate(t: torch.Tensor) -> torch.Tensor:
        return t * cos + torch.cat((t[..., d // 2:], t[..., :d // 2]), dim=-1) * sin

    q = rotate(x[:, :h * d].view(n, h, d)).transpose(0, 1)
    k = rotate(x[:, h * d:(h + kv) * d].view(n, kv, d)).transpose(0, 1)
    v = x[:, (h + kv) * d:].view(n, kv, d).transpose(0, 1)
    k, v = k.repeat_interleave(h // kv, 0), v.repeat_interleave(h // kv, 0)
    scores = q @ k.transpose(1, 2) * SCALE
    scores.masked_fill_(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return (torch.softmax(scores, -1) @ v).transpose(0, 1).reshape(n, h * d)


def new_cache(seqs: Sequences, shape: Shape = SHAPE, backend: str = "native") -> PagedKVCache:
    return PagedKVCache(shape, seqs.num_blocks, seqs.block_size,  # type: ignore[arg-type]
                        transposed_keys=backend == "native")


@pytest.mark.parametrize("block_size", [16, 32, 4, 5])
@pytest.mark.parametrize("lengths", [[1], [17, 5, 40], [300]])
def test_matches_a_float64_reference(lengths: list[int], block_size: int) -> None:
    seqs = Sequences(lengths, block_size=block_size)
    cache = new_cache(seqs)
    out = run(cache, [(i, 0, n) for i, n in enumerate(lengths)], seqs)
    row = 0
    for i, n in enumerate(lengths):
        expected = reference(seqs, i)
        torch.testing.assert_close(out[row:row + n].double(), expected, rtol=1e-5, atol=2e-6)
        row += n


@pytest.mark.parametrize("shape", [Shape(num_heads=8, num_kv_heads=1, head_dim=128),
                                   Shape(num_heads=4, num_kv_heads=2, head_dim=24),
                                   Shape(num_heads=2, num_kv_heads=2, head_dim=8)])
def test_other_head_shapes(shape: Shape) -> None:
    seqs = Sequences([33, 2], shape=shape)
    out = run(new_cache(seqs, shape), [(0, 0, 33), (1, 0, 2)], seqs, shape=shape)
    torch.testing.assert_close(out[:33].double(), reference(seqs, 0, shape), rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(out[33:].double(), reference(seqs, 1, shape), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("block_size", [16, 48, 8])
def test_a_token_gets_the_same_bits_in_any_call(block_size: int) -> None:
    """Token 99 of sequence 0: in a one-shot prefill, in a later chunk, as a decode
    row beside other sequences of other lengths, and beside padding rows."""
    seqs = Sequences([100, 30, 250], seed=3, block_size=block_size)
    cache = new_cache(seqs)
    one_shot = run(cache, [(0, 0, 100)], seqs)
    run(cache, [(1, 0, 29), (2, 0, 249)], seqs)
    chunk = run(cache, [(0, 61, 39)], seqs)
    decode = run(cache, [(2, 249, 1), (0, 99, 1), (1, 29, 1)], seqs, padding=3)
    mixed = run(cache, [(1, 29, 1), (0, 80, 20)], seqs)
    for got in (chunk[38], decode[1], mixed[20]):
        assert torch.equal(got, one_shot[99])
    assert torch.equal(chunk[:39], one_shot[61:])
    assert decode[3:].abs().sum() == 0  # padding rows are zero


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_contents_and_outputs_agree_with_the_pytorch_path(dtype: torch.dtype) -> None:
    seqs = Sequences([40, 7], seed=5)
    native_cache, torch_cache = new_cache(seqs), new_cache(seqs, backend="torch")
    parts = [(0, 0, 40), (1, 0, 7)]
    native = run(native_cache, parts, seqs, dtype=dtype, out_dtype=torch.bfloat16, padding=2)
    eager = run(torch_cache, parts, seqs, dtype=dtype, out_dtype=torch.bfloat16, padding=2,
                backend="torch")
    assert native.dtype == torch.bfloat16
    torch.testing.assert_close(native_cache.k.transpose(-1, -2), torch_cache.k, rtol=1e-6,
                               atol=1e-6)
    assert torch.equal(native_cache.v, torch_cache.v)  # values are stored as they are
    torch.testing.assert_close(native.float(), eager.float(), rtol=1e-2, atol=1e-2)
    assert native[47:].abs().sum() == 0


def test_unsupported_layouts_raise_a_clear_error() -> None:
    shape = Shape(num_heads=2, num_kv_heads=1, head_dim=272)
    seqs = Sequences([4], shape=shape)
    with pytest.raises(RuntimeError, match=r"head_dim must be even and in \[2, 256\]"):
        run(new_cache(seqs, shape), [(0, 0, 4)], seqs, shape=shape)
    shape = Shape(num_heads=3, num_kv_heads=2, head_dim=16)  # heads do not divide evenly
    seqs = Sequences([1], shape=shape)
    with pytest.raises(RuntimeError, match="multiple of num_kv_heads"):
        run(new_cache(seqs, shape), [(0, 0, 1)], seqs, shape=shape)
    seqs = Sequences([4])
    cache = new_cache(seqs)
    with pytest.raises(ValueError, match="transposed key layout"):
        NativeAttentionBatch(new_cache(seqs, backend="torch"), [SeqAttention(0, 4, seqs.tables[0])],
                             torch.arange(4), SHAPE.num_heads, rope())
    batch = NativeAttentionBatch(cache, [SeqAttention(0, 4, seqs.tables[0])],
                                 torch.arange(4), SHAPE.num_heads, rope())
    with pytest.raises(RuntimeError, match="contiguous fp32/bf16"):
        batch.attend(0, seqs.qkv[0].t().contiguous().t(), SCALE, torch.float32)
    with pytest.raises(RuntimeError, match="contiguous fp32/bf16"):
        batch.attend(0, seqs.qkv[0].half(), SCALE, torch.float32)
    with pytest.raises(RuntimeError, match=r"rows >= 4"):
        batch.attend(0, seqs.qkv[0][:2], SCALE, torch.float32)
    with pytest.raises(ValueError, match="past the RoPE tables"):
        NativeAttentionBatch(cache, [SeqAttention(2000, 4, seqs.tables[0])], torch.arange(4),
                             SHAPE.num_heads, rope())
    with pytest.raises(ValueError, match="1 blocks cannot hold 20 tokens"):
        NativeAttentionBatch(cache, [SeqAttention(16, 4, seqs.tables[0])], torch.arange(4),
                             SHAPE.num_heads, rope())
    with pytest.raises(ValueError, match="block id is outside"):
        NativeAttentionBatch(cache, [SeqAttention(0, 4, [7])], torch.arange(4),
                             SHAPE.num_heads, rope())
    with pytest.raises(ValueError, match="slot is outside"):
        NativeAttentionBatch(cache, [SeqAttention(0, 4, seqs.tables[0])], torch.arange(4) + 16,
                             SHAPE.num_heads, rope())
    with pytest.raises(ValueError, match="3 slots for 4 tokens"):
        NativeAttentionBatch(cache, [SeqAttention(0, 4, seqs.tables[0])], torch.arange(3),
                             SHAPE.num_heads, rope())


def test_backend_choice() -> None:
    cpu = torch.device("cpu")
    assert resolve_attention_backend("auto", cpu, torch.float32) == "native"
    assert resolve_attention_backend("torch", cpu, torch.float32) == "torch"
    assert resolve_attention_backend("auto", cpu, torch.bfloat16) == "torch"
    with pytest.raises(ValueError, match="fp32 on CPU only.*--attention-backend torch"):
        resolve_attention_backend("native", cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="must be one of"):
        resolve_attention_backend("flash", cpu, torch.float32)
    uneven = Shape(num_heads=3, num_kv_heads=2)
    assert resolve_attention_backend("auto", cpu, torch.float32, uneven) == "torch"  # type: ignore[arg-type]
    wide = Shape(num_heads=4, num_kv_heads=4, head_dim=512)
    assert resolve_attention_backend("auto", cpu, torch.float32, wide) == "torch"  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="even head_dim <= 256"):
        resolve_attention_backend("native", cpu, torch.float32, wide)  # type: ignore[arg-type]


def test_a_missing_compiler_is_reported_not_hidden(tmp_path: Path,
                                                   kernel_env: pytest.MonkeyPatch) -> None:
    kernel_env.setenv("LLMESH_KERNEL_CACHE", str(tmp_path))
    kernel_env.setenv("CC", "no-such-cc")
    reason = unavailable_reason(torch.device("cpu"), torch.float32)
    assert reason is not None and "no C compiler 'no-such-cc'" in reason
    # The runner falls back and keeps the reason (the backend logs it).
    tiny = LlamaModel(LlamaConfig(
        name="tiny", hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
        intermediate_size=64, vocab_size=64, rope_theta=1e4, rms_norm_eps=1e-5,
        context_length=64, tie_word_embeddings=True, bos_token_id=None, eos_token_ids=(1,)))
    runner = ModelRunner(tiny, torch.device("cpu"), torch.float32)
    assert runner.attention_backend == "torch"
    assert "no C compiler" in (runner.native_unavailable_reason or "")
    assert resolve_attention_backend("auto", torch.device("cpu"), torch.float32) == "torch"
    with pytest.raises(ValueError, match="no C compiler"):
        resolve_attention_backend("native", torch.device("cpu"), torch.float32)
    with pytest.raises(NativeKernelUnavailable):
        load_library()


def test_an_unwritable_cache_folder_is_reported(tmp_path: Path,
                                                kernel_env: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    kernel_env.setenv("LLMESH_KERNEL_CACHE", str(blocker / "kernels"))
    reason = unavailable_reason(torch.device("cpu"), torch.float32)
    assert reason is not None and "LLMESH_KERNEL_CACHE" in reason


def test_cc_may_carry_arguments(tmp_path: Path, kernel_env: pytest.MonkeyPatch) -> None:
    """``CC`` with arguments builds, and its arguments are part of the cache key
    (``-mno-avx512vnni`` selects other code: it must not reuse the default build)."""
    kernel_env.setenv("LLMESH_KERNEL_CACHE", str(tmp_path))
    plain = native.library_path()
    kernel_env.setenv("CC", "env cc")  # like "ccache gcc"
    load_library()
    assert native.library_path().exists() and native.library_path() != plain


def test_a_failed_build_is_tried_once_per_process(tmp_path: Path,
                                                  kernel_env: pytest.MonkeyPatch) -> None:
    """A compiler that fails is run once: later calls re-raise the remembered
    reason (an engine start asks several times) until ``cache_clear``."""
    calls = tmp_path / "calls"
    compiler = tmp_path / "failing-cc"
    compiler.write_text(f"#!/bin/sh\necho run >> {calls}\necho broken >&2\nexit 1\n")
    compiler.chmod(0o755)
    kernel_env.setenv("LLMESH_KERNEL_CACHE", str(tmp_path / "cache"))
    kernel_env.setenv("CC", str(compiler))
    for _ in range(3):
        with pytest.raises(NativeKernelUnavailable, match="broken"):
            load_library()
    builds = [line for line in calls.read_text().splitlines() if line == "run"]
    assert len(builds) == 2  # `cc --version` for the cache key, then the one build


def test_the_build_is_cached_and_keyed_by_the_source(tmp_path: Path,
                                                     kernel_env: pytest.MonkeyPatch) -> None:
    kernel_env.setenv("LLMESH_KERNEL_CACHE", str(tmp_path))
    path = native.library_path()
    assert path.parent == tmp_path and not path.exists()
    load_library()
    assert path.exists()
    built = path.stat().st_mtime_ns
    load_library.cache_clear()
    load_library()
    assert path.stat().st_mtime_ns == built  # not rebuilt


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("delta_dtype", [None, torch.float32, torch.bfloat16])
def test_add_rms_norm_matches_pytorch(delta_dtype: torch.dtype | None,
                                      out_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(9, 576, generator=gen) * 3
    delta = None if delta_dtype is None else torch.randn(9, 576, generator=gen).to(delta_dtype)
    weight = torch.rand(576, generator=gen) + 0.5
    expected_hidden = hidden + (0 if delta is None else delta.float())
    expected = torch.nn.functional.rms_norm(expected_hidden, (576,), weight, 1e-5)
    ours_hidden = hidden.clone()
    out = native.add_rms_norm(ours_hidden, delta, weight, 1e-5, out_dtype)
    assert out.dtype == out_dtype
    assert torch.equal(ours_hidden, expected_hidden)  # the residual add is exact fp32
    torch.testing.assert_close(out.float(), expected.to(out_dtype).float(),
                               rtol=1e-5 if out_dtype == torch.float32 else 1e-2, atol=1e-5)
    # A row's bits do not depend on the other rows.
    for row in (0, 4, 8):
        alone = native.add_rms_norm(hidden[row:row + 1].clone(), None if delta is None
                                    else delta[row:row + 1].contiguous(), weight, 1e-5, out_dtype)
        assert torch.equal(alone[0], out[row])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_pytorch(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(8)
    gate_up = (torch.randn(7, 2 * 40, generator=gen) * 6).to(dtype)  # 40: a partial vector
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    gate, up = gate_up.float().chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    out = native.silu_mul(gate_up, torch.float32)
    torch.testing.assert_close(out, expected, rtol=2e-6, atol=1e-6)
    assert torch.isfinite(out).all()
    bf16 = native.silu_mul(gate_up, torch.bfloat16)
    assert torch.equal(bf16, out.to(torch.bfloat16))  # one rounding, to nearest even
    with pytest.raises(ValueError, match="silu_mul"):
        native.silu_mul(gate_up[:, :79], torch.float32)
    with pytest.raises(ValueError, match="add_rms_norm"):
        native.add_rms_norm(gate_up.float(), None, torch.ones(3), 1e-5, torch.float32)
