"""Retrieval at the OpenAI edge: the chat body's ``retrieval`` extension and
``POST /v1/embeddings``.

The extension (chat completions only)::

    "retrieval": {"collection": "docs", "top_k": 4,
                  "filter": {"lang": "en"}, "on_failure": "fail" | "degrade"}

is ``GenerateRequest.retrieval``; the response carries ``llmesh_retrieval``
(:meth:`RetrievalReport.openai_body`: the chunks used, the inserted
message, whether it degraded, the latency in ms) at its top level, or on each
choice's last chunk when streamed, and a non-streamed response the headers
``x-llmesh-retrieval-ms`` (the Query call) and ``x-llmesh-retrieval-wait-ms``
(what it added to TTFT).

``POST /v1/embeddings`` follows OpenAI's shape: ``input`` a string or a list
of 1..2048 strings, ``model`` (optional; when set it must name the
retriever's embedding model, else 404 ``model_not_found``),
``encoding_format`` ``float`` (default) or ``base64`` (little-endian float32,
as OpenAI encodes it), ``user`` ignored; ``dimensions`` and token-id inputs
are refused (400). The answer: ``{"object": "list", "data": [{"object":
"embedding", "index", "embedding"}], "model", "usage": {"prompt_tokens",
"total_tokens"}}``. The retriever's ``Embed`` computes them.
"""

from __future__ import annotations

import base64
import re
import struct
import time
from collections.abc import Mapping
from typing import Any

import grpc

from llmesh.v1 import generation_pb2
from services.common.sampling import InvalidRequestError
from services.router.clients import UpstreamError
from services.router.generation import upstream_to_generation_error
from services.router.retrieval.client import to_struct
from services.router.retrieval.report import RetrievalReport
from services.router.retrieval.stage import RetrievalStage, no_retriever

#: The route of OpenAI's embeddings endpoint.
EMBEDDINGS_PATH = "/v1/embeddings"
#: OpenAI's limit on inputs per embeddings request.
MAX_EMBEDDING_INPUTS = 2048
#: Longest an embeddings call waits for the retriever without a client deadline.
EMBED_TIMEOUT_S = 30.0
_RETRIEVAL_KEYS = frozenset({"collection", "top_k", "filter", "on_failure"})
_EMBEDDING_KEYS = frozenset({"input", "model", "encoding_format", "user", "dimensions"})
_POLICIES = {"fail": generation_pb2.RETRIEVAL_FAILURE_POLICY_FAIL,
             "degrade": generation_pb2.RETRIEVAL_FAILURE_POLICY_DEGRADE}


def parse_retrieval(value: object, out: generation_pb2.Retrieval) -> None:
    """The chat body's ``retrieval`` object into ``out``.

    Raises:
      InvalidRequestError: naming ``retrieval`` or ``retrieval.<key>``.
    """
    if not isinstance(value, dict):
        raise InvalidRequestError("retrieval", "must be an object with `collection` (and "
                                  "`top_k`, `filter`, `on_failure`)")
    unknown = sorted(set(value) - _RETRIEVAL_KEYS)
    if unknown:
        raise InvalidRequestError(f"retrieval.{unknown[0]}", "unknown key; retrieval takes "
                                  f"{', '.join(sorted(_RETRIEVAL_KEYS))}")
    collection = value.get("collection")
    if not isinstance(collection, str):
        raise InvalidRequestError("retrieval.collection", "must be a string")
    out.collection = collection
    top_k = value.get("top_k", 0)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise InvalidRequestError("retrieval.top_k", "must be a non-negative integer")
    out.top_k = min(top_k, 2**32 - 1)
    flt = value.get("filter")
    if flt is not None:
        if not isinstance(flt, dict):
            raise InvalidRequestError("retrieval.filter", "must be an object of "
                                      "metadata field -> value")
        out.filter.CopyFrom(to_struct(flt))
    policy = value.get("on_failure", "fail")
    if policy not in _POLICIES:
        raise InvalidRequestError("retrieval.on_failure", 'must be "fail" or "degrade"')
    out.on_failure = _POLICIES[policy]


def retrieval_headers(report: RetrievalReport | None) -> dict[str, str]:
    """The non-streamed response's retrieval headers (none without retrieval)."""
    if report is None:
        return {}
    return {"x-llmesh-retrieval-ms": f"{report.call_ms:.3f}",
            "x-llmesh-retrieval-wait-ms": f"{report.wait_ms:.3f}"}


async def embeddings(stage: RetrievalStage | None, data: Mapping[str, Any], *,
                     request_id: str, deadline: float | None) -> dict[str, Any]:
    """``POST /v1/embeddings``'s answer (module doc).

    Raises:
      InvalidRequestError: a bad body (naming ``input``, ``input[i]``,
        ``model``, ``encoding_format``, ``dimensions``), FAILED_PRECONDITION
        without a retriever.
      GenerationError: the retriever failed (UNAVAILABLE, DEADLINE_EXCEEDED).
    """
    if stage is None or stage.client is None:
        raise no_retriever()
    texts, encoding = _embedding_input(data)
    timeout = EMBED_TIMEOUT_S if deadline is None else deadline - time.monotonic()
    try:
        answer = await stage.client.embed(texts, request_id=request_id, timeout=timeout)
    except UpstreamError as err:
        raise _embed_error(err) from None
    model = data.get("model") or answer.model
    if model != answer.model and not answer.model.endswith(f"/{model}"):
        raise InvalidRequestError("model", f"the embedding model is {answer.model!r}, not "
                                  f"{model!r}", grpc.StatusCode.NOT_FOUND)
    return {"object": "list", "model": answer.model,
            "data": [{"object": "embedding", "index": i,
                      "embedding": _encoded(vector, encoding)}
                     for i, vector in enumerate(answer.vectors)],
            "usage": {"prompt_tokens": answer.prompt_tokens,
                      "total_tokens": answer.prompt_tokens}}


def _embedding_input(data: Mapping[str, Any]) -> tuple[list[str], str]:
    unknown = sorted(set(data) - _EMBEDDING_KEYS)
    if unknown:
        raise InvalidRequestError(unknown[0], "unknown parameter; /v1/embeddings takes "
                                  f"{', '.join(sorted(_EMBEDDING_KEYS))}")
    if data.get("dimensions") is not None:
        raise InvalidRequestError("dimensions", "the embedding model has a fixed dimension; "
                                  "leave `dimensions` unset")
    raw = data.get("input")
    texts = [raw] if isinstance(raw, str) else raw
    if not isinstance(texts, list) or not texts:
        raise InvalidRequestError("input", "must be a string or a non-empty array of strings")
    if len(texts) > MAX_EMBEDDING_INPUTS:
        raise InvalidRequestError("input", f"at most {MAX_EMBEDDING_INPUTS} inputs, "
                                  f"got {len(texts)}")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise InvalidRequestError(f"input[{i}]", "must be a string (token ids are not "
                                      "supported; send text)")
        if not text.strip():
            raise InvalidRequestError(f"input[{i}]", "must hold text")
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequestError("model", "must be a string")
    encoding = data.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise InvalidRequestError("encoding_format", 'must be "float" or "base64"')
    return texts, encoding


def _encoded(vector: tuple[float, ...], encoding: str) -> list[float] | str:
    if encoding == "float":
        return list(vector)
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def _embed_error(err: UpstreamError) -> Exception:
    """The client's status for a failed Embed: the retriever's ``texts[i]: ...``
    refusal as ``input[i]``; anything else as any upstream failure."""
    if err.code == grpc.StatusCode.INVALID_ARGUMENT:
        named = re.match(r"texts(\[\d+\])?: ", err.details)
        if named is not None:
            return InvalidRequestError(f"input{named[1] or ''}", err.details[named.end():])
        return InvalidRequestError("input", err.details)
    return upstream_to_generation_error(err)
