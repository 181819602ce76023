"""The scheduler without a model: in-flight batching, chunked prefill under the token
budget, priority, preemption, prefix hits, cancels, stop conditions, and a long
random run that must leave no block behind."""

from __future__ import annotations

import random

import pytest

from services.common.sampling import FinishReason, Priority
from services.common.step_profile import StepProfile
from services.engine.torch_backend.sequence import SequenceStatus
from services.engine.torch_backend.step_budget import (MIN_OUTRANKED_PREFILL_TOKENS,
                                                        outranked_prefill_tokens)

from .kv_helpers import EOS, book, create_scheduler, make_request, step


def test_decode_and_chunked_prefill_share_a_step() -> None:
    scheduler = create_scheduler(max_num_batched_tokens=8)
    a, b = make_request("a", 3, max_tokens=4), make_request("b", 20, max_tokens=2)
    scheduler.add(a)
    scheduler.add(b)
    assert step(scheduler)[0] == [("a", 0, 3, True), ("b", 0, 5, False)]
    assert step(scheduler)[0] == [("a", 3, 1, True), ("b", 5, 7, False)]
    assert step(scheduler)[0] == [("a", 4, 1, True), ("b", 12, 7, False)]
    plan, updates = step(scheduler)
    assert plan == [("a", 5, 1, True), ("b", 19, 1, True)]  # b's last prompt token samples
    assert [(u.request_id, u.token_ids, u.finished) for u in updates] == [
        ("a", (7,), True), ("b", (7,), False)]
    assert a.finish_reason is FinishReason.LENGTH and a.num_generated_tokens == 4
    assert step(scheduler)[0] == [("b", 20, 1, True)]
    assert not scheduler.has_work()
    scheduler.kv.check_integrity(idle=True)


def test_max_chunk_tokens_caps_one_sequence_per_step() -> None:
    scheduler = create_scheduler(max_num_batched_tokens=16, max_chunk_tokens=6)
    scheduler.add(make_request("a", 10, max_tokens=1))
    scheduler.add(make_request("b", 3, max_tokens=1))
    assert step(scheduler)[0] == [("a", 0, 6, False), ("b", 0, 3, True)]
    assert step(scheduler)[0] == [("a", 6, 4, True)]


def test_waiting_join_by_priority_then_arrival() -> None:
    scheduler = create_scheduler(max_num_batched_tokens=4)
    for name, priority in [("batch-1", Priority.BATCH), ("inter-1", Priority.INTERACTIVE),
                           ("batch-2", Priority.BATCH), ("inter-2", Priority.INTERACTIVE)]:
        scheduler.add(make_request(name, 2, max_tokens=1, priority=priority))
    assert [s.request_id for s in scheduler.waiting()] == ["inter-1", "inter-2", "batch-1",
                                                          "batch-2"]
    assert step(scheduler)[0] == [("inter-1", 0, 2, True), ("inter-2", 0, 2, True)]
    assert step(scheduler)[0] == [("batch-1", 0, 2, True), ("batch-2", 0, 2, True)]


def test_an_interactive_arrival_joins_ahead_of_a_running_batch_prefill() -> None:
    # batch's 40-token prompt would take the whole 8-token budget for 5 steps; the
    # interactive request that arrives after its first chunk joins the next step,
    # alone: batch's chunk gets none of the budget left in the step of a prompt
    # that outranks it (that step's time is inter's TTFT).
    scheduler = create_scheduler(max_num_batched_tokens=8)
    scheduler.add(make_request("batch", 40, max_tokens=2, priority=Priority.BATCH))
    assert step(scheduler)[0] == [("batch", 0, 8, False)]
    scheduler.add(make_request("inter", 3, max_tokens=2))
    assert step(scheduler)[0] == [("inter", 0, 3, True)]
    # inter decodes (1 token, never deferred) while batch keeps prefilling.
    assert step(scheduler)[0] == [("inter", 3, 1, True), ("batch", 8, 7, False)]
    scheduler.add(make_request("batch-2", 3, max_tokens=1, priority=Priority.BATCH))
    # inter has finished. A later batch arrival is of batch's class: it joins first
    # too, and batch's prompt chunk takes the rest of the budget.
    assert step(scheduler)[0] == [("batch-2", 0, 3, True), ("batch", 15, 5, False)]


def test_a_short_arrival_joins_during_a_long_prompt_of_its_class() -> None:
    # A 2,000-token prompt in chunks of the whole 64-token budget: a 5-token request
    # arriving after its first chunk joins at the next step, not 31 steps later.
    scheduler = create_scheduler(num_blocks=600, max_num_batched_tokens=64)
    scheduler.add(make_request("long", 2000, max_tokens=1))
    assert step(scheduler)[0] == [("long", 0, 64, False)]
    scheduler.add(make_request("short", [900, 901, 902, 903, 904], max_tokens=3))
    assert step(scheduler)[0] == [("short", 0, 5, True), ("long", 64, 59, False)]
    # Once it runs, short decodes beside the long prompt's chunks.
    assert step(scheduler)[0] == [("short", 5, 1, True), ("long", 123, 63, False)]
    # A batch arrival does not defer an interactive prompt: it joins with what is left.
    scheduler.add(make_request("batch", [800, 801], max_tokens=1, priority=Priority.BATCH))
    assert step(scheduler)[0] == [("short", 6, 1, True), ("long", 186, 63, False)]
    scheduler.kv.check_integrity()


def _long_prompt_beside_a_decode(priority: Priority, profile: StepProfile):
    """A 4,000-token prompt of ``priority`` arriving while an INTERACTIVE request
    decodes 64 tokens (budget 256, blocks for both): the scheduler after the
    decoding one's first token and the long one's arrival, and both sequences."""
    scheduler = create_scheduler(num_blocks=300, block_size=16, max_num_batched_tokens=256,
                                 max_model_len=8192)
    scheduler.step_profile = profile
    inter = make_request("inter", 8, max_tokens=64)
    long = make_request("long", 4000, max_tokens=4, priority=priority)
    scheduler.add(inter)
    assert step(scheduler)[0] == [("inter", 0, 8, True)]
    scheduler.add(long)
    return scheduler, inter, long


def test_a_batch_prompt_beside_an_interactive_decode_gets_the_profiles_small_chunk() -> None:
    # A decode step of 1 row takes 20 ms and a prompt token 0.5 ms: a step at most
    # 2x the decode-only one carries (2 - 1) * 20 / 0.5 = 40 BATCH prompt tokens
    # (the QA finding: it carried 255, so each INTERACTIVE token waited a chunk).
    profile = StepProfile(prefill_token_s=0.5e-3, decode_step_s=(20e-3,))
    scheduler, inter, long = _long_prompt_beside_a_decode(Priority.BATCH, profile)
    steps = 0
    while not inter.finished:
        out = scheduler.schedule()
        plan = [(s.seq.request_id, s.start, s.num_tokens) for s in out.scheduled]
        assert plan == [("inter", inter.num_computed_tokens, 1),
                        ("long", long.num_computed_tokens, 40)]
        assert out.deferred_prompt_tokens == 255 - 40  # what it took before
        book(scheduler, out, [7] * sum(s.samples for s in out.scheduled))
        steps += 1
    assert steps == 63 and long.num_computed_tokens == 63 * 40
    # No starvation: alone, the rest of the prompt takes the whole budget.
    out = scheduler.schedule()
    assert [(s.seq.request_id, s.num_tokens) for s in out.scheduled] == [("long", 256)]
    assert out.deferred_prompt_tokens == 0
    book(scheduler, out, [])
    steps += 1
    while not long.finished:
        step(scheduler)
        steps += 1
    assert steps == 63 + 1 + 5 + 3  # the other 1,224 prompt tokens in 5 steps, 3 decodes
    scheduler.kv.check_integrity(idle=True)


def test_a_batch_prompt_beside_an_interactive_decode_progresses_by_the_floor() -> None:
    # A profile whose bound leaves no prompt token still lets the prompt progress.
    profile = StepProfile(prefill_token_s=10e-3, decode_step_s=(5e-3,))
    scheduler, _, _ = _long_prompt_beside_a_decode(Priority.BATCH, profile)
    assert step(scheduler)[0] == [("inter", 8, 1, True),
                                  ("long", 0, MIN_OUTRANKED_PREFILL_TOKENS, False)]


def test_an_interactive_prompt_in_the_step_leaves_the_outranked_prompt_none() -> None:
    # The tighter of the two limits holds: beside inter's decode the batch prompt
    # could take 40 tokens, but an interactive arrival's prompt is in the step too.
    profile = StepProfile(prefill_token_s=0.5e-3, decode_step_s=(20e-3,))
    scheduler, _, _ = _long_prompt_beside_a_decode(Priority.BATCH, profile)
    assert step(scheduler)[0] == [("inter", 8, 1, True), ("long", 0, 40, False)]
    scheduler.add(make_request("inter-2", 5, max_tokens=2))
    out = scheduler.schedule()
    assert [(s.seq.request_id, s.num_tokens) for s in out.scheduled] == [
        ("inter", 1), ("inter-2", 5)]
    assert out.deferred_prompt_tokens == 250  # all it would have taken of the budget left


def test_a_prompt_beside_a_decode_of_its_priority_takes_the_budget_left() -> None:
    profile = StepProfile(prefill_token_s=0.5e-3, decode_step_s=(20e-3,))
    scheduler, _, _ = _long_prompt_beside_a_decode(Priority.INTERACTIVE, profile)
    out = scheduler.schedule()
    assert [(s.seq.request_id, s.num_tokens) for s in out.scheduled] == [
        ("inter", 1), ("long", 255)]
    assert out.deferred_prompt_tokens == 0


def test_an_interactive_arrival_preempts_the_latest_batch_sequence_when_slots_are_full() -> None:
    scheduler = create_scheduler(max_num_seqs=2, block_size=4)
    batch_1 = make_request("batch-1", 6, max_tokens=8, priority=Priority.BATCH)
    batch_2 = make_request("batch-2", 6, max_tokens=8, priority=Priority.BATCH)
    scheduler.add(batch_1)
    scheduler.add(batch_2)
    assert step(scheduler, 5)[0] == [("batch-1", 0, 6, True), ("batch-2", 0, 6, True)]
    assert step(scheduler, 5)[0] == [("batch-1", 6, 1, True), ("batch-2", 6, 1, True)]
    inter = make_request("inter", 3, max_tokens=2)
    scheduler.add(inter)
    out = scheduler.schedule()
    # The latest-arrived batch sequence gives its slot; inter joins in the same step
    # (after the decodes, which are planned first).
    assert out.preempted == [batch_2]
    assert [(s.seq.request_id, s.start, s.num_tokens) for s in out.scheduled] == [
        ("batch-1", 7, 1), ("inter", 0, 3)]
    assert (batch_2.status, batch_2.num_computed_tokens, batch_2.token_ids[6:]) == (
        SequenceStatus.WAITING, 0, [5, 5])
    assert (scheduler.num_preemptions, scheduler.num_priority_preemptions) == (1, 1)
    book(scheduler, out, [6, 6])
    # A waiting batch sequence never preempts a running one of its class.
    assert step(scheduler, 6)[0] == [("inter", 3, 1, True), ("batch-1", 8, 1, True)]
    assert inter.finished
    # batch-2 resumes in the freed slot: its first full block (4 of its 8 tokens)
    # is still in the prefix cache, so it recomputes only the other 4.
    out = scheduler.schedule()
    assert [(s.seq.request_id, s.start, s.num_tokens) for s in out.scheduled] == [
        ("batch-1", 9, 1), ("batch-2", 4, 4)]
    assert out.prefix_hits == 4
    book(scheduler, out, [7, 7])
    assert batch_2.token_ids[6:] == [5, 5, 7]
    while scheduler.has_work():
        step(scheduler)
    assert scheduler.num_preemptions == 1
    scheduler.kv.check_integrity(idle=True)


def test_priority_preemption_frees_one_slot_per_outranking_arrival() -> None:
    scheduler = create_scheduler(max_num_seqs=3)
    for name in ("b1", "b2", "b3"):
        scheduler.add(make_request(name, 4, max_tokens=8, priority=Priority.BATCH))
    step(scheduler)
    for name in ("i1", "i2"):
        scheduler.add(make_request(name, 4, max_tokens=8))
    out = scheduler.schedule()
    assert [s.request_id for s in out.preempted] == ["b3", "b2"]
    assert [s.seq.request_id for s in out.scheduled] == ["b1", "i1", "i2"]
    # The preempted batch sequences wait in their arrival order behind no one else.
    assert [s.request_id for s in scheduler.waiting()] == ["b2", "b3"]


def test_max_num_seqs_bounds_the_running_batch() -> None:
    scheduler = create_scheduler(max_num_seqs=2)
    for name in "abc":
        scheduler.add(make_request(name, 2, max_tokens=2))
    assert [row[0] for row in step(scheduler)[0]] == ["a", "b"]
    assert (scheduler.num_running, scheduler.num_waiting) == (2, 1)
    assert [row[0] for row in step(scheduler)[0]] == ["a", "b"]  # both finish here
    assert step(scheduler)[0] == [("c", 0, 2, True)]


def test_out_of_blocks_preempts_the_lowest_priority_running_sequence() -> None:
    # 4 blocks of 4 tokens. inter and batch take 2 blocks each; when inter needs a
    # third, batch (lowest priority) is preempted and recomputed later.
    scheduler = create_scheduler(num_blocks=4, block_size=4, enable_caching=False)
    inter = make_request("inter", 7, max_tokens=4)
    batch = make_request("batch", 7, max_tokens=4, priority=Priority.BATCH)
    scheduler.add(batch)
    scheduler.add(inter)
    assert step(scheduler, 5)[0] == [("inter", 0, 7, True), ("batch", 0, 7, True)]
    assert (scheduler.kv.block_ids(inter), scheduler.kv.block_ids(batch)) == ([0, 1], [2, 3])
    assert step(scheduler, 5)[0] == [("inter", 7, 1, True), ("batch", 7, 1, True)]
    out = scheduler.schedule()  # inter's 9th token needs a block: batch is preempted
    assert out.preempted == [batch]
    assert [(s.seq.request_id, s.start, s.num_tokens) for s in out.scheduled] == [
        ("inter", 8, 1)]
    assert scheduler.kv.block_ids(inter) == [0, 1, 3]
    assert (batch.status, batch.num_computed_tokens, batch.num_preemptions) == (
        SequenceStatus.WAITING, 0, 1)
    assert batch.token_ids[7:] == [5, 5]  # keeps its generated tokens
    book(scheduler, out, [6])
    # inter's last token; batch (9 tokens, 3 blocks) does not fit beside it yet.
    assert step(scheduler, 6)[0] == [("inter", 9, 1, True)]
    assert inter.finish_reason is FinishReason.LENGTH
    # batch recomputes its prompt and both generated tokens, then samples the third.
    assert step(scheduler, 8)[0] == [("batch", 0, 9, True)]
    assert step(scheduler, 8)[0] == [("batch", 9, 1, True)]
    assert batch.finish_reason is FinishReason.LENGTH
    assert batch.token_ids[7:] == [5, 5, 8, 8]
    assert scheduler.num_preemptions == 1
    scheduler.kv.check_integrity(idle=True)


def test_the_sequence_needing_a_block_preempts_itself_when_it_is_last() -> None:
    scheduler = create_scheduler(num_blocks=3, block_size=4)
    inter = make_request("inter", 5, max_tokens=3)  # 2 blocks, room up to 8 tokens
    batch = make_request("batch", [200, 201, 202, 203], max_tokens=2,
                         priority=Priority.BATCH)  # 1 full block
    scheduler.add(batch)
    scheduler.add(inter)
    assert step(scheduler)[0] == [("inter", 0, 5, True), ("batch", 0, 4, True)]
    out = scheduler.schedule()  # batch's 5th token needs a block; it is last in order
    assert out.preempted == [batch]
    assert [s.seq.request_id for s in out.scheduled] == ["inter"]
    book(scheduler, out, [7])
    assert step(scheduler)[0] == [("inter", 6, 1, True)]  # batch still does not fit
    assert inter.finished
    # batch's first block was computed and cached: it recomputes token 5 only.
    out = scheduler.schedule()
    assert [(s.seq.request_id, s.start, s.num_tokens) for s in out.scheduled] == [
        ("batch", 4, 1)]
    assert (out.prefix_queries, out.prefix_hits) == (5, 4)
    book(scheduler, out, [7])
    assert batch.finish_reason is FinishReason.LENGTH and batch.num_cached_tokens == 0
    scheduler.kv.check_integrity(idle=True)


def test_a_prefix_hit_starts_the_sequence_further_along() -> None:
    scheduler = create_scheduler(block_size=4)
    shared = list(range(500, 508))
    a = make_request("a", shared + [1, 2], max_tokens=1)
    scheduler.add(a)
    out = scheduler.schedule()
    assert (out.prefix_queries, out.prefix_hits) == (10, 0)
    book(scheduler, out, [3])
    b = make_request("b", shared + [9, 9, 9], max_tokens=1)
    scheduler.add(b)
    out = scheduler.schedule()
    assert [(s.seq.request_id, s.start, s.num_tokens) for s in out.scheduled] == [("b", 8, 3)]
    assert (out.prefix_queries, out.prefix_hits) == (11, 8)
    # a's first two blocks, then a's third: freed without a hash, it is reused first
    assert a.finished and scheduler.kv.block_ids(b) == [0, 1, 2]
    book(scheduler, out, [3])
    assert b.delta(()).num_cached_tokens == 8


def test_cancel_waiting_is_immediate_and_running_at_the_boundary() -> None:
    scheduler = create_scheduler(max_num_seqs=1)
    running, waiting = make_request("running", 4), make_request("waiting", 4)
    scheduler.add(running)
    scheduler.add(waiting)
    step(scheduler)
    assert scheduler.abort(waiting) is True
    assert (waiting.status, waiting.finish_reason) == (SequenceStatus.FINISHED,
                                                      FinishReason.CANCELLED)
    assert scheduler.num_waiting == 0
    assert scheduler.abort(running) is False  # flagged; leaves at the next schedule()
    assert scheduler.kv.block_ids(running) == [0]
    out = scheduler.schedule()
    assert out.finished == [running] and out.scheduled == []
    assert running.finish_reason is FinishReason.CANCELLED
    scheduler.kv.check_integrity(idle=True)


def test_a_request_id_may_come_back_while_its_cancelled_sequence_still_runs() -> None:
    """The engine core frees a cancelled id at once; the scheduler, the KV block
    tables and the proposers tell the old and the new sequence apart by
    identity (``arrival``), never by request id."""
    scheduler = create_scheduler(max_num_seqs=2)
    old = make_request("same", 6, max_tokens=4)
    scheduler.add(old)
    step(scheduler)  # old prefills and samples its first token
    old_blocks = scheduler.kv.block_ids(old)
    assert scheduler.abort(old) is False  # running: flagged, leaves at the next schedule
    new = make_request("same", 6, max_tokens=4)
    scheduler.add(new)
    out = scheduler.schedule()
    assert out.finished == [old] and old.finish_reason is FinishReason.CANCELLED
    assert [(s.seq, s.start, s.num_tokens) for s in out.scheduled] == [(new, 4, 2)]
    assert scheduler.kv.block_ids(old) == []
    # new reuses old's prompt block from the prefix cache, never old's table.
    assert scheduler.kv.block_ids(new)[0] == old_blocks[0]
    assert new.num_cached_tokens == 4
    book(scheduler, out, [7])
    assert new.token_ids[6:] == [7]
    scheduler.finish_all(FinishReason.ERROR)
    scheduler.kv.check_integrity(idle=True)


def test_cancel_during_the_step_finishes_without_its_token() -> None:
    scheduler = create_scheduler()
    seq = make_request("a", 4)
    scheduler.add(seq)
    out = scheduler.schedule()
    scheduler.abort(seq)  # arrives while the step computes
    updates = book(scheduler, out, [7])
    assert [(u.token_ids, u.finished) for u in updates] == [((), True)]
    assert seq.finish_reason is FinishReason.CANCELLED and seq.num_generated_tokens == 0
    scheduler.kv.check_integrity(idle=True)


@pytest.mark.parametrize(("kwargs", "tokens", "reason", "generated"), [
    ({"ignore_eos": False}, [5, EOS, 5], FinishReason.STOP, 2),
    ({"ignore_eos": True}, [5, EOS, 5], FinishReason.LENGTH, 3),
    ({"stop_token_ids": (6,)}, [5, 6, 5], FinishReason.STOP, 2),
    ({}, [5, 5, 5], FinishReason.LENGTH, 3),
])
def test_stop_conditions(kwargs: dict, tokens: list[int], reason: FinishReason,
                         generated: int) -> None:
    scheduler = create_scheduler()
    seq = make_request("a", 4, max_tokens=3, **kwargs)
    scheduler.add(seq)
    for token in tokens:
        if scheduler.has_work():
            step(scheduler, token)
    assert (seq.finish_reason, seq.num_generated_tokens) == (reason, generated)
    assert seq.token_ids[4:] == tokens[:generated]


def test_the_context_window_finishes_with_length() -> None:
    scheduler = create_scheduler(max_model_len=6)
    seq = make_request("a", 4, max_tokens=100)
    scheduler.add(seq)
    while scheduler.has_work():
        step(scheduler)
    assert (seq.finish_reason, seq.num_tokens) == (FinishReason.LENGTH, 6)


@pytest.mark.parametrize("enable_caching", [True, False])
def test_random_submit_cancel_finish_leaves_no_block_behind(enable_caching: bool) -> None:
    rng = random.Random(1234 if enable_caching else 4321)
    scheduler = create_scheduler(num_blocks=24, block_size=4, max_num_batched_tokens=24,
                                 max_num_seqs=6, enable_caching=enable_caching)
    prefixes = [list(range(1000 + 50 * i, 1000 + 50 * i + 12)) for i in range(3)]
    live: dict[str, object] = {}
    finished = cancelled = 0
    for event in range(2000):
        roll = rng.random()
        if roll < 0.3:
            prompt = rng.choice(prefixes)[:rng.randint(0, 12)] + [
                rng.randint(3, 90) for _ in range(rng.randint(1, 14))]
            seq = make_request(f"r{event}", prompt, max_tokens=rng.randint(1, 12),
                               priority=rng.choice(list(Priority)),
                               ignore_eos=rng.random() < 0.5)
            scheduler.add(seq)
            live[seq.request_id] = seq
        elif roll < 0.45 and live:
            seq = live.pop(rng.choice(sorted(live)))
            if scheduler.abort(seq):
                cancelled += 1
            else:
                live[seq.request_id] = seq  # leaves at the next step boundary
        else:
            out = scheduler.schedule()
            sampled = [rng.choice([EOS, 5, 6, 7]) for s in out.scheduled if s.samples]
            updates = book(scheduler, out, sampled)
            for seq in out.finished + [u for u in updates if u.finished]:
                live.pop(seq.request_id, None)
                finished += 1
            assert out.num_scheduled_tokens <= 24 and len(scheduler.running) <= 6
        scheduler.kv.check_integrity()
    while scheduler.has_work():
        out = scheduler.schedule()
        book(scheduler, out, [5] * sum(s.samples for s in out.scheduled))
    assert (scheduler.num_running, scheduler.num_waiting) == (0, 0)
    counts = scheduler.kv.check_integrity(idle=True)
    assert counts.free + counts.cached == 24 and counts.used == 0
    assert (counts.cached > 0) is enable_caching
    assert scheduler.num_preemptions > 0 and finished > 100 and cancelled > 10


def test_pending_prefill_tokens_count_waiting_and_prefilling_sequences() -> None:
    scheduler = create_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=16)
    for name, length in (("a", 20), ("b", 8)):
        scheduler.add(make_request(name, length))
    assert scheduler.pending_prefill_tokens() == 28
    step(scheduler)  # 16 tokens of a: 4 left to prefill; b waits
    assert scheduler.pending_prefill_tokens() == 4 + 8
    step(scheduler)
    step(scheduler)  # both decode now
    assert scheduler.pending_prefill_tokens() == 0


def test_a_huge_slowdown_does_not_limit_and_does_not_overflow() -> None:
    """QA: a slowdown of ``inf`` reached ``math.floor`` (OverflowError) and
    failed every request; a finite but huge one does not limit either."""
    profile = StepProfile(1.1e-3, (9.2e-3,))
    assert outranked_prefill_tokens(profile, 1, 1e300) >= 1 << 31
    assert outranked_prefill_tokens(profile, 1, float("inf")) >= 1 << 31
    assert outranked_prefill_tokens(profile, 1, 2.0) == 8  # 9.2 ms / 1.1 ms
