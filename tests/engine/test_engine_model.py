"""Our GGUF loader and Llama forward against Hugging Face transformers' reading of
the same file, and the torch backend's greedy decoding against ``generate``."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from services.common.sampling import FinishReason, SamplingOptions
from services.engine.config import EngineConfig
from services.engine.torch_backend.backend import TorchBackend
from services.engine.torch_backend.gguf_loader import (
    GGUFModel,
    PlainArrayReader,
    dequantize,
    unpermute_rope_rows,
)
from services.engine.torch_backend.model import LlamaModel, build_model
from services.engine.torch_backend.model_runner import ModelRunner, StepInput
from services.engine.torch_backend.native import load_library
from services.engine.torch_backend.native_attention import NativeAttentionBatch
from services.engine.torch_backend.paged_kv import (
    AttentionBatch,
    PagedKVCache,
    SeqAttention,
    StepAttention,
)
from services.engine.types import SequenceRequest

from .prompts import STORY

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def model(smollm2_fp32: LlamaModel) -> LlamaModel:
    return smollm2_fp32


@pytest.fixture(scope="module")
def hf_model(model_path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_path.parent, gguf_file=model_path.name,
                                              dtype=torch.float32)
    return hf.eval()


@pytest.fixture(scope="module")
def hf_logits(hf_model: torch.nn.Module) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([STORY])).logits[0]


@pytest.fixture(params=["torch", "native"])
def attention_backend(request: pytest.FixtureRequest) -> str:
    if request.param == "native":
        load_library()  # builds it; a failure here is a failure, not a skip
    return str(request.param)


def our_logits(model: LlamaModel, tokens: tuple[int, ...], chunks: tuple[int, ...],
               backend: str = "torch") -> torch.Tensor:
    """Logits ``[len(tokens), vocab]`` at every position, computing the prompt in
    chunks of the given sizes (later chunks attend to the cached keys) through a
    paged KV cache of 4-token blocks used in reversed order, with the ``torch``
    or ``native`` attention backend."""
    config = model.config
    cache = PagedKVCache(config, num_blocks=-(-len(tokens) // 4), block_size=4,
                         transposed_keys=backend == "native")
    blocks = list(reversed(range(cache.num_blocks)))
    out, start = [], 0
    for size in chunks:
        positions = range(start, start + size)
        slots = torch.tensor([blocks[p // 4] * 4 + p % 4 for p in positions])
        seqs = [SeqAttention(start, size, blocks)]
        attention: StepAttention
        if backend == "native":
            attention = NativeAttentionBatch(cache, seqs, slots, config.num_heads, model.rope)
        else:
            attention = AttentionBatch(cache, seqs, slots, config.num_heads // config.num_kv_heads,
                                       torch.tensor(positions), model.rope)
        out.append(model(torch.tensor(tokens[start:start + size]), attention,
                         torch.arange(size)))
        start += size
    return torch.cat(out)


def test_config_is_read_from_gguf_metadata(gguf_model: GGUFModel) -> None:
    config = gguf_model.config
    assert (config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads,
            config.head_dim, config.intermediate_size, config.vocab_size) == (
        576, 30, 9, 3, 64, 1536, 49152)
    assert config.rope_theta == 100000.0
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert config.context_length == 8192
    assert config.tie_word_embeddings is True
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))
    assert "lm_head.weight" not in gguf_model.state_dict


def test_the_engine_reader_walks_over_metadata_arrays(model_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Every engine start reads the GGUF: the vocabulary and merges (~150,000
    array items for SmolLM2) are walked over, not read one numpy view each
    (0.66 s a start), and the tensors are found where ``gguf``'s own reader
    (here over the same plain view: ~4 s less on a memmap) finds them."""

    class FullReader(PlainArrayReader):
        _get_field_parts = gguf.GGUFReader._get_field_parts

        def __init__(self, path: str) -> None:
            gguf.GGUFReader.__init__(self, path)

    reference = FullReader(str(model_path))
    views = 0
    read = PlainArrayReader._get

    def counted(self: PlainArrayReader, *args: object, **kwargs: object) -> np.ndarray:
        nonlocal views
        views += 1
        return read(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(PlainArrayReader, "_get", counted)
    reader = PlainArrayReader(str(model_path))
    assert views < 5_000  # ~40 metadata values and 272 tensors' headers
    assert "tokenizer.ggml.tokens" in reference.fields
    assert not any(field.types[0] == gguf.GGUFValueType.ARRAY for field in reader.fields.values())
    assert reader.data_offset == reference.data_offset
    assert [(t.name, t.tensor_type, t.data_offset) for t in reader.tensors] == [
        (t.name, t.tensor_type, t.data_offset) for t in reference.tensors]
    assert {name: field.contents() for name, field in reader.fields.items()} == {
        name: field.contents() for name, field in reference.fields.items()
        if field.types[0] != gguf.GGUFValueType.ARRAY}


def test_dequantizing_the_embedding_takes_a_few_calls_and_gives_gguf_s_numbers(
        model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM2's Q8_0 embedding ``[49152, 576]``: the same fp32 values as
    ``gguf.quants.dequantize``, from a few large groups of rows (gguf's own
    groups of 16 rows made 3,072 Python calls, ~1.2 s of every start)."""
    embedding = next(t for t in PlainArrayReader(str(model_path)).tensors
                     if t.name == "token_embd.weight")
    assert embedding.tensor_type == gguf.GGMLQuantizationType.Q8_0
    expected = gguf.quants.dequantize(embedding.data, embedding.tensor_type)
    calls = 0
    per_rows = gguf.quants.Q8_0.dequantize_rows

    def counted(rows: np.ndarray) -> np.ndarray:
        nonlocal calls
        calls += 1
        return per_rows(rows)

    monkeypatch.setattr(gguf.quants.Q8_0, "dequantize_rows", counted)
    weights = dequantize(embedding)
    assert calls <= 32
    assert weights.shape == (49152, 576) and weights.dtype == np.float32
    assert weights.flags.c_contiguous and weights.flags.writeable
    assert np.array_equal(weights, expected.reshape(weights.shape))


def test_unpermute_inverts_llama_cpp_permute() -> None:
    weights = np.arange(4 * 8 * 3, dtype=np.float32).reshape(4 * 8, 3)
    n_head = 4
    # convert_hf_to_gguf.py's permute, applied to HF-layout rows.
    permuted = (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, 3)
                .swapaxes(1, 2).reshape(weights.shape))
    assert not np.array_equal(permuted, weights)
    np.testing.assert_array_equal(unpermute_rope_rows(permuted, n_head), weights)


def test_qk_weights_match_transformers_layout(gguf_model: GGUFModel,
                                              hf_model: torch.nn.Module) -> None:
    hf_state = hf_model.state_dict()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.29.self_attn.k_proj.weight", "model.layers.7.mlp.down_proj.weight"):
        torch.testing.assert_close(gguf_model.state_dict[name], hf_state[name], rtol=0, atol=0)


def test_logits_match_transformers(model: LlamaModel, hf_logits: torch.Tensor,
                                   attention_backend: str) -> None:
    ours = our_logits(model, STORY, (len(STORY),), attention_backend)
    assert ours.shape == hf_logits.shape == (len(STORY), 49152)
    scale = hf_logits.abs().max().item()
    assert (ours - hf_logits).abs().max().item() < 1e-3 * scale
    assert torch.equal(ours.argmax(-1), hf_logits.argmax(-1))


def test_chunked_prefill_matches_one_shot(model: LlamaModel, hf_logits: torch.Tensor,
                                          attention_backend: str) -> None:
    # 10-token chunk, 12-token chunk (attends to cached keys), then one decode token.
    ours = our_logits(model, STORY, (10, 12, 1), attention_backend)
    scale = hf_logits.abs().max().item()
    assert (ours - hf_logits).abs().max().item() < 1e-3 * scale


def test_bfloat16_model_tracks_float32(gguf_model: GGUFModel, hf_logits: torch.Tensor) -> None:
    bf16 = build_model(gguf_model.config, gguf_model.state_dict, dtype=torch.bfloat16,
                       max_positions=64)
    runner = ModelRunner(bf16, torch.device("cpu"), torch.bfloat16)
    runner.allocate_kv_cache(4 << 20, block_size=16)
    logits = runner.run([StepInput(STORY, 0, [0, 1])])
    assert logits.dtype == torch.bfloat16 and logits.shape == (1, 49152)
    reference = hf_logits[-1]
    top10 = set(reference.topk(10).indices.tolist())
    assert int(logits[0].float().argmax()) in top10
    assert (logits[0].float() - reference).abs().max().item() < 0.1 * reference.abs().max().item()


async def test_greedy_continuation_matches_transformers(
        model: LlamaModel, engine_config: EngineConfig, hf_model: torch.nn.Module) -> None:
    """The fp32 engine (``--quantization none``) greedy-decodes like transformers
    token for token (the quantized modes are held to the quality guard instead,
    ``test_quality_guard.py``)."""
    backend = TorchBackend(replace(engine_config, quantization="none"), model=model)
    await backend.start()
    request = SequenceRequest("greedy-vs-hf", STORY,
                              SamplingOptions(max_tokens=32, ignore_eos=True))
    ours: list[int] = []
    try:
        async for delta in backend.generate(request):
            ours.extend(delta.token_ids)
    finally:
        await backend.shutdown()
    assert delta.finish_reason is FinishReason.LENGTH
    with torch.inference_mode():
        generated = hf_model.generate(torch.tensor([STORY]), do_sample=False, max_new_tokens=32,
                                      min_new_tokens=32, attention_mask=torch.ones(1, len(STORY)))
    assert ours == generated[0, len(STORY):].tolist()
