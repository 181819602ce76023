"""What a cascade request reports about the path it took (both edges)."""

from __future__ import annotations

from dataclasses import dataclass

from llmesh.v1 import generation_pb2

#: HTTP header (OpenAI edge) naming the model that produced the answer.
MODEL_HEADER = "x-llmesh-model"
#: HTTP header (OpenAI edge) with the cascade's path: ``small``, ``escalated``
#: or ``large``, then ``; reason=REASON``.
PATH_HEADER = "x-llmesh-cascade-path"


@dataclass(frozen=True)
class AnswerPath:
    """Which model of a cascade produced an answer, and why.

    Attributes:
      model: the small or the large model's id.
      escalated: the small generation was cancelled and the large model answered.
      reason: ``confident``, ``low_confidence``, ``low_margin``,
        ``prompt_tokens``, ``n_choices``, ``mode_small`` or ``mode_large``
        (:mod:`.runner`).
      mean_logprob: the rule's mean token logprob over the held-back tokens
        (nats); None when the rule did not run.
      held_back_tokens: small-model tokens held back while the rule decided.
    """

    model: str
    escalated: bool
    reason: str
    mean_logprob: float | None = None
    held_back_tokens: int = 0

    @property
    def name(self) -> str:
        """``escalated``, or the leg that answered at once: ``small`` / ``large``."""
        if self.escalated:
            return "escalated"
        return "small" if self.reason in ("confident", "mode_small") else "large"

    def to_pb(self) -> generation_pb2.CascadePath:
        pb = generation_pb2.CascadePath(escalated=self.escalated, reason=self.reason,
                                        held_back_tokens=self.held_back_tokens)
        if self.mean_logprob is not None:
            pb.mean_logprob = self.mean_logprob
        return pb

    def headers(self) -> dict[str, str]:
        """The OpenAI edge's response headers for this path."""
        return {MODEL_HEADER: self.model, PATH_HEADER: f"{self.name}; reason={self.reason}"}

    def log_fields(self) -> dict[str, object]:
        """Fields of the request's ``request_finished`` log line."""
        return dict(cascade_path=self.name, cascade_reason=self.reason,
                    cascade_mean_logprob=self.mean_logprob,
                    cascade_held_back_tokens=self.held_back_tokens)


__all__ = ["MODEL_HEADER", "PATH_HEADER", "AnswerPath"]
