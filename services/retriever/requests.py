"""Validation of the retriever's requests, once, at the gRPC edge.

Each ``parse_*`` turns a request message into typed values or raises
:class:`InvalidField` with the gRPC status and the field it names
(``documents[2].text``, ``filter.lang``), as the proto's comments specify.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import grpc
from google.protobuf import struct_pb2
from llmesh.v1 import retriever_pb2

from services.common.cache_scope import MAX_CACHE_SCOPE_BYTES
from services.retriever.caches import canonical_filter, normalise_query
from services.retriever.chunker import DEFAULT_CHUNKING, Chunking
from services.retriever.collection import Scalar

NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,128}")
#: Longest document id, in characters.
MAX_DOCUMENT_ID_CHARS = 512


class InvalidField(Exception):
    """A request field the service refuses: ``code`` and a message naming ``field``."""

    def __init__(self, field: str, why: str,
                 code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT) -> None:
        super().__init__(f"{field}: {why}" if field else why)
        self.field = field
        self.code = code


@dataclass(frozen=True)
class Limits:
    """The service's request limits (flags of ``python -m services.retriever``).

    Attributes:
      max_document_bytes: UTF-8 bytes of one document's text.
      max_text_bytes: UTF-8 bytes of a query or of one ``Embed`` text.
      max_embed_texts: texts in one ``Embed``.
      default_top_k, max_top_k: chunks a query returns when it says 0, and at most.
      default_chunking: the sizes of a collection created without its own.
    """

    max_document_bytes: int = 1 << 20
    max_text_bytes: int = 16 << 10
    max_embed_texts: int = 2048
    default_top_k: int = 5
    max_top_k: int = 100
    default_chunking: Chunking = DEFAULT_CHUNKING


@dataclass(frozen=True)
class DocumentInput:
    """A document of an ingest, validated."""

    id: str
    text: str
    metadata: Mapping[str, Scalar]


@dataclass(frozen=True)
class QuerySpec:
    """A query, validated: ``query`` normalised, ``top_k`` resolved, the filter
    as a dict and as its canonical string (cache key), the caller's opaque
    ``cache_scope`` ("" shared; part of both query caches' keys)."""

    collection: str
    query: str
    top_k: int
    where: Mapping[str, Scalar]
    where_key: str
    cache_scope: str


def parse_name(name: str, field: str = "name") -> str:
    """A collection name, or INVALID_ARGUMENT naming ``field``."""
    if not NAME_PATTERN.fullmatch(name):
        raise InvalidField(field, f"{name[:64]!r} is not a collection name "
                                  "([A-Za-z0-9_.-], 1 to 128 characters)")
    return name


def parse_chunking(request: retriever_pb2.CreateCollectionRequest, limits: Limits) -> Chunking:
    """The collection's chunk sizes: the service default when ``chunking`` is
    unset or both sizes are 0; ``chunk_tokens`` 0 alone takes the default size."""
    given = request.chunking
    if not request.HasField("chunking") or (given.chunk_tokens == 0
                                            and given.overlap_tokens == 0):
        return limits.default_chunking
    tokens = given.chunk_tokens or limits.default_chunking.chunk_tokens
    try:
        return Chunking(tokens, given.overlap_tokens)
    except ValueError as error:
        raise InvalidField("chunking", str(error)) from error


def flat_metadata(struct: struct_pb2.Struct, field: str) -> dict[str, Scalar]:
    """A Struct of string, number or bool values as a dict; anything nested,
    a list or a null is INVALID_ARGUMENT naming ``field.<key>``."""
    flat: dict[str, Scalar] = {}
    for key, value in struct.fields.items():
        kind = value.WhichOneof("kind")
        if kind == "string_value":
            flat[key] = value.string_value
        elif kind == "number_value":
            flat[key] = value.number_value
        elif kind == "bool_value":
            flat[key] = value.bool_value
        else:
            raise InvalidField(f"{field}.{key}", "values must be strings, numbers or "
                                                 f"booleans, not {kind}")
    return flat


def parse_documents(request: retriever_pb2.IngestRequest, limits: Limits) -> list[DocumentInput]:
    """The documents of an ingest (at least one, ids unique, texts within the limit)."""
    if not request.documents:
        raise InvalidField("documents", "at least one document is needed")
    seen: dict[str, int] = {}
    documents = []
    for i, document in enumerate(request.documents):
        if not document.id or len(document.id) > MAX_DOCUMENT_ID_CHARS:
            raise InvalidField(f"documents[{i}].id",
                               f"must be 1 to {MAX_DOCUMENT_ID_CHARS} characters")
        if document.id in seen:
            raise InvalidField(f"documents[{i}].id", f"{document.id[:64]!r} repeats "
                                                     f"documents[{seen[document.id]}].id")
        seen[document.id] = i
        size = len(document.text.encode())
        if size > limits.max_document_bytes:
            raise InvalidField(f"documents[{i}].text",
                               f"is {size} bytes, over the service's document size limit "
                               f"of {limits.max_document_bytes} bytes")
        if not document.text.strip():
            raise InvalidField(f"documents[{i}].text", "is empty")
        documents.append(DocumentInput(document.id, document.text,
                                       flat_metadata(document.metadata,
                                                     f"documents[{i}].metadata")))
    return documents


def parse_document_ids(request: retriever_pb2.DeleteDocumentsRequest) -> list[str]:
    """The ids of a ``DeleteDocuments``: at least one, each 1 to
    :data:`MAX_DOCUMENT_ID_CHARS` characters, none repeated."""
    if not request.document_ids:
        raise InvalidField("document_ids", "at least one document id is needed")
    seen: dict[str, int] = {}
    for i, document_id in enumerate(request.document_ids):
        field = f"document_ids[{i}]"
        if not document_id or len(document_id) > MAX_DOCUMENT_ID_CHARS:
            raise InvalidField(field, f"must be 1 to {MAX_DOCUMENT_ID_CHARS} characters")
        if document_id in seen:
            raise InvalidField(field, f"{document_id[:64]!r} repeats "
                                      f"document_ids[{seen[document_id]}]")
        seen[document_id] = i
    return list(request.document_ids)


def parse_query(request: retriever_pb2.QueryRequest, limits: Limits) -> QuerySpec:
    """A query: collection name, non-blank text within the limit, top_k in range, flat
    filter, cache scope of at most :data:`MAX_CACHE_SCOPE_BYTES` bytes."""
    name = parse_name(request.collection, "collection")
    query = normalise_query(request.query)
    if not query:
        raise InvalidField("query", "is empty or blank")
    if len(request.query.encode()) > limits.max_text_bytes:
        raise InvalidField("query", f"is over {limits.max_text_bytes} bytes")
    top_k = request.top_k or limits.default_top_k
    if top_k > limits.max_top_k:
        raise InvalidField("top_k", f"{top_k} is over the limit of {limits.max_top_k}")
    where = flat_metadata(request.filter, "filter")
    scope_bytes = len(request.cache_scope.encode())
    if scope_bytes > MAX_CACHE_SCOPE_BYTES:
        raise InvalidField("cache_scope", f"{scope_bytes} bytes, over the limit of "
                                          f"{MAX_CACHE_SCOPE_BYTES}")
    return QuerySpec(name, query, top_k, where, canonical_filter(where), request.cache_scope)


def parse_texts(request: retriever_pb2.EmbedRequest, limits: Limits) -> list[str]:
    """The texts of an ``Embed``: 1 to ``max_embed_texts``, each non-empty and within the limit."""
    if not request.texts:
        raise InvalidField("texts", "at least one text is needed")
    if len(request.texts) > limits.max_embed_texts:
        raise InvalidField("texts", f"{len(request.texts)} texts, over the limit of "
                                    f"{limits.max_embed_texts}")
    for i, text in enumerate(request.texts):
        if not text.strip():
            raise InvalidField(f"texts[{i}]", "is empty")
        if len(text.encode()) > limits.max_text_bytes:
            raise InvalidField(f"texts[{i}]", f"is over {limits.max_text_bytes} bytes")
    return list(request.texts)
