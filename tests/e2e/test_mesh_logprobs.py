"""logprobs and prompt_logprobs through Envoy and the router with the real
SmolLM2: greedy tokens are rank 1 and the maximum of their alternatives, every
value equals an in-process forward of the same tokens within 1e-4, token text
is filled in, and a stop string cuts the entries with the ids; a loglikelihood
request shaped as lm-evaluation-harness sends it (``/v1/completions``, prompt
ids, ``echo``, ``logprobs: 1``, ``max_tokens`` 0 or 1) scores the prompt as the
in-process forward does."""

from __future__ import annotations

import json
import urllib.request

import grpc
import openai
import pytest
import torch

from services.cli.mesh import Mesh
from services.common.model_files import default_model_path
from services.common.wire.chat import ChatMessage
from services.engine.config import EngineConfig
from services.engine.torch_backend.backend import resolve_quantization
from services.engine.torch_backend.model_runner import ModelRunner, StepInput
from services.tokenizer.tokenizer import Tokenizer
from tests.e2e.mesh_client import CAPITAL_QUESTION, chat_request
from llmesh.v1 import generation_pb2_grpc

pytestmark = pytest.mark.mesh


@pytest.fixture(scope="module")
def runner(mesh: Mesh) -> ModelRunner:
    """SmolLM2 in process, loaded as the mesh's engine loads it (its defaults)."""
    config = resolve_quantization(EngineConfig())
    loaded = ModelRunner.from_gguf(default_model_path(), quantization=config.quantization,
                                   dense_prefill=config.dense_prefill,
                                   quant_kernel=config.quant_kernel, max_positions=512)
    loaded.allocate_kv_cache(8 << 20, 16)
    return loaded


def stream(channel: grpc.Channel, **sampling: object) -> list:
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    return list(stub.Generate(chat_request(CAPITAL_QUESTION, **sampling), timeout=120))


def forward_logprobs(runner: ModelRunner, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Row j: log-softmax of the logits after token j of prompt + output."""
    tokens = prompt + output
    logits = runner.run([StepInput(tokens, 0, list(range(-(-len(tokens) // 16))),
                                   num_logits=len(tokens), prompt_len=len(prompt))])
    return logits.float().log_softmax(dim=-1)


def test_greedy_logprobs_and_prompt_logprobs_match_an_in_process_forward(
        ingress_channel: grpc.Channel, runner: ModelRunner) -> None:
    responses = stream(ingress_channel, max_tokens=12, logprobs=5, prompt_logprobs=2)
    ids = [t for r in responses for t in r.token_ids]
    entries = [e for r in responses for e in r.logprobs]
    assert len(ids) == len(entries) >= 5
    assert [e.chosen.token_id for e in entries] == ids
    for entry in entries:  # greedy: the chosen token is the most likely one
        assert entry.chosen.rank == 1 and len(entry.top) == 5
        assert entry.chosen.logprob == max(t.logprob for t in entry.top)
        assert entry.top[0].token_id == entry.chosen.token_id and entry.chosen.token
    prompt = list(Tokenizer.load(default_model_path()).apply_chat_template(
        [ChatMessage("user", CAPITAL_QUESTION)]).token_ids)
    assert [len(r.prompt_logprobs) for r in responses][0] == len(prompt) - 1
    assert all(not r.prompt_logprobs for r in responses[1:])
    prompt_entries = responses[0].prompt_logprobs
    assert [e.chosen.token_id for e in prompt_entries] == prompt[1:]
    assert all(len(e.top) == 2 and e.chosen.rank >= 1 for e in prompt_entries)
    reference = forward_logprobs(runner, prompt, ids[:-1])
    expected = [float(reference[j, token]) for j, token in enumerate(prompt[1:] + ids)]
    got = [e.chosen.logprob for e in (*prompt_entries, *entries)]
    assert got == pytest.approx(expected, abs=1e-4)
    text = "".join(r.text for r in responses)
    shown = [e.chosen.token for e in entries if e.chosen.token_id not in (1, 2)]
    if not any(t.startswith("bytes:") for t in shown):
        assert "".join(shown) == text


def test_a_stop_string_cuts_the_entries_with_the_ids(ingress_channel: grpc.Channel) -> None:
    responses = stream(ingress_channel, max_tokens=24, logprobs=0, stop=["Paris"])
    assert responses[-1].matched_stop == "Paris"
    for response in responses:
        assert len(response.logprobs) == len(response.token_ids)
        assert [e.chosen.token_id for e in response.logprobs] == list(response.token_ids)
        assert all(not e.top for e in response.logprobs)
    tokens = [e.chosen.token for r in responses for e in r.logprobs]
    assert "Paris" in "".join(tokens) and "Paris" not in "".join(tokens[:-1])


#: A context and continuation of a few dozen tokens (ASCII: offsets index characters).
SCORED = ("Question: Which planet is known as the red planet, and why does it look red "
          "from Earth?\nAnswer: Mars, because iron oxide dust covers its surface.")


def tokenize(mesh: Mesh, text: str) -> list[int]:
    """The ids of ``text`` from the mesh's ``/tokenize``."""
    request = urllib.request.Request(f"{mesh.http_url}/tokenize",
                                     data=json.dumps({"prompt": text}).encode())
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.loads(reply.read())["tokens"]


def test_a_loglikelihood_request_as_lm_eval_sends_it_scores_the_prompt_as_the_engine_does(
        mesh: Mesh, runner: ModelRunner) -> None:
    ids = tokenize(mesh, SCORED)
    assert 30 <= len(ids) <= 60
    forward = forward_logprobs(runner, ids, [])  # row j: what follows token j
    expected = [float(forward[j, token]) for j, token in enumerate(ids[1:])]
    with openai.OpenAI(base_url=f"{mesh.http_url}/v1", api_key="unused", max_retries=0,
                       timeout=120) as client:
        model = client.models.list().data[0].id
        asked = {"model": model, "echo": True, "logprobs": 1, "temperature": 0.0}
        answers = {
            "ids, max_tokens 0": client.completions.create(prompt=[ids], max_tokens=0, **asked),
            "ids, max_tokens 1": client.completions.create(
                prompt=[ids], max_tokens=1, extra_body={"prompt_logprobs": 1}, **asked),
            "text, max_tokens 1": client.completions.create(prompt=SCORED, max_tokens=1,
                                                            **asked)}
    for case, answer in answers.items():
        choice = answer.choices[0]
        logprobs = choice.logprobs
        generated = 0 if case.endswith("0") else 1
        assert len(logprobs.tokens) == len(ids) + generated, case
        # The first prompt token: nothing predicts it (null, as OpenAI and vLLM answer).
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        assert logprobs.token_logprobs[1:len(ids)] == pytest.approx(expected, abs=1e-4), case
        assert all(len(top) >= 1 for top in logprobs.top_logprobs[1:])
        # SmolLM2 adds no BOS: the text starts with the prompt; offsets index it exactly.
        assert choice.text.startswith(SCORED)
        ends = [*logprobs.text_offset[1:], len(choice.text)]
        assert [choice.text[a:b] for a, b in zip(logprobs.text_offset, ends)] == \
            logprobs.tokens, case
        if generated:  # greedy: the most likely next token, after the prompt's
            assert logprobs.token_logprobs[-1] == pytest.approx(
                float(forward[-1].max()), abs=1e-4)
        assert answer.usage.prompt_tokens == len(ids)
    assert answers["ids, max_tokens 0"].choices[0].text == SCORED
    # vLLM's prompt_logprobs where the client asks for them, only there.
    extra = answers["ids, max_tokens 1"].choices[0].model_extra["prompt_logprobs"]
    assert extra[0] is None and len(extra) == len(ids)
    assert [entry[str(token)]["logprob"] for entry, token in zip(extra[1:], ids[1:])] == \
        pytest.approx(expected, abs=1e-4)
    assert "prompt_logprobs" not in (answers["ids, max_tokens 0"].choices[0].model_extra or {})


def test_a_streamed_echo_joins_to_the_non_streamed_answer(mesh: Mesh) -> None:
    """vLLM streams ``echo``: the prompt (text, and logprobs with the first
    ``null``) on each choice's first chunk, then the generated tokens, offsets
    continuing; joined, the chunks are the non-streamed choice (greedy)."""
    text = SCORED[:60]
    ids = tokenize(mesh, text)
    with openai.OpenAI(base_url=f"{mesh.http_url}/v1", api_key="unused", max_retries=0,
                       timeout=120) as client:
        model = client.models.list().data[0].id
        for prompt in (text, [ids]):
            for max_tokens in (0, 4):
                case = (type(prompt).__name__, max_tokens)
                asked = {"model": model, "prompt": prompt, "echo": True, "logprobs": 1,
                         "temperature": 0.0, "max_tokens": max_tokens}
                whole = client.completions.create(**asked).choices[0]
                chunks = [c.choices[0] for c in client.completions.create(stream=True, **asked)]
                assert chunks[0].text.startswith(text), case  # SmolLM2 adds no BOS
                assert chunks[0].logprobs.token_logprobs[0] is None, case
                joined = {"tokens": [], "token_logprobs": [], "text_offset": []}
                for chunk in chunks:
                    for key, values in joined.items():
                        values.extend(getattr(chunk.logprobs, key) if chunk.logprobs else [])
                assert "".join(c.text for c in chunks) == whole.text, case
                assert joined["tokens"] == whole.logprobs.tokens, case
                assert joined["text_offset"] == whole.logprobs.text_offset, case
                assert joined["token_logprobs"][0] is None, case
                assert joined["token_logprobs"][1:] == pytest.approx(
                    whole.logprobs.token_logprobs[1:], abs=1e-4), case
                assert len(whole.logprobs.tokens) == len(ids) + max_tokens, case
