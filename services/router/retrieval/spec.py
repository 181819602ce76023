"""A request's retrieval (``GenerateRequest.retrieval``), validated once at the edge.

Only the router's own checks live here (shape, sizes, a chat input with a
non-empty last user turn); whether the collection exists and whether the
filter's fields do is the retriever's to say (NOT_FOUND / INVALID_ARGUMENT,
mapped by :mod:`.stage` onto ``retrieval.collection`` / ``retrieval.filter``).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from google.protobuf import json_format

from llmesh.v1 import generation_pb2
from services.common.sampling import InvalidRequestError
from services.common.wire.chat import ChatMessage

#: Most chunks one request may insert (the retriever may allow more).
MAX_TOP_K = 32
#: Most fields one filter may hold.
MAX_FILTER_FIELDS = 16
#: A collection name, as the retriever accepts it (retriever.proto).
_COLLECTION_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")
#: The role whose last turn is the query (and the passages' role).
USER_ROLE = "user"


class FailurePolicy(enum.Enum):
    """What a failed retrieval does (``RetrievalFailurePolicy``)."""

    FAIL = "fail"
    DEGRADE = "degrade"

    @classmethod
    def from_pb(cls, value: int) -> FailurePolicy:
        if value == generation_pb2.RETRIEVAL_FAILURE_POLICY_DEGRADE:
            return cls.DEGRADE
        if value in (generation_pb2.RETRIEVAL_FAILURE_POLICY_UNSPECIFIED,
                     generation_pb2.RETRIEVAL_FAILURE_POLICY_FAIL):
            return cls.FAIL
        raise InvalidRequestError("retrieval.on_failure", f"unknown value {value}; use "
                                  "RETRIEVAL_FAILURE_POLICY_FAIL (1) or "
                                  "RETRIEVAL_FAILURE_POLICY_DEGRADE (2)")


@dataclass(frozen=True)
class RetrievalSpec:
    """What to retrieve for one request.

    Attributes:
      collection: the collection searched.
      top_k: chunks wanted (0: the retriever's default).
      filter: flat equality filter on metadata (str, float or bool values).
      on_failure: :class:`FailurePolicy`.
      query: the last user turn's text (what is searched for).
      query_index: that turn's index in ``chat.messages`` (the passages go
        just before it; errors about the query name ``chat.messages[i].content``).
    """

    collection: str
    top_k: int
    filter: Mapping[str, object]
    on_failure: FailurePolicy
    query: str
    query_index: int

    @property
    def query_field(self) -> str:
        return f"chat.messages[{self.query_index}].content"


def retrieval_spec(pb: generation_pb2.GenerateRequest,
                   messages: Sequence[ChatMessage] | None) -> RetrievalSpec | None:
    """The request's retrieval, or None when it asks for none.

    Args:
      pb: the request (``retrieval`` read).
      messages: its chat turns as validated (None: ``prompt`` or
        ``prompt_tokens`` input).

    Raises:
      InvalidRequestError: INVALID_ARGUMENT naming ``retrieval`` (not a chat,
        or no user turn), ``retrieval.collection``, ``retrieval.top_k``,
        ``retrieval.filter`` (nested or null values, too many fields),
        ``retrieval.on_failure``, or ``chat.messages[i].content`` (the last
        user turn is blank: nothing to search for).
    """
    if not pb.HasField("retrieval"):
        return None
    r = pb.retrieval
    if messages is None:
        raise InvalidRequestError("retrieval", "needs `chat` input: the passages go just "
                                  "before the last user turn (a `prompt` has no turns)")
    if not _COLLECTION_NAME.fullmatch(r.collection):
        raise InvalidRequestError("retrieval.collection", "must name a collection "
                                  "([A-Za-z0-9_.-]{1,128})")
    if r.top_k > MAX_TOP_K:
        raise InvalidRequestError("retrieval.top_k", f"at most {MAX_TOP_K} chunks, "
                                  f"got {r.top_k}")
    index = _last_user_turn(messages)
    if not messages[index].content.strip():
        raise InvalidRequestError(f"chat.messages[{index}].content", "the last user turn is "
                                  "the retrieval query and must hold text")
    return RetrievalSpec(r.collection, r.top_k, _flat_filter(r), FailurePolicy.from_pb(
        r.on_failure), messages[index].content, index)


def _last_user_turn(messages: Sequence[ChatMessage]) -> int:
    for index in range(len(messages) - 1, -1, -1):
        if messages[index].role == USER_ROLE:
            return index
    raise InvalidRequestError("retrieval", "needs a user turn in `chat.messages` (the query)")


def _flat_filter(r: generation_pb2.Retrieval) -> Mapping[str, object]:
    if not r.HasField("filter"):
        return MappingProxyType({})
    values = json_format.MessageToDict(r.filter)
    if len(values) > MAX_FILTER_FIELDS:
        raise InvalidRequestError("retrieval.filter", f"at most {MAX_FILTER_FIELDS} fields, "
                                  f"got {len(values)}")
    for key, value in values.items():
        if not isinstance(value, (str, int, float, bool)):
            raise InvalidRequestError(f"retrieval.filter.{key}", "must be a string, number "
                                      f"or bool (filters match flat metadata), got "
                                      f"{type(value).__name__}")
    return MappingProxyType(values)
