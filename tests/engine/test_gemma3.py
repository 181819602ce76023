"""Gemma 3 270M (base, Q4_K_M GGUF) on the torch engine, against transformers.

The reference is transformers' ``Gemma3ForCausalLM`` (its own modeling code:
QK-norm, ``(1 + w)`` norms, GeGLU, sliding-window masks, two RoPE bases) built
with a config from the GGUF metadata and the same dequantized fp32 weights, the
norms given back their ``-1`` (transformers adds it again). Loading
transformers' own GGUF reader as well would cost ~45 s more per run; it was
checked once by hand instead (``AutoModelForCausalLM.from_pretrained(dir,
gguf_file=...)``: the same greedy tokens and last-position top-5 logits to 4
decimals, 2026-12-03), which also confirms the norm convention.

Tolerance: both sides run in fp32 over the same weights; they differ only in
summation order (fused QKV / gate-up projections, our batch-invariant chunked
value sum, the order of the norm's reduction), so logits agree to ~1e-5 of
their scale; 1e-3 of the scale (as for SmolLM2 in ``test_engine_model.py``)
leaves room for other BLAS builds while a real bug (a wrong norm, RoPE base
or mask) moves logits by whole units.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import itertools
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from services.common.sampling import SamplingOptions, SpeculativeMethod, SpeculativeOptions
from services.engine.config import EngineConfig
from services.engine.torch_backend.backend import TorchBackend, resolve_quantization
from services.engine.torch_backend.gemma3 import Gemma3Model
from services.engine.torch_backend.gguf_loader import Gemma3Config, GGUFModel, load_gguf
from services.engine.torch_backend.model import build_model
from services.engine.torch_backend.model_runner import ModelRunner, StepInput
from services.engine.types import SequenceRequest, StepStats
from services.tokenizer.model_parts import gemma3_270m_gguf_path

pytestmark = pytest.mark.model

#: "The capital of France is" with Gemma's BOS (the tokenizer service's ids).
PROMPT = (2, 818, 5279, 529, 7001, 563)
#: transformers' greedy continuation: " the capital of the country of France. It is the".
CONTINUATION = (506, 5279, 529, 506, 2891, 529, 7001, 236761, 1030, 563, 506)
MAX_POSITIONS = 1024
_ids = itertools.count()


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    return gemma3_270m_gguf_path()


@pytest.fixture(scope="module")
def gemma_gguf(gemma_path: Path) -> GGUFModel:
    return load_gguf(gemma_path)


@pytest.fixture(scope="module")
def gemma(gemma_gguf: GGUFModel) -> Gemma3Model:
    model = build_model(gemma_gguf.config, gemma_gguf.state_dict, max_positions=MAX_POSITIONS)
    assert isinstance(model, Gemma3Model)
    return model


@pytest.fixture(scope="module")
def hf_gemma(gemma_gguf: GGUFModel) -> torch.nn.Module:
    """transformers' Gemma 3 with our config and weights (eager attention, fp32)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config: Gemma3Config = gemma_gguf.config  # type: ignore[assignment]
    hf_config = Gemma3TextConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=MAX_POSITIONS, sliding_window=config.sliding_window,
        query_pre_attn_scalar=int(config.query_pre_attn_scalar),
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
        final_logit_softcapping=None, attn_logit_softcapping=None,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": config.rope_theta},
            "sliding_attention": {"rope_type": "default",
                                  "rope_theta": config.rope_local_theta}},
        bos_token_id=2, eos_token_id=1, pad_token_id=0, attn_implementation="eager")
    hf = Gemma3ForCausalLM(hf_config)
    state = {name: (weight - 1 if "norm" in name else weight)
             for name, weight in gemma_gguf.state_dict.items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return hf.eval()


def hf_last_logits(hf: torch.nn.Module, tokens: tuple[int, ...]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([tokens]), logits_to_keep=1).logits[0, -1]


def greedy(runner: ModelRunner, prompt: tuple[int, ...], steps: int,
           chunk: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens after ``prompt`` (prefilled in ``chunk``-token pieces into
    blocks used in reversed order) and the logits of the prompt's last position."""
    cache = runner.kv_cache
    assert cache is not None
    blocks = list(reversed(range(cache.num_blocks)))
    for start in range(0, len(prompt), chunk):
        logits = runner.run([StepInput(prompt[start:start + chunk], start, blocks)])
    prompt_logits = logits[0]
    tokens = [int(prompt_logits.argmax())]
    for _ in range(steps - 1):
        logits = runner.run([StepInput(tokens[-1:], len(prompt) + len(tokens) - 1, blocks)])
        tokens.append(int(logits[0].argmax()))
    return tokens, prompt_logits


def close(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """Largest logit difference as a fraction of the reference's largest logit."""
    return (ours - reference).abs().max().item() / reference.abs().max().item()


def test_config_is_read_from_gguf(gemma_gguf: GGUFModel, gemma_path: Path) -> None:
    # --quantization auto (the default) serves it dense: its K-quants are not requantized.
    assert resolve_quantization(EngineConfig(model_path=gemma_path)).quantization == "none"
    config = gemma_gguf.config
    assert isinstance(config, Gemma3Config)
    assert (config.vocab_size, config.hidden_size, config.num_layers, config.head_dim) == (
        262144, 640, 18, 256)
    assert (config.num_heads, config.num_kv_heads, config.sliding_window) == (4, 1, 512)
    assert (config.rope_theta, config.rope_local_theta) == (1e6, 1e4)
    assert config.eos_token_ids == (1,) and config.tie_word_embeddings
    assert [i for i in range(18) if not config.is_sliding(i)] == [5, 11, 17]
    # llama.cpp stored the norms with Gemma's +1 (HF's raw q_norm weights are near 0).
    assert gemma_gguf.state_dict["model.layers.0.self_attn.q_norm.weight"].mean() > 0.5


def test_greedy_and_logits_match_transformers(gemma: Gemma3Model,
                                              hf_gemma: torch.nn.Module) -> None:
    runner = ModelRunner(gemma, torch.device("cpu"), torch.float32)
    runner.allocate_kv_cache(1 << 20, block_size=4)
    tokens, logits = greedy(runner, PROMPT, len(CONTINUATION), chunk=len(PROMPT))
    assert tokens == list(CONTINUATION)  # " the capital of the country of France. It is the"
    # transformers' greedy choice at each position, in one teacher-forced forward.
    with torch.inference_mode():
        reference = hf_gemma(torch.tensor([PROMPT + CONTINUATION[:-1]]),
                             logits_to_keep=len(CONTINUATION)).logits[0]
    assert reference.argmax(-1).tolist() == list(CONTINUATION)
    assert close(logits, reference[0]) < 1e-3


def test_sliding_window_past_the_window(gemma: Gemma3Model, hf_gemma: torch.nn.Module) -> None:
    """A prompt 5x longer than the local layers' window, prefilled in chunks that
    straddle it, then decoded past it: the window (shrunk to 8 keys on both
    sides so the test stays short) masks what transformers masks."""
    window = 8
    small = copy.copy(gemma)  # shares the weights; only the config differs
    small.config = dataclasses.replace(gemma.config, sliding_window=window)
    hf_gemma.config.sliding_window = window
    try:
        prompt = PROMPT + CONTINUATION + PROMPT[1:] + CONTINUATION + PROMPT[1:]
        assert len(prompt) > 4 * window
        runner = ModelRunner(small, torch.device("cpu"), torch.float32)
        runner.allocate_kv_cache(4 << 20, block_size=4)
        tokens, logits = greedy(runner, prompt, 4, chunk=7)
        assert close(logits, hf_last_logits(hf_gemma, prompt)) < 1e-3
        full = prompt + tuple(tokens[:-1])
        last = runner.run([StepInput(full[-1:], len(full) - 1,
                                     list(reversed(range(runner.kv_cache.num_blocks))))])
        assert close(last[0], hf_last_logits(hf_gemma, full)) < 1e-3
        # The window matters: without it (512 keys > the prompt) logits differ.
        hf_gemma.config.sliding_window = gemma.config.sliding_window
        assert close(logits, hf_last_logits(hf_gemma, prompt)) > 1e-2
    finally:
        hf_gemma.config.sliding_window = gemma.config.sliding_window


@pytest.fixture(scope="module")
def step_stats() -> list[StepStats]:
    """Every step of :func:`gemma_backend`, as its step observer saw it."""
    return []


@pytest_asyncio.fixture(scope="module")
async def gemma_backend(gemma_path: Path, gemma: Gemma3Model,
                        step_stats: list[StepStats]) -> AsyncIterator[TorchBackend]:
    """The engine serving Gemma: dense fp32, n-gram speculation at any batch size,
    small prefill chunks."""
    config = EngineConfig(model_path=gemma_path, quantization="none", max_model_len=MAX_POSITIONS,
                          kv_cache_bytes=32 << 20, max_tokens_cap=64, max_num_batched_tokens=16,
                          speculative_method="ngram", num_speculative_tokens=4,
                          speculative_disable_batch_size=64)
    backend = TorchBackend(config, step_observer=step_stats.append, model=gemma)
    await backend.start()
    yield backend
    await backend.shutdown()


async def generate(backend: TorchBackend, prompt: tuple[int, ...],
                   speculative: SpeculativeOptions = SpeculativeOptions()) -> list[int]:
    request = SequenceRequest(f"gemma-{next(_ids)}", prompt,
                              SamplingOptions(max_tokens=12, ignore_eos=True),
                              speculative=speculative)
    tokens: list[int] = []
    async for delta in backend.generate(request):
        tokens.extend(delta.token_ids)
    return tokens


async def test_engine_serves_gemma(gemma_backend: TorchBackend,
                                   step_stats: list[StepStats]) -> None:
    """Model info; two concurrent speculative requests (one past a 16-token
    prefill chunk) decode exactly like the same requests alone without
    speculation."""
    info = gemma_backend.model_info
    assert (info.vocab_size, info.eos_token_ids, info.max_model_len) == (262144, (1,), 1024)
    repetitive = PROMPT + CONTINUATION + PROMPT[1:] + CONTINUATION
    prompts = (PROMPT, repetitive)
    off = SpeculativeOptions(method=SpeculativeMethod.NONE)
    serial = [await generate(gemma_backend, prompt, off) for prompt in prompts]
    assert serial[0] == list(CONTINUATION) + [7488]
    assert sum(s.spec_num_draft_tokens for s in step_stats) == 0
    together = await asyncio.gather(*(generate(gemma_backend, prompt) for prompt in prompts))
    assert list(together) == serial
    assert max(s.batch_size for s in step_stats) == 2  # they did run together
    assert sum(s.spec_num_accepted_tokens for s in step_stats) > 0
