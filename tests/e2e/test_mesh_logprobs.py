"""logprobs and prompt_logprobs through Envoy and the router with the real
SmolLM2: greedy tokens are rank 1 and the maximum of their alternatives, every
value equals an in-process forward of the same tokens within 1e-4, token text
is filled in, and a stop string cuts the entries with the ids."""

from __future__ import annotations

import grpc
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
