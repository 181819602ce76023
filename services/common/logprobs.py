"""Log-probabilities as typed values inside the services
(``llmesh.v1.TokenLogprob`` / ``PositionLogprobs`` at the edges).

A value is the model's log-softmax of the raw logits at a position, before any
sampling transform (temperature, penalties, logit bias, top-k/top-p, grammar
masks): what vLLM returns by default (``logprobs_mode="raw_logprobs"``) and
what OpenAI's ``logprobs`` documents.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from llmesh.v1 import common_pb2


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One token at one position.

    Attributes:
      token_id: the token.
      logprob: natural log of its probability (<= 0; ``-inf`` when impossible).
      rank: 1-based rank among the vocabulary at this position.
      token: its text where known (the router fills it; the engine leaves "").
    """

    token_id: int
    logprob: float
    rank: int
    token: str = ""

    def to_pb(self) -> common_pb2.TokenLogprob:
        return common_pb2.TokenLogprob(token_id=self.token_id, logprob=self.logprob,
                                       rank=self.rank, token=self.token)

    @classmethod
    def from_pb(cls, pb: common_pb2.TokenLogprob) -> TokenLogprob:
        return cls(pb.token_id, pb.logprob, pb.rank, pb.token)


@dataclass(frozen=True, slots=True)
class PositionLogprobs:
    """The chosen token at a position and the most likely ones there.

    Attributes:
      chosen: the generated (or prompt) token.
      top: the ``k`` most likely tokens, most likely first (``k`` as asked).
    """

    chosen: TokenLogprob
    top: tuple[TokenLogprob, ...] = ()

    def to_pb(self) -> common_pb2.PositionLogprobs:
        return common_pb2.PositionLogprobs(chosen=self.chosen.to_pb(),
                                           top=[t.to_pb() for t in self.top])

    @classmethod
    def from_pb(cls, pb: common_pb2.PositionLogprobs) -> PositionLogprobs:
        return cls(TokenLogprob.from_pb(pb.chosen),
                   tuple(TokenLogprob.from_pb(t) for t in pb.top))


def logprobs_to_pb(entries: Iterable[PositionLogprobs]) -> list[common_pb2.PositionLogprobs]:
    """``entries`` as protobuf messages, in order."""
    return [entry.to_pb() for entry in entries]


def logprobs_from_pb(
        entries: Iterable[common_pb2.PositionLogprobs]) -> tuple[PositionLogprobs, ...]:
    """Protobuf entries as typed values, in order."""
    return tuple(PositionLogprobs.from_pb(entry) for entry in entries)
