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
    frozen_query_encoder,
    model_directory,
    query_module,
)
from services.retriever.int8_linear import Int8WeightLinear

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
                                                      ("int8-weights", 2e-3), ("int8", 0.05)])
def test_query_encoder_stays_close_to_encode(embedder: Embedder, reference: np.ndarray,
                                             precision: str, tolerance: float) -> None:
    module = query_module(embedder._encoder, precision)
    if precision == "int8-weights" and bf16_supported():
        linears = [m for m in module.modules() if isinstance(m, torch.nn.Linear)]
        packed = [m for m in module.modules() if isinstance(m, Int8WeightLinear)]
        assert not linears and len(packed) == 36  # 6 layers x (q, k, v, out, up, down)
        assert packed[0].weight.dtype == torch.int8
    if precision == "bf16":
        # Native bf16 gives a bf16 copy; without it (a Xeon without
        # avx512_bf16) the fp32 encoder itself, which must still pass below.
        native = bf16_supported()
        assert (module is embedder._encoder) is (not native)
        assert next(module.parameters()).dtype == (
            torch.bfloat16 if native else torch.float32)
    query = dataclasses.replace(embedder, _query_encoder=frozen_query_encoder(module))
    vectors = np.stack([query.embed_query(text) for text in TEXTS])
    assert vectors.shape == (len(TEXTS), 384) and vectors.dtype == np.float32
    assert np.all((vectors * reference).sum(axis=1) >= 1.0 - tolerance)
    # The nearest text of each query vector is its own text's fp32 vector.
    assert list(np.argmax(vectors @ reference.T, axis=1)) == list(range(len(TEXTS)))


def test_frozen_query_encoder_is_the_eager_module_at_every_length(embedder: Embedder) -> None:
    """The graph is traced on 4 tokens; it must follow any length (1 to 256
    word pieces) and give the eager module's hidden states."""
    frozen = frozen_query_encoder(embedder._encoder)
    assert isinstance(frozen, torch.jit.ScriptModule)
    for length in (1, 4, 17, 256):
        ids = torch.randint(1000, 20000, (1, length))
        with torch.inference_mode():
            eager = embedder._encoder(input_ids=ids).last_hidden_state
            traced = frozen(ids)
        assert traced.shape == eager.shape == (1, length, 384)
        torch.testing.assert_close(traced, eager, atol=1e-4, rtol=1e-4)


def test_unknown_query_precision_is_refused(embedder: Embedder) -> None:
    with pytest.raises(ValueError, match="fp16"):
        query_module(embedder._encoder, "fp16")


def test_int8_weight_linear_is_the_layer_within_its_rounding() -> None:
    """Per output channel the weight is off by at most one step (``scale``: half
    from rounding to int8, the rest from the bf16 scale); the product stays
    within bf16 activations' error of the fp32 layer."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(384, 1536)
    packed = Int8WeightLinear(linear)
    dequantized = packed.weight.float() * packed.scale.float()[:, None]
    assert torch.all((dequantized - linear.weight.detach()).abs()
                     <= packed.scale.float()[:, None])
    x = torch.randn(2, 11, 384)
    with torch.inference_mode():
        expected, got = linear(x), packed(x.bfloat16()).float()
    assert got.shape == (2, 11, 1536)
    cosine = torch.nn.functional.cosine_similarity(got.flatten(), expected.flatten(), dim=0)
    assert cosine > 0.9995
