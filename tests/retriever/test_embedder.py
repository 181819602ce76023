"""The embedder's own path (fast tokenizer + BERT encoder + mean pooling) against
sentence-transformers' ``encode``, in process on the real all-MiniLM-L6-v2."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from services.retriever.embedder import (
    Embedder,
    bf16_supported,
    model_directory,
    query_encoder_of,
)

TEXTS = [
    "who was the father of David",
    "In the beginning God created the heaven and the earth.",
    "a",
    "And the LORD spake unto Moses, saying, " * 40,  # past 256 word pieces: truncated
]


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return Embedder.load(batch_size=3)  # batches of 3: padding and order across batches


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_directory()), device="cpu", local_files_only=True)
    return np.asarray(model.encode(TEXTS, normalize_embeddings=True), dtype=np.float32)


def test_embed_equals_sentence_transformers_encode(embedder: Embedder,
                                                   reference: np.ndarray) -> None:
    vectors = embedder.embed(TEXTS)
    assert vectors.shape == (len(TEXTS), 384) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose((vectors * reference).sum(axis=1), 1.0, atol=1e-5)


@pytest.mark.parametrize(("precision", "tolerance"), [("fp32", 1e-5), ("bf16", 2e-4),
                                                      ("int8", 0.05)])
def test_query_encoder_stays_close_to_encode(embedder: Embedder, reference: np.ndarray,
                                             precision: str, tolerance: float) -> None:
    encoder = query_encoder_of(embedder._encoder, precision)
    if precision == "bf16":
        # Native bf16 gives a bf16 copy; without it (a Xeon without
        # avx512_bf16) the fp32 encoder itself, which must still pass below.
        native = bf16_supported()
        assert (encoder is embedder._encoder) is (not native)
        assert next(encoder.parameters()).dtype == (
            torch.bfloat16 if native else torch.float32)
    query = dataclasses.replace(embedder, _query_encoder=encoder)
    vectors = np.stack([query.embed_query(text) for text in TEXTS])
    assert vectors.shape == (len(TEXTS), 384) and vectors.dtype == np.float32
    assert np.all((vectors * reference).sum(axis=1) >= 1.0 - tolerance)
    # The nearest text of each query vector is its own text's fp32 vector.
    assert list(np.argmax(vectors @ reference.T, axis=1)) == list(range(len(TEXTS)))


def test_unknown_query_precision_is_refused(embedder: Embedder) -> None:
    with pytest.raises(ValueError, match="fp16"):
        query_encoder_of(embedder._encoder, "fp16")
