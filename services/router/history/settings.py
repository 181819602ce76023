"""The history flags as typed values (:class:`HistorySettings`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

#: Tokens a summary may take when the flag gives none.
DEFAULT_SUMMARY_MAX_TOKENS = 128
#: After a compaction the prompt (system turn, summary and the kept turns)
#: takes at most this share of the budget, so that the next turns add to a
#: stable prefix for a while before the next compaction.
LOW_WATER = 0.5
#: A compaction starts once a prompt passes this share of the budget (or had
#: to be trimmed), so that the summary is usually stored before the chat
#: reaches the budget and no turn is served trimmed.
HIGH_WATER = 0.75
#: Most seconds a compaction waits for its tenant to be back under its limits
#: (the limits' retry hints) before it is deferred to a later turn.
DEFER_WAIT_S = 10.0


def parse_budget(text: str) -> tuple[str, int]:
    """``[MODEL=]N`` → (model, or "" for every model; tokens >= 1).

    Raises:
      ValueError: N is not a whole number >= 1.
    """
    model, sep, number = text.rpartition("=")
    try:
        tokens = int(number)
    except ValueError:
        tokens = 0
    if tokens < 1:
        raise ValueError(f"--history-budget-tokens {text!r}: expected [MODEL=]N with N a "
                         "whole number of tokens >= 1")
    return (model.strip() if sep else "", tokens)


@dataclass(frozen=True)
class HistorySettings:
    """Chat history compaction for the router.

    Attributes:
      budgets: prompt-token budget of a chat, by model id ("" every model's
        default); a model without one is never compacted (nor trimmed below
        its context window).
      summarizer_model: the served model that writes summaries; "" the
        request's own model.
      summary_max_tokens: most tokens of one summary.
      lease_seconds: how long a router's claim on writing a summary holds
        if it never stores one (it died).
    """

    budgets: Mapping[str, int] = field(default_factory=dict)
    summarizer_model: str = ""
    summary_max_tokens: int = DEFAULT_SUMMARY_MAX_TOKENS
    lease_seconds: int = 60

    def __post_init__(self) -> None:
        if self.summary_max_tokens < 1:
            raise ValueError(f"--history-summary-max-tokens must be >= 1, got "
                             f"{self.summary_max_tokens}")
        for model, budget in self.budgets.items():
            if budget <= self.summary_max_tokens:
                raise ValueError(
                    f"--history-budget-tokens {model + '=' if model else ''}{budget}: the budget "
                    f"must exceed --history-summary-max-tokens ({self.summary_max_tokens})")

    def budget(self, model: str) -> int:
        """The model's budget in tokens; 0: none."""
        return self.budgets.get(model, self.budgets.get("", 0))

    def summarizer(self, model: str) -> str:
        """Which model summarises ``model``'s chats."""
        return self.summarizer_model or model
