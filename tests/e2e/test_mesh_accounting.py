"""Token accounting through the whole mesh (Envoy, router, tokenizer, cache,
engine) with the real SmolLM2 model: a stop string completed inside a run of
speculative tokens, cached prompt tokens, and response-cache replays.

The module's own mesh runs its engine with ``--no-speculative-cost-model``
(every proposal is scored): with the cost rule on, whether the engine
speculates at all follows its measured step times and acceptance, and on a
loaded machine (a full suite run, another mesh beside it) multi-row steps
time 2-3.5x a one-row step, so the rule cut the proposals and a free run had
no multi-token step to place a stop in. The tests are about accounting inside
an accepted run, not about that decision, so they pin it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from llmesh.v1 import (
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)
from services.cli.mesh import Mesh

pytestmark = pytest.mark.mesh

NONE = common_pb2.SPECULATIVE_METHOD_NONE
NGRAM = common_pb2.SPECULATIVE_METHOD_NGRAM
DRAFT = common_pb2.SPECULATIVE_METHOD_DRAFT

#: Prompts whose greedy answers repeat the prompt (n-gram proposals are accepted
#: in runs), so that a stop string can complete inside one engine step.
CODE_PROMPT = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
               "def mul(a, b):\n    return a * b\n\n\n")
REPEAT_PROMPT = ("Repeat exactly: the quick brown fox jumps over the lazy dog, "
                 "the quick brown fox jumps over the lazy dog, the quick brown fox")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """The whole mesh, its engine scoring every speculative proposal."""
    run_dir: Path = tmp_path_factory.mktemp("accounting-mesh")
    with Mesh(ingress_port=0, admin_port=0, run_dir=run_dir,
              engine_args=["--no-speculative-cost-model"]) as running:
        yield running


@pytest.fixture(scope="module")
def ingress_channel(mesh: Mesh) -> Iterator[grpc.Channel]:
    """A client channel to this module's mesh (the suite's would start the shared one)."""
    with grpc.insecure_channel(mesh.ingress_address) as channel:
        yield channel


def _request(prompt: str, method: int, *, stop: tuple[str, ...] = (), bypass_cache: bool = True,
             ) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        prompt=prompt, bypass_cache=bypass_cache,
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                           stop=list(stop)),
        speculative=common_pb2.SpeculativeParams(method=method, num_speculative_tokens=8))


def _run(channel: grpc.Channel, request: generation_pb2.GenerateRequest,
         ) -> list[generation_pb2.GenerateResponse]:
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    return list(stub.Generate(request, timeout=120))


def _ids(responses: list[generation_pb2.GenerateResponse]) -> list[int]:
    return [i for r in responses for i in r.token_ids]


def _text(responses: list[generation_pb2.GenerateResponse]) -> str:
    return "".join(r.text for r in responses)


def _decode(mesh: Mesh, ids: list[int]) -> str:
    with grpc.insecure_channel(mesh.services["tokenizer"].grpc_address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        request = tokenizer_pb2.DetokenizeRequest(token_ids=ids, flush=True)
        return "".join(r.text for r in stub.Detokenize(iter([request]), timeout=30))


def _stop_inside_a_run(responses: list[generation_pb2.GenerateResponse]) -> str:
    """A stop string that first occurs in the text of a message carrying 3+ ids
    and ends before that message's last character (so later ids of the same
    step follow it)."""
    full = _text(responses)
    offset = 0
    for response in responses:
        text = response.text
        if len(response.token_ids) >= 3 and len(text) >= 4:
            for start in range(len(text) - 3):
                stop = text[start:start + 2]
                if stop.strip() and full.find(stop) == offset + start:
                    return stop
        offset += len(text)
    raise AssertionError(f"no multi-token step to place a stop in: "
                         f"{[len(r.token_ids) for r in responses]}")


@pytest.mark.parametrize("prompt", [CODE_PROMPT, REPEAT_PROMPT], ids=["code", "repeat"])
def test_a_stop_string_inside_an_accepted_run_bills_only_the_tokens_through_it(
        mesh: Mesh, ingress_channel: grpc.Channel, prompt: str) -> None:
    """Ids, usage and the cached entry are the same with speculation off,
    n-gram and draft: they end at the token that completed the stop string."""
    free_run = _run(ingress_channel, _request(prompt, NGRAM))
    stop = _stop_inside_a_run(free_run)
    results = {}
    for method in (NONE, NGRAM, DRAFT):
        responses = _run(ingress_channel, _request(prompt, method, stop=(stop,)))
        final = responses[-1]
        assert final.finish_reason == common_pb2.FINISH_REASON_STOP
        assert final.matched_stop == stop
        assert final.usage.completion_tokens == len(_ids(responses))
        # The answer stored for this key (bypass_cache refreshes it) replays the same.
        replay = _run(ingress_channel, _request(prompt, NONE, stop=(stop,), bypass_cache=False))
        assert replay[-1].cached
        assert _ids(replay) == _ids(responses)
        assert _text(replay) == _text(responses)
        assert replay[-1].usage.completion_tokens == final.usage.completion_tokens
        results[method] = (_text(responses), _ids(responses), final.usage.completion_tokens)
    assert results[NGRAM] == results[NONE] == results[DRAFT]
    text, ids, _ = results[NONE]
    assert text == _text(free_run)[:_text(free_run).index(stop)]
    assert len(ids) < len(_ids(free_run))
    # The ids end with the token that completed the stop string: one fewer does not hold it.
    assert ids == _ids(free_run)[:len(ids)]
    assert stop in _decode(mesh, ids) and stop not in _decode(mesh, ids[:-1])


def test_cached_prompt_tokens_are_reported_on_a_stop_string_and_on_a_replay(
        ingress_channel: grpc.Channel) -> None:
    prompt = CODE_PROMPT * 3  # several full KV blocks
    first = _run(ingress_channel, _request(prompt, NONE))  # fills the prefix cache
    stop = _text(first)[4:6]
    assert _text(first).find(stop) == 4
    ended = _run(ingress_channel, _request(prompt, NONE, stop=(stop,)))[-1]
    assert ended.matched_stop == stop and not ended.cached
    assert 16 <= ended.usage.cached_prompt_tokens < ended.usage.prompt_tokens
    replay = _run(ingress_channel, _request(prompt, NONE, stop=(stop,), bypass_cache=False))[-1]
    # A replay prefilled nothing: all its prompt tokens count as cached, ``cached`` says why.
    assert replay.cached
    assert replay.usage.cached_prompt_tokens == replay.usage.prompt_tokens
