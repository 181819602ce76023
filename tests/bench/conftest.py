"""Fixtures of the bench tests: the model's tokenizer (loaded once) and the OpenAI stub."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.bench.tokenizer import BenchTokenizer, load_tokenizer
from tests.bench.openai_stub import StubOpenAIServer


@pytest.fixture(scope="session")
def bench_tokenizer() -> BenchTokenizer:
    """SmolLM2's own tokenizer, as ``llmesh bench`` loads it by default."""
    return load_tokenizer(None)


@pytest.fixture
def openai_stub(bench_tokenizer: BenchTokenizer) -> Iterator[StubOpenAIServer]:
    """A fresh OpenAI-compatible stub on a free loopback port (50 ms to the
    first token, 10 ms between tokens)."""
    server = StubOpenAIServer(count_prompt_tokens=lambda text: len(bench_tokenizer.encode(text)))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def cached_tokenizer(monkeypatch: pytest.MonkeyPatch, bench_tokenizer: BenchTokenizer) -> None:
    """Makes in-process ``llmesh bench`` runs reuse the session's tokenizer
    (the same default tokenizer, without 4-8 s of loading per run)."""
    monkeypatch.setattr("services.bench.tokenizer.load_tokenizer", lambda spec: bench_tokenizer)
