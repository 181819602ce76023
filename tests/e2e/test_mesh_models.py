"""Two models in one mesh (``llmesh up --model NAME=PATH`` twice): SmolLM2-135M-
Instruct (chat, the default) and the Gemma 3 270M base model, each with its own
tokenizer and engine behind one router and Envoy. Requests route by ``model``;
each model answers in its own vocabulary; ListModels lists both; chat to the
base model is FAILED_PRECONDITION and an unknown model INVALID_ARGUMENT;
``/tokenize`` then ``/detokenize`` round-trips in each model's vocabulary."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from llmesh.v1 import common_pb2, generation_pb2, generation_pb2_grpc

from services.cli.mesh import Mesh
from tests.e2e.shared_mesh import SharedMesh

pytestmark = pytest.mark.mesh

SMOLLM2_VOCAB = 49152
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def two_models(two_model_mesh: SharedMesh) -> Mesh:
    """The shared two-model mesh (tests/e2e/conftest.py), its router plain
    (test_mesh_cascade.py, which runs next, stops it)."""
    return two_model_mesh.get([])


@pytest.fixture(scope="module")
def stub(two_models: Mesh) -> Iterator[generation_pb2_grpc.GenerationServiceStub]:
    with grpc.insecure_channel(two_models.ingress_address) as channel:
        yield generation_pb2_grpc.GenerationServiceStub(channel)


def generate(stub, **request) -> list[generation_pb2.GenerateResponse]:
    return list(stub.Generate(generation_pb2.GenerateRequest(
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=4), **request),
        timeout=120))


def test_each_model_answers_with_its_own_tokenizer(stub) -> None:
    smol = generate(stub, prompt=PROMPT)  # "" is the first model, the default
    gemma = generate(stub, model="gemma3", prompt=PROMPT)
    smol_ids = [t for r in smol for t in r.token_ids]
    gemma_ids = [t for r in gemma for t in r.token_ids]
    assert smol_ids and gemma_ids
    assert max(smol_ids) < SMOLLM2_VOCAB
    # Each pool's ids go through its own model's tokenizer: Gemma's greedy
    # continuation (the one tests/engine/test_gemma3.py checks against
    # transformers) reads as text only in Gemma's vocabulary.
    assert "".join(r.text for r in gemma).startswith(" the capital of")
    assert gemma_ids != smol_ids
    # Gemma's tokenizer adds its BOS (id 2); SmolLM2's raw prompts have none.
    assert gemma[-1].usage.prompt_tokens == smol[-1].usage.prompt_tokens + 1
    chat = generation_pb2.Chat(messages=[common_pb2.ChatMessage(role="user", content="Hi")])
    assert generate(stub, model="smollm2", chat=chat)[-1].finish_reason
    models = stub.ListModels(generation_pb2.ListModelsRequest(), timeout=10).models
    assert [(m.id, m.chat) for m in models] == [("smollm2", True), ("gemma3", False)]


def test_chat_to_the_base_model_and_unknown_models_are_refused(stub) -> None:
    chat = generation_pb2.Chat(messages=[common_pb2.ChatMessage(role="user", content="Hi")])
    with pytest.raises(grpc.RpcError) as no_template:
        generate(stub, model="gemma3", chat=chat)
    assert no_template.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as unknown:
        generate(stub, model="llama-3-8b", prompt=PROMPT)
    assert unknown.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'gemma3', 'smollm2'" in unknown.value.details()


def post(mesh: Mesh, path: str, body: dict) -> dict:
    """POSTs JSON through Envoy's ingress; the JSON answer."""
    request = urllib.request.Request(f"{mesh.http_url}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.loads(reply.read())


@pytest.mark.parametrize("model, bos", [("smollm2", []), ("gemma3", [2])])
def test_tokenize_then_detokenize_round_trips_in_each_models_vocabulary(
        two_models: Mesh, model: str, bos: list[int]) -> None:
    text = "Gemma and SmolLM2 split «naïve» tokens differently: 12345 🚀."
    tokens = post(two_models, "/tokenize", {"model": model, "prompt": text,
                                            "return_token_strs": True})
    ids = tokens["tokens"]
    assert tokens["count"] == len(ids) > 10 and tokens["max_model_len"] == 512
    assert ids[:len(bos)] == bos and len(tokens["token_strs"]) == len(ids)
    back = post(two_models, "/detokenize", {"model": model, "tokens": ids})["prompt"]
    # Special tokens come back as their markup (Gemma's BOS), the rest as sent.
    assert back.endswith(text) and len(back) - len(text) == (5 if bos else 0)
    again = post(two_models, "/tokenize", {"model": model, "prompt": back,
                                           "add_special_tokens": False})["tokens"]
    assert again == ids
    # Chat through the model's own template: SmolLM2's ChatML; Gemma 3 270M is a
    # base model without one (400 naming messages).
    messages = [{"role": "user", "content": text}]
    if model == "smollm2":
        chat = post(two_models, "/tokenize", {"model": model, "messages": messages})
        rendered = post(two_models, "/detokenize", {"model": model, "tokens": chat["tokens"]})
        assert rendered["prompt"].endswith(f"<|im_start|>user\n{text}<|im_end|>\n"
                                           "<|im_start|>assistant\n")
    else:
        with pytest.raises(urllib.error.HTTPError) as info:
            post(two_models, "/tokenize", {"model": model, "messages": messages})
        assert info.value.code == 400
        assert json.loads(info.value.read())["error"]["param"] == "messages"
