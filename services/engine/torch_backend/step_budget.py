"""One step's token budget, and the share of it that outranked prompt chunks may take.

The scheduler spends :class:`StepBudget` on a step's sequences in order. Beside
the step's budget (``max_num_batched_tokens``), a budget may carry a *limit by
priority*: the sequences ranked below a priority (numerically greater) share at
most ``tokens`` tokens of the step. The scheduler sets two (the tighter wins):

* after the decodes are planned, the lower priorities' prompt chunks share
  :func:`outranked_prefill_tokens` (a step that carries an INTERACTIVE decode
  carries at most a small BATCH prefill chunk, so the INTERACTIVE sequence's
  inter-token latency stays within ``slowdown`` times a decode-only step);
* before the running prompt chunks planned after the waiting joins, the
  priorities below a prompt chunk already planned get nothing (an
  INTERACTIVE prompt's step carries no BATCH prefill: its TTFT).

A step without a higher-priority sequence carries no limit: equal priorities
and a lower-priority sequence alone get the whole budget, so a BATCH prefill
runs at full speed once the INTERACTIVE sequences are gone, and at least
:data:`MIN_OUTRANKED_PREFILL_TOKENS` a step beside them (it is never starved).

This is vLLM's ``long_prefill_token_threshold`` (a cap on one step's chunk of a
long prefill) made priority-aware and sized from the engine's measured step
profile instead of a fixed count; SGLang's ``--enable-mixed-chunk`` mixes a
prefill chunk of at most ``--chunked-prefill-size`` tokens into a decode batch
(a fixed size for every priority).

Not thread-safe: one step's planning on the engine thread.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.common.sampling import Priority
from services.common.step_profile import StepProfile

#: Fewest prompt tokens outranked prompts get in a step beside a higher-priority
#: decode (their progress). Measured (benchmarks/priority_itl.py, one round
#: each on 2 cores at load 6-8, where the profile's bound came to ~4 tokens): a
#: floor of 16 held an INTERACTIVE stream's ITL p50 at 3.1x its ITL alone, a
#: floor of 4 at 1.7x.
MIN_OUTRANKED_PREFILL_TOKENS = 4
#: More tokens than any step's budget: the bound does not limit.
_NO_LIMIT_TOKENS = 1 << 31


def outranked_prefill_tokens(profile: StepProfile, decode_rows: int, slowdown: float) -> int:
    """Prompt tokens of lower priorities a step with ``decode_rows`` decode rows
    may carry so that it takes at most ``slowdown`` times its decode-only time:
    ``(slowdown - 1) * decode_step(rows) / prefill_token_s`` (the profile's
    measured costs, else its priors), at least
    :data:`MIN_OUTRANKED_PREFILL_TOKENS`.

    Args:
      profile: the engine's step profile (seconds).
      decode_rows: the step's decode rows (speculative ones included), >= 1.
      slowdown: the bound on the step's time over its decode-only time, >= 1.
    """
    per_token_s = profile.prefill_s(1)
    extra_s = (slowdown - 1.0) * profile.decode_step(decode_rows)
    if per_token_s <= 0:
        return MIN_OUTRANKED_PREFILL_TOKENS
    tokens = extra_s / per_token_s
    if not tokens < _NO_LIMIT_TOKENS:  # a huge slowdown (or a zero-cost profile row)
        return _NO_LIMIT_TOKENS
    return max(MIN_OUTRANKED_PREFILL_TOKENS, math.floor(tokens))


@dataclass
class StepBudget:
    """Tokens left in one step (module doc).

    Attributes:
      tokens: tokens left for any sequence.
      deferred_tokens: prompt tokens the priority limit held back in this step
        (what each limited sequence would have taken without it).
    """

    tokens: int
    deferred_tokens: int = 0
    _below: Priority | None = None  # sequences ranked below it are limited
    _limited_tokens: int = 0  # tokens left for them

    def limit(self, below: Priority, tokens: int) -> None:
        """Sequences ranked below ``below`` share at most ``tokens`` more tokens
        of this step. A limit only tightens: with two, the lower ``below`` and
        the fewer tokens hold."""
        if self._below is None:
            self._below, self._limited_tokens = below, tokens
        else:
            self._below = min(self._below, below)
            self._limited_tokens = min(self._limited_tokens, tokens)

    def allowance(self, priority: Priority) -> int:
        """Most tokens a sequence of ``priority`` may take now."""
        if self._limited(priority):
            return min(self.tokens, self._limited_tokens)
        return self.tokens

    def take(self, priority: Priority, num_tokens: int, wanted: int) -> None:
        """Books ``num_tokens`` taken by a sequence of ``priority`` that would
        have taken ``wanted`` (its chunk under the whole budget) without the limit."""
        if self._limited(priority):
            self._limited_tokens -= num_tokens
            self.deferred_tokens += max(wanted - num_tokens, 0)
        self.tokens -= num_tokens

    def _limited(self, priority: Priority) -> bool:
        return self._below is not None and priority > self._below
