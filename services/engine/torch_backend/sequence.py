"""The state of one request inside the torch engine loop."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from services.common.sampling import FinishReason
from services.engine.torch_backend.model import KVCache
from services.engine.torch_backend.sampler import SamplingRow
from services.engine.types import EngineRequest, TokenDelta


@dataclass(eq=False)
class Sequence:
    """A request's tokens, progress and delivery channel.

    Written by the engine worker thread, except ``cancelled`` (set by any
    thread; read by the worker at each step boundary).

    Attributes:
      request: the request as admitted.
      arrival: admission counter (FIFO order within a priority).
      queue: the asyncio queue its deltas are delivered to.
      loop: the event loop that owns ``queue``.
      sampling: the sampler's view of its parameters (holds its generator).
      token_ids: prompt followed by generated tokens.
      num_computed_tokens: tokens whose keys/values are in ``cache``.
      cache: KV cache, allocated when it first runs.
      cancelled: set to finish it with CANCELLED at the next step.
      finish_reason: NONE until it finished.
    """

    request: EngineRequest
    arrival: int
    queue: asyncio.Queue[TokenDelta]
    loop: asyncio.AbstractEventLoop
    sampling: SamplingRow
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    cache: KVCache | None = None
    cancelled: bool = False
    finish_reason: FinishReason = FinishReason.NONE

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.request.prompt_token_ids)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not FinishReason.NONE

    def next_chunk(self, max_tokens: int) -> list[int]:
        """Tokens to compute next: up to ``max_tokens`` not yet in the cache."""
        end = min(self.num_tokens, self.num_computed_tokens + max_tokens)
        return self.token_ids[self.num_computed_tokens:end]

    def delta(self, token_ids: tuple[int, ...], error: str = "") -> TokenDelta:
        """The delta announcing ``token_ids`` (and the finish reason, if finished)."""
        return TokenDelta(
            request_id=self.request_id,
            token_ids=token_ids,
            finish_reason=self.finish_reason,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generated_tokens=self.num_generated_tokens,
            num_cached_tokens=0,
            error=error,
        )
