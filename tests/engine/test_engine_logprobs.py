"""Log-probabilities in the torch engine (services.engine.torch_backend.logprobs):
the arithmetic on fixed logits, then with the real SmolLM2 weights: equal with
and without speculative decoding, prompt log-probabilities across chunked
prefill equal one full forward, and a prompt_logprobs request takes no
prefix-cache hit while still storing its blocks."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence

import pytest
import torch

from services.common.logprobs import PositionLogprobs
from services.common.sampling import SamplingOptions, SpeculativeMethod, SpeculativeOptions
from services.engine.metrics import EngineMetrics
from services.engine.torch_backend.backend import TorchBackend
from services.engine.torch_backend.logprobs import position_logprobs
from services.engine.torch_backend.model import LlamaModel
from services.engine.torch_backend.model_runner import ModelRunner, StepInput
from services.engine.types import SequenceRequest, TokenDelta

_ids = itertools.count()
#: A prompt the n-gram proposer predicts well (it repeats); the shared backend
#: (64-token steps) prefills it in 2 chunks.
REPEATING = tuple(itertools.islice(itertools.cycle([504, 3458, 314, 253, 1345, 30]), 100))
#: Its tokens a prefix-cache hit can cover (6 full blocks of 16, its last token computed).
CACHEABLE = 96


def test_k_0_gives_the_chosen_token_only_with_its_rank() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    entries = position_logprobs(logits, [2, 2], 0)
    expected = logits.log_softmax(dim=-1)
    assert [e.top for e in entries] == [(), ()]
    assert [e.chosen.rank for e in entries] == [2, 1]
    assert [e.chosen.token_id for e in entries] == [2, 2]
    assert entries[0].chosen.logprob == pytest.approx(float(expected[0, 2]), abs=1e-7)


def test_k_20_gives_20_alternatives_most_likely_first_with_their_ranks() -> None:
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 1000, generator=generator, dtype=torch.bfloat16)
    chosen = [5, int(logits[1].float().argmax()), 999]
    entries = position_logprobs(logits, chosen, 20)
    exact = logits.float().log_softmax(dim=-1)
    for row, entry in enumerate(entries):
        values = [t.logprob for t in entry.top]
        assert len(entry.top) == 20 and values == sorted(values, reverse=True)
        assert [t.rank for t in entry.top] == list(range(1, 21))
        assert values[0] == pytest.approx(float(exact[row].max()), abs=1e-6)
        assert entry.chosen.rank == int((exact[row] > exact[row, chosen[row]]).sum()) + 1
        for item in entry.top:
            assert item.logprob == pytest.approx(float(exact[row, item.token_id]), abs=1e-6)
    assert entries[1].chosen.rank == 1 and entries[1].chosen == entries[1].top[0]
    with pytest.raises(ValueError):
        position_logprobs(logits, [1], 0)


async def run(backend: TorchBackend, prompt: Sequence[int], options: SamplingOptions,
              method: SpeculativeMethod = SpeculativeMethod.NONE
              ) -> tuple[list[int], list[PositionLogprobs], list[TokenDelta]]:
    request = SequenceRequest(f"lp-{next(_ids)}", tuple(prompt), options,
                              speculative=SpeculativeOptions(method))
    deltas = [delta async for delta in backend.generate(request)]
    tokens = [t for d in deltas for t in d.token_ids]
    return tokens, [e for d in deltas for e in d.logprobs], deltas


def accepted(metrics: EngineMetrics) -> float:
    value = metrics.registry.get_sample_value("llmesh:spec_decode_num_accepted_tokens_total")
    return value or 0.0


@pytest.fixture
def every_proposal_verified(torch_backend: TorchBackend) -> Iterator[None]:
    """The shared backend's cost rule off during one test: every proposal is
    verified. With the rule on, whether a proposal runs depends on the step
    times the backend measured before (the session's earlier tests, the
    machine's load): under pytest-xdist it once declined them all."""
    speculator = torch_backend.speculator
    assert speculator is not None
    saved = speculator.config
    speculator.config = dataclasses.replace(saved, cost_model=False)
    try:
        yield
    finally:
        speculator.config = saved


@pytest.mark.model
@pytest.mark.usefixtures("every_proposal_verified")
async def test_logprobs_are_the_same_with_speculative_decoding(
        torch_backend: TorchBackend, engine_metrics: EngineMetrics) -> None:
    backend, metrics = torch_backend, engine_metrics
    options = SamplingOptions(max_tokens=24, logprobs=5)
    tokens, plain, _ = await run(backend, REPEATING, options)
    before = accepted(metrics)
    spec_tokens, speculated, _ = await run(backend, REPEATING, options, SpeculativeMethod.NGRAM)
    assert accepted(metrics) - before >= 5  # accepted runs were scored in one forward
    assert spec_tokens == tokens and len(plain) == len(tokens) == 24
    assert speculated == plain  # exact: every value from its own target row
    assert [e.chosen.token_id for e in plain] == tokens
    assert all(e.chosen.rank == 1 and e.chosen == e.top[0] for e in plain)  # greedy
    # seeded sampling: the chosen tokens' ranks vary, values still equal
    seeded = SamplingOptions(max_tokens=16, logprobs=2, temperature=1.0, seed=11)
    _, sampled, _ = await run(backend, REPEATING, seeded)
    _, sampled_spec, _ = await run(backend, REPEATING, seeded, SpeculativeMethod.NGRAM)
    assert sampled_spec == sampled


@pytest.mark.model
async def test_prompt_logprobs_across_chunks_equal_one_full_forward(
        torch_backend: TorchBackend, smollm2: LlamaModel) -> None:
    backend = torch_backend
    warm = SamplingOptions(max_tokens=1)
    await run(backend, REPEATING, warm)  # its blocks are now in the prefix cache
    _, _, cached = await run(backend, REPEATING, warm)
    assert cached[-1].num_cached_tokens == CACHEABLE
    options = SamplingOptions(max_tokens=3, prompt_logprobs=3, logprobs=0)
    tokens, entries, deltas = await run(backend, REPEATING, options)
    assert deltas[0].num_cached_tokens == 0  # no hit: cached positions have no logits
    assert [len(d.prompt_logprobs) for d in deltas] == [len(REPEATING) - 1] + [0] * (len(deltas) - 1)
    prompt_entries = deltas[0].prompt_logprobs
    assert [e.chosen.token_id for e in prompt_entries] == list(REPEATING[1:])
    assert all(len(e.top) == 3 for e in prompt_entries)
    assert [e.top for e in entries] == [()] * 3  # logprobs=0: the chosen token only
    # one forward over prompt + output (prompt_len marks the prompt's projections)
    runner = ModelRunner(smollm2, smollm2.embed_tokens.device, smollm2.embed_tokens.dtype)
    runner.allocate_kv_cache(8 << 20, 16)
    full = list(REPEATING) + tokens[:-1]
    logits = runner.run([StepInput(full, 0, list(range(-(-len(full) // 16))), num_logits=len(full),
                                   prompt_len=len(REPEATING))])
    reference = logits.float().log_softmax(dim=-1)
    got = [e.chosen.logprob for e in (*prompt_entries, *entries)]
    want = [float(reference[j, token]) for j, token in enumerate(full[1:] + tokens[-1:])]
    assert got == pytest.approx(want, abs=1e-4)
    _, _, again = await run(backend, REPEATING, warm)  # it stored its blocks as usual
    assert again[-1].num_cached_tokens == CACHEABLE
    backend.check_integrity()
