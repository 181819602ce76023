"""Two models in one mesh (``llmesh up --model NAME=PATH`` twice): SmolLM2-135M-
Instruct (chat, the default) and the Gemma 3 270M base model, each with its own
tokenizer and engine behind one router and Envoy. Requests route by ``model``;
each model answers in its own vocabulary; ListModels lists both; chat to the
base model is FAILED_PRECONDITION and an unknown model INVALID_ARGUMENT."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from llmesh.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from services.cli.mesh import Mesh, ModelSpec
from services.common.model_files import default_model_path
from services.tokenizer.model_parts import gemma3_270m_gguf_path

pytestmark = pytest.mark.mesh

SMOLLM2_VOCAB = 49152
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def stub(tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[generation_pb2_grpc.GenerationServiceStub]:
    run_dir: Path = tmp_path_factory.mktemp("two-model-mesh")
    with Mesh(ingress_port=0, admin_port=0, run_dir=run_dir,
              models=[ModelSpec("smollm2", str(default_model_path())),
                      ModelSpec("gemma3", str(gemma3_270m_gguf_path()))],
              engine_args=["--max-model-len", "512", "--kv-cache-bytes", str(64 << 20)]
              ) as mesh, grpc.insecure_channel(mesh.ingress_address) as channel:
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
