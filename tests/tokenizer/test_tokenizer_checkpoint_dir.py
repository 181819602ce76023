"""The tokenizer service on a Hugging Face checkpoint directory (``--model-path DIR``):
the same ids, chat prompts, detokenized text and info as on the GGUF the
tokenizer was saved from, over gRPC."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from benchmarks.random_checkpoint import save_smollm2_tokenizer, save_tiny_llama
from llmesh.v1 import tokenizer_pb2
from services.common.wire.chat import ChatMessage
from services.tokenizer.metrics import TokenizerMetrics
from services.tokenizer.service import TokenizerService
from services.tokenizer.tokenizer import Tokenizer
from tests.tokenizer.tokenizer_helpers import Client, ServerThread

TEXTS = ("Hello, world!", "日本語? e\u0301 👋", "<|im_end|> is text here", "  spaced\n\ttabs ")
CONVERSATIONS = (
    [("system", "Be brief."), ("user", "hi 👋"), ("assistant", "hello"), ("user", "again?")],
    [("user", "no system prompt")],
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's tokenizer saved beside a tiny random model (its config.json)."""
    path = save_tiny_llama(tmp_path_factory.mktemp("smollm2-dir"))
    return save_smollm2_tokenizer(path)


@pytest.fixture(scope="module")
def dir_client(checkpoint: Path) -> Iterator[Client]:
    service = TokenizerService(model_path=checkpoint,
                               metrics=TokenizerMetrics.create(CollectorRegistry()))
    server = ServerThread(service).start()
    client = Client(server.target)
    yield client
    client.close()
    server.stop()


def test_directory_serves_what_the_gguf_serves(smollm: Tokenizer, smollm_client: Client,
                                               dir_client: Client, checkpoint: Path) -> None:
    for text in TEXTS:
        assert dir_client.tokenize(text) == smollm_client.tokenize(text), text
    for messages in CONVERSATIONS:
        for gen in (True, False):
            ours = dir_client.chat(messages, add_generation_prompt=gen)
            reference = smollm.apply_chat_template(
                [ChatMessage(r, c) for r, c in messages], add_generation_prompt=gen)
            assert tuple(ours.token_ids) == reference.token_ids
    ids = smollm.encode(TEXTS[1])
    assert "".join(dir_client.detokenize([ids])) == TEXTS[1]
    request = tokenizer_pb2.GetTokenizerInfoRequest()
    info = dir_client.stub.GetTokenizerInfo(request)
    gguf_info = smollm_client.stub.GetTokenizerInfo(request)
    assert info.model == checkpoint.name
    assert (info.vocab_size, list(info.eos_token_ids), info.bos_token_id,
            info.has_chat_template, list(info.chat_roles)) == (
        gguf_info.vocab_size, list(gguf_info.eos_token_ids), gguf_info.bos_token_id,
        gguf_info.has_chat_template, list(gguf_info.chat_roles))


def test_generation_config_eos_ids_are_added(checkpoint: Path, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text((checkpoint / "config.json").read_text())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (checkpoint / name).is_file():
            (tmp_path / name).write_text((checkpoint / name).read_text())
    assert 7 in Tokenizer.load(tmp_path).info.eos_token_ids


def test_a_directory_without_a_tokenizer_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no GGUF file or checkpoint directory"):
        Tokenizer.load(tmp_path / "absent")
    with pytest.raises((OSError, ValueError)):
        Tokenizer.load(tmp_path)
