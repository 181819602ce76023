"""The confidence rule: keep the small model's answer, or escalate.

A pure function of the small model's own token logprobs over the held-back
window (for a greedy request: of the request, so the same request always
takes the same path). Two scores, after FrugalGPT (Chen, Zaharia and Zou,
"FrugalGPT: How to Use Large Language Models While Reducing Cost and
Improving Performance", 2023: a scorer on the cheap model's generation
decides whether the next model is called) with the scorer replaced by the
generator's own uncertainty, as in token-level cascades (Gupta et al.,
"Language Model Cascades: Token-level uncertainty and beyond", ICLR 2024,
which find length-normalised and quantile token-logprob scores strong
deferral rules):

* the mean chosen-token logprob over the window (nats; a length-normalised
  sequence logprob): escalate when below ``min_mean_logprob``;
* with ``margin`` > 0, the share of positions whose top-1 minus top-2
  logprob is below ``margin`` (the model hesitates between two tokens):
  escalate when above ``max_low_margin_share``.

An empty window (the small model ended at once) is confident: nothing was
uncertain.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.common.logprobs import PositionLogprobs
from services.router.cascade.policy import CascadePolicy


@dataclass(frozen=True)
class Confidence:
    """The rule's scores over a window.

    Attributes:
      tokens: positions scored.
      mean_logprob: mean chosen-token logprob (nats, <= 0; 0.0 when empty).
      low_margin_share: share of positions whose top-1 minus top-2 logprob
        is below the policy's margin (0.0 when the margin rule is off or a
        position has fewer than two alternatives).
    """

    tokens: int
    mean_logprob: float
    low_margin_share: float


def score(window: Sequence[PositionLogprobs], margin: float) -> Confidence:
    """The scores of ``window`` (the held-back positions, in order)."""
    if not window:
        return Confidence(0, 0.0, 0.0)
    mean = sum(p.chosen.logprob for p in window) / len(window)
    low = 0
    if margin > 0:
        low = sum(1 for p in window
                  if len(p.top) >= 2 and p.top[0].logprob - p.top[1].logprob < margin)
    return Confidence(len(window), mean, low / len(window))


def escalation_reason(policy: CascadePolicy, confidence: Confidence) -> str | None:
    """Why the request must go to the large model (``low_confidence`` or
    ``low_margin``), or None to keep the small model's answer."""
    if confidence.tokens == 0:
        return None
    if confidence.mean_logprob < policy.min_mean_logprob:
        return "low_confidence"
    if policy.margin > 0 and confidence.low_margin_share > policy.max_low_margin_share:
        return "low_margin"
    return None


__all__ = ["Confidence", "escalation_reason", "score"]
