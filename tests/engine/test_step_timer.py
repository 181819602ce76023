"""The engine's step timing for its load report
(services/engine/torch_backend/step_timer.py), without a model: decode steps
by row count, the per-token cost of prompt tokens net of the decode rows
beside them, and the speculator's table read rather than timed twice."""

from __future__ import annotations

import pytest

from services.engine.torch_backend.scheduler import ScheduledSequence, SchedulerOutput
from services.engine.torch_backend.spec_policy import StepCostModel
from services.engine.torch_backend.step_timer import MIN_PREFILL_TOKENS, StepTimer

from .kv_helpers import make_request


def step(decode_rows: int, prompt_tokens: int = 0) -> SchedulerOutput:
    """A step with ``decode_rows`` one-token decodes and one sequence computing
    ``prompt_tokens`` prompt tokens (its last among them: it samples)."""
    scheduled = []
    for i in range(decode_rows):
        seq = make_request(f"d{i}", 8)
        scheduled.append(ScheduledSequence(seq, 8, 1, True))
    if prompt_tokens:
        scheduled.append(ScheduledSequence(make_request("p", prompt_tokens), 0,
                                           prompt_tokens, True))
    return SchedulerOutput(scheduled, decode_rows + prompt_tokens)


def a_step(rows: int) -> float:
    return 0.009 + 0.0016 * rows


def test_decode_steps_fill_the_table_and_prompt_steps_the_token_cost() -> None:
    timer = StepTimer(None, max_rows=6)
    assert timer.profile().decode_step_s == () and timer.profile().prefill_token_s == 0
    for _ in range(3):
        for rows in (1, 2, 4):
            timer.observe(step(rows), a_step(rows))
    table = timer.profile().decode_step_s
    assert len(table) == 6
    assert [table[r - 1] for r in (1, 2, 4)] == pytest.approx([a_step(r) for r in (1, 2, 4)])
    assert table[2] == pytest.approx(a_step(3))  # between two timed counts
    assert timer.profile().prefill_token_s == 0  # no prompt step yet
    # 200 prompt tokens beside 2 decode rows: the rows' time is taken off
    timer.observe(step(2, 200), a_step(2) + 200 * 1.1e-3)
    assert timer.profile().prefill_token_s == pytest.approx(1.1e-3)
    timer.observe(step(0, 400), 400 * 1.5e-3)
    assert timer.profile().prefill_token_s == pytest.approx(1.3e-3)  # two averaged plainly
    # a few prompt tokens say little about their own cost: not timed
    timer.observe(step(4, MIN_PREFILL_TOKENS - 1), 1.0)
    assert timer.profile().prefill_token_s == pytest.approx(1.3e-3)


def test_with_a_speculator_its_table_is_read_not_timed_again() -> None:
    shared = StepCostModel()
    timer = StepTimer(shared, max_rows=2)
    for _ in range(5):
        timer.observe(step(1), 0.5)  # the speculator times decode steps itself
    assert not shared.measured and timer.profile().decode_step_s == ()
    for _ in range(3):
        shared.observe(1, 0.01)
    assert timer.profile().decode_step_s[0] == pytest.approx(0.01)
