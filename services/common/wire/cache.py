"""Response-cache keys and the responses stored under them (router ↔ cache:
``GetCachedResponse``, ``PutCachedResponse``).

The router builds a :class:`CacheKey` from the options it already parsed and
checked (no re-parse); the cache service checks the ``CacheKey`` message once,
at its edge, and hashes it (:mod:`services.cache.keys`). It keeps a
``CachedResponse`` as the bytes it was sent, so only the router converts it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from llmesh.v1 import cache_pb2
from services.common.sampling import FinishReason, SamplingOptions

#: The details of the UNAVAILABLE a draining cache answers a new call with:
#: the call read nothing, so the router sends its stores again on its next
#: call (:mod:`services.router.cache_stores`) instead of losing them.
DRAINING = "cache service is draining"


@dataclass(frozen=True)
class CacheKey:
    """Everything that decides a deterministic request's output, and the cache
    scope it may be shared in (:mod:`services.common.cache_scope`; "" shared).

    Attributes:
      model: the served model's name.
      prompt_token_ids: the prompt's ids (at least one).
      sampling: the request's checked options, as the router resolved them.
      cache_scope: the scope an entry is shared in.
    """

    model: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingOptions
    cache_scope: str = ""

    @functools.cached_property
    def _pb(self) -> cache_pb2.CacheKey:
        return cache_pb2.CacheKey(
            model=self.model, prompt_token_ids=self.prompt_token_ids,
            sampling=self.sampling.to_pb(), cache_scope=self.cache_scope,
        )

    def to_pb(self) -> cache_pb2.CacheKey:
        """The protobuf form, every sampling field set; built once per key (a
        lookup and the store after it share it), so callers must not change it."""
        return self._pb


@dataclass(frozen=True)
class CachedResponse:
    """A finished generation as the client saw it.

    Attributes:
      token_ids: the completion's ids (a final stop token included).
      text: its text as streamed (stop string held back or included as asked).
      finish_reason: why it ended.
      matched_stop: the stop string that ended it ("" for none).
    """

    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason
    matched_stop: str = ""

    @classmethod
    def from_pb(cls, pb: cache_pb2.CachedResponse) -> CachedResponse:
        """The typed response; an unknown finish reason reads as ERROR."""
        return cls(tuple(pb.token_ids), pb.text, FinishReason.from_pb(pb.finish_reason),
                   pb.matched_stop)

    def to_pb(self) -> cache_pb2.CachedResponse:
        return cache_pb2.CachedResponse(
            token_ids=self.token_ids, text=self.text, finish_reason=int(self.finish_reason),
            matched_stop=self.matched_stop,
        )
