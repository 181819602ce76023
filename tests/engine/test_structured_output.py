"""Structured output in the torch engine with the real SmolLM2 model: the token
mask, speculation under a grammar, and the compile errors and time bound."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import replace

import grpc
import jsonschema
import pytest
import torch

from services.common.model_files import default_model_path
from services.common.sampling import (
    ConstraintKind,
    FinishReason,
    InvalidRequestError,
    SamplingOptions,
    SpeculativeMethod,
    SpeculativeOptions,
    StructuredOutput,
)
from services.engine.metrics import EngineMetrics
from services.engine.torch_backend.backend import TorchBackend
from services.engine.torch_backend.grammar_mask import GrammarMatcher, apply_token_mask
from services.engine.torch_backend.sampler import SamplingRow
from services.engine.torch_backend.step_sampler import StepRow
from services.engine.torch_backend.structured_output import load_tokenizer
from services.engine.types import SequenceRequest

from .prompts import EOS, STORY
from .test_spec_decode import OracleProposer, counter

pytestmark = pytest.mark.model

VOCAB = 49152
OFF = SpeculativeOptions(SpeculativeMethod.NONE)
NGRAM = SpeculativeOptions(SpeculativeMethod.NGRAM, 3)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 2},
    },
    "required": ["name", "role", "tags"],
    "additionalProperties": False,
}
PERSON_OUTPUT = StructuredOutput(ConstraintKind.JSON_SCHEMA, json.dumps(PERSON))
_ids = itertools.count()


@pytest.fixture(scope="module")
def lltok():
    """The llguidance tokenizer the engine builds from the GGUF (cached per process)."""
    return load_tokenizer(default_model_path(), VOCAB, (0, EOS))


def chat(lltok, text: str) -> tuple[int, ...]:
    """SmolLM2's ChatML around one user message, generation prompt added."""
    return (1, *lltok.tokenize_str(f"user\n{text}"), EOS, 198, 1,
            *lltok.tokenize_str("assistant\n"))


async def run(backend: TorchBackend, prompt, options: SamplingOptions,
              speculative: SpeculativeOptions = SpeculativeOptions()) -> list[int]:
    request = SequenceRequest(f"so-{next(_ids)}", tuple(prompt), options,
                              speculative=speculative)
    tokens: list[int] = []
    async for delta in backend.generate(request):
        tokens.extend(delta.token_ids)
    return tokens


async def matcher(backend: TorchBackend, constraint: StructuredOutput) -> GrammarMatcher:
    compiler = backend.grammar_compiler
    assert compiler is not None
    return await compiler.compile(constraint)


async def test_mask_keeps_only_grammar_tokens_on_constrained_rows_and_follows_proposals(
        torch_backend: TorchBackend, lltok) -> None:
    constraint = StructuredOutput(ConstraintKind.CHOICE, choices=("yes please", "no"))
    grammar = await matcher(torch_backend, constraint)
    compiler = torch_backend.grammar_compiler
    assert compiler is not None
    compiles = compiler.num_compiles
    assert await matcher(torch_backend, constraint) is not grammar  # own state each
    assert compiler.num_compiles == compiles, "the same constraint compiled twice"
    logits = torch.randn(4, VOCAB)
    plain = [StepRow(SamplingRow())] * 4
    assert apply_token_mask(logits, plain) is logits  # unconstrained rows: no work

    yes, please = lltok.tokenize_str("yes"), lltok.tokenize_str(" please")
    rows = [StepRow(SamplingRow()), StepRow(SamplingRow(), (yes[0], 17), grammar=grammar)]
    before = logits.clone()
    out = apply_token_mask(logits, rows)
    assert torch.equal(logits, before), "the input logits were modified"
    assert torch.equal(out[0], logits[0])
    first = set(torch.isfinite(out[1]).nonzero().flatten().tolist())
    assert yes[0] in first and EOS not in first and 17 not in first
    after_yes = set(torch.isfinite(out[2]).nonzero().flatten().tolist())
    assert please[0] in after_yes and yes[0] not in after_yes
    # row 3 follows proposal 17, which the grammar refuses: never read, never empty
    assert torch.equal(torch.isfinite(out[3]), torch.isfinite(out[2]))
    assert torch.equal(out[1][sorted(first)], logits[1][sorted(first)])
    # the matcher is back at its committed state: same masks again (and the
    # torch path for other devices and dtypes agrees with the numpy one)
    assert torch.equal(apply_token_mask(logits, rows), out)
    assert torch.equal(apply_token_mask(logits.double(), rows), out.double())
    for token in yes + please:
        assert grammar.accept(token)
    assert grammar.finished


async def test_greedy_json_is_identical_with_and_without_speculation_and_in_a_batch(
        torch_backend: TorchBackend, engine_metrics: EngineMetrics, lltok) -> None:
    prompt = chat(lltok, "Fill in this JSON for a user named Ann with the tag red: "
                  '{"name": "Ann", "role": "user", "tags": ["red"]}')
    options = SamplingOptions(max_tokens=32, structured_output=PERSON_OUTPUT)
    reference = await run(torch_backend, prompt, options, OFF)
    text = lltok.decode_str(reference[:-1] if reference[-1] == EOS else reference)
    jsonschema.validate(json.loads(text), PERSON)

    drafts = counter(engine_metrics, "spec_decode_num_drafts")
    accepted = counter(engine_metrics, "spec_decode_num_accepted_tokens")
    assert await run(torch_backend, prompt, options, NGRAM) == reference
    assert counter(engine_metrics, "spec_decode_num_drafts") > drafts
    assert counter(engine_metrics, "spec_decode_num_accepted_tokens") > accepted

    # proposals outside the grammar (the unconstrained greedy continuation) are
    # rejected, never emitted; the grammar's own continuation is accepted whole
    free = await run(torch_backend, prompt, SamplingOptions(max_tokens=32), OFF)
    assert free[:len(reference)] != reference
    speculator = torch_backend.speculator
    assert speculator is not None
    saved = speculator.proposers[SpeculativeMethod.NGRAM]
    try:
        speculator.proposers[SpeculativeMethod.NGRAM] = OracleProposer({prompt: free + [0] * 40})
        assert await run(torch_backend, prompt, options, NGRAM) == reference
        speculator.proposers[SpeculativeMethod.NGRAM] = OracleProposer(
            {prompt: reference + [0] * 4})
        accepted = counter(engine_metrics, "spec_decode_num_accepted_tokens")
        assert await run(torch_backend, prompt, options, NGRAM) == reference
        assert counter(engine_metrics, "spec_decode_num_accepted_tokens") - accepted >= (
            len(reference) // 2)
    finally:
        speculator.proposers[SpeculativeMethod.NGRAM] = saved

    # log-probabilities are the model's raw ones: where the grammar overrode the
    # model's favourite, the chosen token ranks below it
    request = SequenceRequest(f"so-{next(_ids)}", prompt, replace(options, logprobs=1),
                              speculative=OFF)
    entries = [entry async for delta in torch_backend.generate(request)
               for entry in delta.logprobs]
    assert [e.chosen.token_id for e in entries] == reference
    assert entries[0].chosen.rank > 1 and entries[0].chosen.logprob < entries[0].top[0].logprob

    # batch-mates (plain and sampled) do not change a constrained request's tokens
    batch = await asyncio.gather(
        run(torch_backend, prompt, options, OFF),
        run(torch_backend, STORY, SamplingOptions(max_tokens=24, temperature=1.0, seed=1)),
        run(torch_backend, STORY, SamplingOptions(max_tokens=24)))
    assert batch[0] == reference
    torch_backend.check_integrity()


@pytest.mark.parametrize("constraint, problem", [
    (StructuredOutput(ConstraintKind.JSON_SCHEMA, '{"type": "objekt"}'), "objekt"),
    (StructuredOutput(ConstraintKind.REGEX, "[0-9]{2"), "regex"),
    (StructuredOutput(ConstraintKind.GRAMMAR, 'start: "a" missing_rule'), "missing_rule"),
])
async def test_a_constraint_that_does_not_compile_is_invalid_argument_naming_the_problem(
        torch_backend: TorchBackend, constraint: StructuredOutput, problem: str) -> None:
    options = SamplingOptions(max_tokens=4, structured_output=constraint)
    with pytest.raises(InvalidRequestError) as info:
        await run(torch_backend, STORY, options)
    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.field == f"sampling.structured_output.{constraint.kind.value}"
    assert problem in str(info.value)


async def test_a_grammar_slower_than_the_bound_is_refused_while_others_are_served(
        torch_backend: TorchBackend) -> None:
    """A 20,000-value enum takes ~0.3 s to compile here (unloaded), 6x the bound;
    a plain request runs meanwhile, and the engine serves constrained ones after."""
    compiler = torch_backend.grammar_compiler
    assert compiler is not None
    huge = {"enum": [f"value-{i}-{i * 7919 % 100003}" for i in range(20_000)]}
    slow = SamplingOptions(max_tokens=4, structured_output=StructuredOutput(
        ConstraintKind.JSON_SCHEMA, json.dumps(huge)))
    saved, compiler.timeout_s = compiler.timeout_s, 0.05
    try:
        began = time.monotonic()
        refused, served = await asyncio.gather(
            run(torch_backend, STORY, slow), run(torch_backend, STORY,
                                                 SamplingOptions(max_tokens=8)),
            return_exceptions=True)
    finally:
        compiler.timeout_s = saved
    assert isinstance(refused, InvalidRequestError), refused
    assert refused.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "0.05 s" in str(refused) and "--structured-output-compile-timeout-s" in str(refused)
    assert isinstance(served, list) and len(served) == 8
    assert time.monotonic() - began < 30
    choice = SamplingOptions(max_tokens=8, structured_output=StructuredOutput(
        ConstraintKind.CHOICE, choices=("alpha", "beta")))
    assert len(await run(torch_backend, STORY, choice)) >= 1


async def test_each_of_n_choices_follows_the_grammar_with_its_own_matcher(
        torch_backend: TorchBackend, lltok) -> None:
    colours = ("red", "green", "blue", "purple")
    options = SamplingOptions(max_tokens=8, temperature=1.0, seed=5, n=4, structured_output=(
        StructuredOutput(ConstraintKind.CHOICE, choices=colours)))
    tokens: dict[int, list[int]] = {i: [] for i in range(4)}
    async for delta in torch_backend.generate(SequenceRequest(f"so-{next(_ids)}", STORY,
                                                              options)):
        tokens[delta.index].extend(delta.token_ids)
    assert all(lltok.decode_str(ids) in colours for ids in tokens.values()), tokens


async def test_a_constraint_that_fails_mid_generation_ends_invalid_argument_with_its_reason(
        torch_backend: TorchBackend) -> None:
    """llguidance's lexer limit is reached only while generating (this regex
    compiles, and its first mask is fine): the request ends with ERROR and an
    INVALID_ARGUMENT status naming the constraint and llguidance's reason, not
    an engine failure (INTERNAL); the engine goes on serving."""
    options = SamplingOptions(max_tokens=8, structured_output=StructuredOutput(
        ConstraintKind.REGEX, "(a{1000}){1000}"))
    request = SequenceRequest(f"so-{next(_ids)}", STORY, options)
    deltas = [delta async for delta in torch_backend.generate(request)]
    last = deltas[-1]
    assert last.finish_reason is FinishReason.ERROR
    assert last.status is grpc.StatusCode.INVALID_ARGUMENT
    assert last.error.startswith("sampling.structured_output: the constraint failed after ")
    assert "simplify it" in last.error and len(last.error) > 120  # llguidance's reason
    assert await run(torch_backend, STORY, SamplingOptions(max_tokens=2))


async def test_min_tokens_extends_a_grammar_and_a_grammar_that_cannot_be_extended_is_refused(
        torch_backend: TorchBackend, lltok) -> None:
    """Issue 30, bug 4: ``min_tokens`` was ignored by constrained requests.
    EOS stays masked until ``min_tokens``, so a grammar that admits more is
    extended (greedy SmolLM2 answers "yes" and EOS without it); one that
    admits nothing more before then ends with INVALID_ARGUMENT naming
    ``min_tokens``, never with a short answer as if it were honoured."""
    prompt = chat(lltok, "Is Paris in France? Answer yes or no.")
    answer = StructuredOutput(ConstraintKind.REGEX, "(yes|no)(, really)*")
    free = await run(torch_backend, prompt, SamplingOptions(max_tokens=12,
                                                            structured_output=answer))
    assert lltok.decode_str(free) == "yes<|im_end|>"  # the model's own choice: EOS at once
    held = await run(torch_backend, prompt, SamplingOptions(max_tokens=12, min_tokens=10,
                                                            structured_output=answer))
    assert len(held) >= 10 and lltok.decode_str(held).startswith("yes, really, really")
    one = SamplingOptions(max_tokens=40, min_tokens=5,
                          structured_output=StructuredOutput(ConstraintKind.REGEX, "[0-9]"))
    deltas = [d async for d in torch_backend.generate(SequenceRequest(f"so-{next(_ids)}",
                                                                      STORY, one))]
    last = deltas[-1]
    assert last.finish_reason is FinishReason.ERROR
    assert last.status is grpc.StatusCode.INVALID_ARGUMENT
    assert last.error.startswith("sampling.min_tokens: the output constraint "
                                 "(sampling.structured_output) admits no token after 1 ")
