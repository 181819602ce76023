"""Parallel sampling (``sampling.n``) in the torch engine: the prompt is
computed once, the choices share its full KV blocks and copy its partial last
block (exact block ids and reference counts, without a model), each choice
equals a single request seeded ``seed + i`` (tiny random-weight model), also
when choices are preempted and recomputed or find no slot at the fork, and a
cancel of the request or of one choice frees their blocks."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import pytest
import torch

from services.common.sampling import FinishReason, InvalidRequestError, SamplingOptions
from services.engine.torch_backend.engine_core import EngineCore, Submitted
from services.engine.torch_backend.kv_cache_manager import BlockCopy
from services.engine.torch_backend.paged_kv import PagedKVCache
from services.engine.torch_backend.sampler import SamplingRow
from services.engine.torch_backend.sequence import ChoiceGroup, Sequence, SequenceStatus
from services.engine.types import SequenceRequest, TokenDelta
from services.engine.validation import kv_tokens_needed, validate_kv_capacity

from .kv_helpers import book, create_scheduler
from .test_engine_core import (  # noqa: F401
    TINY,
    QueueSink,
    Recorder,
    make_core,
    recorder,
    tiny_model,
)

SAMPLED = SamplingOptions(temperature=1.0, seed=42, max_tokens=12, ignore_eos=True)


def group_of(request_id: str, prompt: int, n: int, max_tokens: int = 8) -> Sequence:
    """Choice 0 of an n-choice request holding its n - 1 unforked choices
    (as ``EngineCore.submit`` builds them), with arrivals 1000.. ."""
    options = SamplingOptions(max_tokens=max_tokens, ignore_eos=True, n=n)
    request = SequenceRequest(request_id, tuple(range(100, 100 + prompt)), options)
    choices = [Sequence(request, 1000 + i, SamplingRow(), index=i) for i in range(n)]
    group = ChoiceGroup(choices, choices[1:])
    for choice in choices:
        choice.group = group
    return choices[0]


def test_the_fork_shares_full_prompt_blocks_and_copies_the_partial_one() -> None:
    scheduler = create_scheduler(num_blocks=16, block_size=4)
    leader = group_of("p", prompt=10, n=3)  # blocks: 4 + 4 + 2 (partial)
    scheduler.add(leader)
    out = scheduler.schedule()
    assert [(s.seq.index, s.start, s.num_tokens) for s in out.scheduled] == [(0, 0, 10)]
    assert [c.index for c in out.scheduled[0].forks] == [1, 2]
    updates = book(scheduler, out, [7, [8], [9]])
    assert [(u.index, u.token_ids, u.finished) for u in updates] == [
        (0, (7,), False), (1, (8,), False), (2, (9,), False)]
    kv = scheduler.kv
    tables = [kv.block_ids(c) for c in leader.choices]
    assert tables == [[0, 1, 2], [0, 1, 3], [0, 1, 4]]
    assert out.block_copies == [BlockCopy(2, 3), BlockCopy(2, 4)]
    assert [kv.pool.block(i).ref_count for i in range(5)] == [3, 3, 1, 1, 1]
    assert all(c.num_computed_tokens == 10 and c.status is SequenceStatus.RUNNING
               for c in leader.choices)
    assert [c.token_ids[10:] for c in leader.choices] == [[7], [8], [9]]
    assert leader.choices[2].block_hashes == leader.block_hashes[:2]
    kv.check_integrity()
    # next step: one decode each, each writing into its own third block
    out = scheduler.schedule()
    assert [(s.seq.index, s.start, s.num_tokens) for s in out.scheduled] == [
        (0, 10, 1), (1, 10, 1), (2, 10, 1)]
    book(scheduler, out, [1, 1, 1])
    for choice in leader.choices:
        scheduler.abort(choice)
    scheduler.schedule()
    kv.check_integrity(idle=True)


def test_a_block_aligned_prompt_forks_without_a_copy_and_no_slot_means_recompute() -> None:
    scheduler = create_scheduler(num_blocks=16, block_size=4, max_num_seqs=2)
    leader = group_of("p", prompt=8, n=3)
    scheduler.add(leader)
    out = scheduler.schedule()
    book(scheduler, out, [7, 8, 9])
    assert out.block_copies == []
    one, two = leader.choices[1:]
    assert scheduler.kv.block_ids(one) == [0, 1]  # fully shared; its next token needs a block
    assert one.status is SequenceStatus.RUNNING
    assert two.status is SequenceStatus.WAITING and not scheduler.kv.holds(two)
    assert two.token_ids[8:] == [9] and two.num_computed_tokens == 0


def test_a_choice_cancelled_before_the_fork_ends_at_the_fork() -> None:
    scheduler = create_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=4)
    leader = group_of("p", prompt=6, n=3)
    scheduler.add(leader)
    book(scheduler, scheduler.schedule(), [])  # 4 of 6 prompt tokens
    assert scheduler.abort_choice(leader, 0) == [] and scheduler.abort_choice(leader, 2) == []
    updates = book(scheduler, scheduler.schedule(), [7, 8, 9])
    assert [(u.index, u.token_ids, u.finished) for u in updates] == [
        (0, (), True), (1, (8,), False), (2, (), True)]
    assert [c.finish_reason for c in leader.choices] == [
        FinishReason.CANCELLED, FinishReason.NONE, FinishReason.CANCELLED]
    assert scheduler.running == [leader.choices[1]]
    assert scheduler.kv.block_ids(leader.choices[1]) == [0, 2]
    scheduler.kv.check_integrity()


async def by_choice(submitted: Submitted, n: int) -> tuple[dict[int, list[int]],
                                                           dict[int, TokenDelta]]:
    """Each choice's tokens and last delta, read until all n finished."""
    tokens: dict[int, list[int]] = {i: [] for i in range(n)}
    last: dict[int, TokenDelta] = {}
    while len(last) < n:
        delta = await asyncio.wait_for(submitted.sink.queue.get(), timeout=20)
        assert delta.index not in last
        tokens[delta.index].extend(delta.token_ids)
        assert delta.num_generated_tokens == len(tokens[delta.index])
        if delta.finished:
            last[delta.index] = delta
    return tokens, last


async def singles(core: EngineCore, prompt: tuple[int, ...], options: SamplingOptions,
                  n: int) -> dict[int, list[int]]:
    """The n single requests choice i must equal: seed + i, one at a time."""
    loop = asyncio.get_running_loop()
    out = {}
    for i in range(n):
        single = replace(options, n=1, seed=options.choice_seed(i))
        tokens, _ = await by_choice(core.submit(SequenceRequest(f"single-{i}", prompt, single),
                                                QueueSink(loop)), 1)
        out[i] = tokens[0]
    return out


async def idle(core: EngineCore) -> None:
    while core.load().num_running or core.load().num_waiting:
        await asyncio.sleep(0.001)
    counts = core.check_integrity()
    assert counts.used == 0


async def test_choices_equal_single_requests_and_the_prompt_is_computed_once(
        make_core, recorder: Recorder) -> None:
    core = make_core(block_size=4)
    prompt = tuple(range(2, 12))  # 10 tokens: two full blocks and a partial one
    options = replace(SAMPLED, n=4)
    loop = asyncio.get_running_loop()
    tokens, last = await by_choice(core.submit(SequenceRequest("n4", prompt, options),
                                               QueueSink(loop)), 4)
    assert sum(s.num_prompt_tokens_computed for s in recorder.steps) == 10
    assert all(d.finish_reason is FinishReason.LENGTH and d.num_prompt_tokens == 10
               for d in last.values())
    assert len({tuple(t) for t in tokens.values()}) >= 2
    await idle(core)
    assert tokens == await singles(core, prompt, options, 4)
    again, _ = await by_choice(core.submit(SequenceRequest("n4", prompt, options),
                                           QueueSink(loop)), 4)
    assert again == tokens
    await idle(core)


async def test_preempted_and_unslotted_choices_are_recomputed_to_the_same_tokens(
        make_core, recorder: Recorder) -> None:
    # 12 blocks of 4 tokens: 4 choices of 6 + 24 tokens cannot all hold their
    # blocks at once, so choices are preempted and recomputed; with 3 slots the
    # fourth choice finds none at the fork and is computed from the queue.
    prompt = tuple(range(2, 8))
    options = replace(SAMPLED, n=4, max_tokens=24)
    roomy = make_core(block_size=4)
    expected = await singles(roomy, prompt, options, 4)
    core = make_core(block_size=4, num_blocks=12, max_num_seqs=3)
    loop = asyncio.get_running_loop()
    tokens, _ = await by_choice(core.submit(SequenceRequest("tight", prompt, options),
                                            QueueSink(loop)), 4)
    assert sum(s.num_preemptions for s in recorder.steps) > 0
    assert tokens == expected
    await idle(core)


async def test_cancelling_the_request_or_one_choice_frees_their_blocks(make_core) -> None:
    core = make_core(block_size=4)
    loop = asyncio.get_running_loop()
    options = replace(SAMPLED, n=4, max_tokens=400)
    submitted = core.submit(SequenceRequest("c", tuple(range(2, 12)), options), QueueSink(loop))
    seen: set[int] = set()
    while len(seen) < 4:  # every choice forked and decoding
        seen.add((await asyncio.wait_for(submitted.sink.queue.get(), timeout=20)).index)
    # The two full prompt blocks are shared by the four choices; each has its own
    # blocks after them (one or more: under load a choice may have decoded past
    # its first block before this check, so the count is read from the tables
    # under the core's state lock, not assumed).
    with core._state_lock:
        tables = [list(table) for table in core._kv._tables.values()]
        counts = core._kv.check_integrity()
    assert len(tables) == 4
    assert len({tuple(block.block_id for block in table[:2]) for table in tables}) == 1
    own = {block.block_id for table in tables for block in table[2:]}
    assert len(own) == sum(len(table) - 2 for table in tables)  # none shared
    assert counts.used == 2 + len(own)
    assert core.cancel_choice("c", 2) is True
    ended = None
    while ended is None:
        delta = await asyncio.wait_for(submitted.sink.queue.get(), timeout=20)
        if delta.finished:
            ended = delta
    assert (ended.index, ended.finish_reason) == (2, FinishReason.CANCELLED)
    assert core.cancel_choice("c", 2) is False
    assert core.cancel("c") is True
    finished = {2}
    while len(finished) < 4:
        delta = await asyncio.wait_for(submitted.sink.queue.get(), timeout=20)
        if delta.finished:
            assert delta.finish_reason is FinishReason.CANCELLED
            finished.add(delta.index)
    await idle(core)
    # The id is free.
    assert core.submit(SequenceRequest("c", (2, 3), SAMPLED), QueueSink(loop)) is not None


async def test_a_cancel_before_the_engine_took_it_in_ends_every_choice(make_core) -> None:
    core = make_core(block_size=4)
    loop = asyncio.get_running_loop()
    hold = core.submit(SequenceRequest("hold", (2, 3), replace(SAMPLED, max_tokens=2)),
                       QueueSink(loop))
    submitted = core.submit(SequenceRequest("early", (2, 3, 4), replace(SAMPLED, n=3)),
                            QueueSink(loop))
    core.cancel("early")
    _, last = await by_choice(submitted, 3)
    assert {d.finish_reason for d in last.values()} == {FinishReason.CANCELLED}
    await by_choice(hold, 1)
    await idle(core)


def test_copy_blocks_copies_every_layer() -> None:
    cache = PagedKVCache(TINY, num_blocks=4, block_size=4)
    cache.k.normal_()
    cache.v.normal_()
    cache.copy_blocks([1], [3])
    assert torch.equal(cache.k[:, :, 3], cache.k[:, :, 1])
    assert torch.equal(cache.v[:, :, 3], cache.v[:, :, 1])
    assert not torch.equal(cache.k[:, :, 2], cache.k[:, :, 1])


def test_kv_capacity_counts_n_choices_sharing_the_full_prompt_blocks() -> None:
    # 10-token prompt, blocks of 4: 8 shared slots, each choice 2 + 5 - 1 = 6 -> 8 slots
    assert kv_tokens_needed(10, 5) == 14
    assert kv_tokens_needed(10, 5, n=3, block_size=4) == 8 + 3 * 8
    validate_kv_capacity(10, 5, 32, n=3, block_size=4)
    with pytest.raises(InvalidRequestError) as info:
        validate_kv_capacity(10, 5, 31, n=3, block_size=4)
    assert info.value.code == grpc.StatusCode.OUT_OF_RANGE
    assert info.value.field == "sampling.n" and "need 32 KV slots" in str(info.value)


async def test_each_choice_carries_its_own_logprobs_and_choice_0_the_prompt_logprobs(
        make_core) -> None:
    core = make_core(block_size=4)
    loop = asyncio.get_running_loop()
    prompt = tuple(range(2, 12))
    options = replace(SAMPLED, n=3, max_tokens=6, logprobs=2, prompt_logprobs=1)

    async def logprobs_of(submitted: Submitted, n: int) -> tuple[dict, dict]:
        entries: dict[int, list] = {i: [] for i in range(n)}
        prompt_entries: dict[int, list] = {i: [] for i in range(n)}
        finished: set[int] = set()
        while len(finished) < n:
            delta = await asyncio.wait_for(submitted.sink.queue.get(), timeout=20)
            assert len(delta.logprobs) == len(delta.token_ids)
            entries[delta.index].extend(delta.logprobs)
            prompt_entries[delta.index].extend(delta.prompt_logprobs)
            if delta.finished:
                finished.add(delta.index)
        return entries, prompt_entries

    entries, prompt_entries = await logprobs_of(
        core.submit(SequenceRequest("lp", prompt, options), QueueSink(loop)), 3)
    assert len(prompt_entries[0]) == 9 and prompt_entries[1] == prompt_entries[2] == []
    for i in range(3):
        single = replace(options, n=1, seed=options.choice_seed(i))
        alone, alone_prompt = await logprobs_of(
            core.submit(SequenceRequest(f"lp-{i}", prompt, single), QueueSink(loop)), 1)
        assert entries[i] == alone[0], i
        assert alone_prompt[0] == prompt_entries[0]
    await idle(core)


async def test_penalised_choices_equal_penalised_single_requests(make_core) -> None:
    """Each choice keeps its own logits-processor state from the fork on (its
    output counts start empty, like its leader's at the fork): a penalised
    n=3 request equals three penalised single requests seeded seed+i."""
    core = make_core(block_size=4)
    prompt = tuple(range(2, 12))
    options = replace(SAMPLED, n=3, max_tokens=12, frequency_penalty=1.5,
                      presence_penalty=0.5, repetition_penalty=1.3, logit_bias=((5, 3.0),))
    loop = asyncio.get_running_loop()
    tokens, _ = await by_choice(core.submit(SequenceRequest("pen", prompt, options),
                                            QueueSink(loop)), 3)
    await idle(core)
    assert tokens == await singles(core, prompt, options, 3)
    plain, _ = await by_choice(core.submit(SequenceRequest(
        "plain", prompt, replace(SAMPLED, n=3, max_tokens=12)), QueueSink(loop)), 3)
    assert plain != tokens  # the penalties changed something
    await idle(core)
