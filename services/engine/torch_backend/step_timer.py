"""The engine's measured step costs, for its load report
(:class:`~services.common.step_profile.StepProfile`).

Each step is timed by what it computed: a step with no prompt tokens (decode
rows only, speculative ones included) teaches the decode table by its row
count; a step with at least :data:`MIN_PREFILL_TOKENS` prompt tokens (tokens
other than a sequence's one decode row and its proposals: prefill chunks,
prefix-cache misses, recomputation after a preemption) teaches the seconds
per prompt token, after subtracting what its decode rows cost by the table.

The decode table is the speculation cost rule's
(:class:`~services.engine.torch_backend.spec_policy.StepCostModel`): when
there is a speculator, it owns that table and times the decode steps itself
(``Speculator.observe_step``), and the timer only reads it; without one, the
timer owns a table and times them.

Threading: the engine thread only; :meth:`StepTimer.profile` returns an
immutable snapshot for other threads.
"""

from __future__ import annotations

from services.common.step_profile import StepProfile
from services.engine.torch_backend.scheduler import SchedulerOutput
from services.engine.torch_backend.spec_policy import StepCostModel

#: Fewest prompt tokens in a step for it to time the per-token cost (a step
#: with a few has its fixed cost spread over too few tokens).
MIN_PREFILL_TOKENS = 16
#: Weight of a new step in the moving average of the per-token cost (the
#: first steps are averaged plainly).
PREFILL_WEIGHT = 0.2


class StepTimer:
    """Times the engine's steps (module doc).

    Args:
      decode: the speculator's decode table (None: the timer keeps its own).
      max_rows: rows reported in the profile (``1..max_rows``; the engine's
        ``max_num_seqs``).
    """

    def __init__(self, decode: StepCostModel | None, max_rows: int) -> None:
        self._owns_decode = decode is None
        self._decode = decode if decode is not None else StepCostModel()
        self._max_rows = max(max_rows, 1)
        self._prefill_token_s = 0.0
        self._prefill_steps = 0

    def observe(self, out: SchedulerOutput, seconds: float) -> None:
        """One step that computed ``out`` in ``seconds``."""
        decode_rows = prompt_tokens = 0
        for item in out.scheduled:
            if item.samples and item.num_tokens == item.num_logits:
                decode_rows += item.num_tokens
            else:
                prompt_tokens += item.num_tokens
        if prompt_tokens == 0:
            if self._owns_decode:
                self._decode.observe(decode_rows, seconds)
            return
        if prompt_tokens < MIN_PREFILL_TOKENS:
            return
        decode_s = self._decode.seconds(decode_rows) if decode_rows else 0.0
        sample = max(seconds - decode_s, 0.0) / prompt_tokens
        self._prefill_steps += 1
        weight = max(PREFILL_WEIGHT, 1.0 / self._prefill_steps)
        self._prefill_token_s += weight * (sample - self._prefill_token_s)

    def profile(self) -> StepProfile:
        """The measured costs so far (unmeasured parts left empty)."""
        table: tuple[float, ...] = ()
        if self._decode.measured:
            table = tuple(self._decode.seconds(rows) for rows in range(1, self._max_rows + 1))
        return StepProfile(self._prefill_token_s, table)
