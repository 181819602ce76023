"""Which turns a compaction summarises (:func:`compaction_end`).

A compaction is due when a prompt passes three quarters of the budget (or
had to be trimmed to it: :func:`compaction_due`), early enough that the
summary is usually stored before the chat reaches the budget. It starts
where the stored summary ends (or at the first turn) and
ends at the earliest :class:`~.conversation.Boundary` after which the system
turn, the kept turns and a summary of at most ``summary_max_tokens`` fit in
:data:`~.settings.LOW_WATER` of the budget: the prompt then grows from about
half the budget back to it over the next turns, all sharing one prefix (the
system turn with the summary), before the next compaction. When no boundary
gets that low, the last one (everything but the turn being answered).
"""

from __future__ import annotations

from collections.abc import Sequence

from services.router.history.conversation import Boundary
from services.router.history.settings import HIGH_WATER, LOW_WATER


def low_water_tokens(budget: int, summary_max_tokens: int) -> int:
    """Tokens the kept part of the prompt (system turn and recent turns) may
    take after a compaction (at least 1)."""
    return max(1, int(budget * LOW_WATER) - summary_max_tokens)


def compaction_due(prompt_tokens: int, dropped_messages: int, budget: int) -> bool:
    """Whether a prompt calls for a compaction: it was trimmed to the budget,
    or passes :data:`~.settings.HIGH_WATER` of it."""
    return dropped_messages > 0 or prompt_tokens > budget * HIGH_WATER


def compaction_end(candidates: Sequence[Boundary], start: int, min_end: int) -> Boundary | None:
    """The boundary a compaction ends at: the first at or after ``min_end`` (the
    turn count the tokenizer had to drop from ``start`` to reach the low-water
    mark), else the last one; None when no boundary lies after ``start``."""
    after = [b for b in candidates if b.end > start]
    if not after:
        return None
    return next((b for b in after if b.end >= min_end), after[-1])
