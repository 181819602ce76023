"""The router's admission controller on its own: queue limits, the retry hint,
dispatch order (aging, class, tenant VTC, FIFO), the batch window, deadlines,
cancellation and the KV reservation."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.common.sampling import Priority
from services.router.admission import (
    AdmissionConfig,
    AdmissionController,
    AdmissionRefused,
    Job,
    NoReplicaServing,
    ReplicaCapacity,
    Ticket,
)
from services.router.engine_client import OpenRequest

INTERACTIVE, BATCH = Priority.INTERACTIVE, Priority.BATCH


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def job(name: str, priority: Priority = INTERACTIVE, tenant: str = "", prompt: int = 10,
        max_tokens: int = 100) -> Job:
    return Job(name, priority, tenant, prompt, max_tokens)


def controller(slots: int = 2, *, clock: Clock | None = None, kv: int = 0,
               **config: object) -> AdmissionController:
    config.setdefault("batch_window_s", 0.0)
    return AdmissionController(
        AdmissionConfig(**config), "m", [ReplicaCapacity(slots, kv)],  # type: ignore[arg-type]
        **({"clock": clock} if clock else {}))


async def queued(ctl: AdmissionController, j: Job, **kw: object) -> asyncio.Task[Ticket]:
    """Starts admit(j) and lets it reach the queue."""
    task = asyncio.create_task(ctl.admit(j, **kw))  # type: ignore[arg-type]
    await asyncio.sleep(0)
    return task


def order_of(tasks: dict[str, asyncio.Task[Ticket]]) -> list[str]:
    return [name for name, t in tasks.items() if t.done()]


async def release_one_at_a_time(running: list[Ticket], tasks: dict[str, asyncio.Task[Ticket]]
                                ) -> list[str]:
    """Releases running tickets one by one; returns the dispatch order of ``tasks``."""
    order: list[str] = []
    pending = dict(tasks)
    while pending:
        running.pop(0).release()
        await asyncio.wait(pending.values(), timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
        for name, task in list(pending.items()):
            if task.done():
                order.append(name)
                running.append(task.result())
                del pending[name]
    return order


async def refused_hint(ctl: AdmissionController, *, fill: bool = True) -> float:
    """The retry hint (s) of a request refused by ``ctl``'s full one-place
    queue; ``fill``: queue a request first to fill it."""
    if fill:
        await queued(ctl, job("queued"))
    with pytest.raises(AdmissionRefused) as refused:
        await ctl.admit(job("refused"))
    assert refused.value.reason == "queue_full"
    return refused.value.retry_after_s


async def test_room_grants_at_once_and_a_release_dispatches_the_queue_in_fifo_order() -> None:
    ctl = controller(slots=2, max_queued_requests=4)
    a, b = await ctl.admit(job("a")), await ctl.admit(job("b"))
    tasks = {n: await queued(ctl, job(n)) for n in "cde"}
    assert ctl.queue_depth(INTERACTIVE) == 3 and not any(t.done() for t in tasks.values())
    assert await release_one_at_a_time([a, b], tasks) == ["c", "d", "e"]
    assert ctl.queue_depth(INTERACTIVE) == 0 and ctl.num_running == 2


async def test_a_full_queue_refuses_at_once_with_a_hint_from_the_running_decode_rates() -> None:
    clock = Clock()
    ctl = controller(slots=2, clock=clock, max_queued_requests=2)
    fast, slow = await ctl.admit(job("fast", max_tokens=100)), await ctl.admit(
        job("slow", max_tokens=100))
    # fast: 50 tokens at 10 ms each (0.5 s left); slow: 10 tokens at 100 ms (9 s left).
    fast.on_tokens(1, clock.now)
    slow.on_tokens(1, clock.now)
    for step in range(1, 50):
        fast.on_tokens(1, clock.now + step * 0.010)
    for step in range(1, 10):
        slow.on_tokens(1, clock.now + step * 0.100)
    clock.now += 0.9
    for n in "cd":
        await queued(ctl, job(n))
    with pytest.raises(AdmissionRefused) as refused:
        await ctl.admit(job("e"))
    assert refused.value.reason == "queue_full"
    # fast's 50 remaining tokens at its 10 ms/token, from its last token at +0.49 s.
    assert refused.value.retry_after_s == pytest.approx(0.5, rel=0.05)
    assert "queue" in refused.value.message and "retry after" in refused.value.message
    # A refused batch request also waits for the two interactive ones queued
    # ahead of it: the third slot to free is fast's successor's or slow's.
    for n in "fg":
        await queued(ctl, job(n, BATCH))
    with pytest.raises(AdmissionRefused) as refused_batch:
        await ctl.admit(job("h", BATCH))
    assert refused_batch.value.retry_after_s > 5 * refused.value.retry_after_s


async def test_tokens_of_the_first_delivery_do_not_speed_up_the_measured_decode_rate() -> None:
    """Accepted drafts arrive together: a first delivery of 4 tokens, then one
    token 100 ms later, is 100 ms a token (the old rate divided by 4 tokens)."""
    clock = Clock()
    ctl = controller(slots=1, clock=clock, max_queued_requests=1)
    running = await ctl.admit(job("a", max_tokens=100))
    running.on_tokens(4, clock.now)
    running.on_tokens(1, clock.now + 0.1)
    assert running.measured_tpot_s() == pytest.approx(0.1)
    clock.now += 0.1
    await queued(ctl, job("b"))
    with pytest.raises(AdmissionRefused) as refused:
        await ctl.admit(job("c"))
    assert refused.value.retry_after_s == pytest.approx(95 * 0.1, rel=0.05)  # 95 tokens left


async def test_the_queued_prompt_token_limit_refuses_but_never_an_empty_queue() -> None:
    ctl = controller(slots=1, max_queued_prompt_tokens=100)
    await ctl.admit(job("run"))
    big = await queued(ctl, job("big", prompt=500))  # alone in the queue: accepted
    with pytest.raises(AdmissionRefused) as refused:
        await ctl.admit(job("more", prompt=1))
    assert refused.value.reason == "queued_tokens"
    assert ctl.queued_tokens(INTERACTIVE) == 500
    big.cancel()


async def test_interactive_goes_before_batch_that_arrived_earlier() -> None:
    ctl = controller(slots=1)
    first = await ctl.admit(job("first"))
    tasks = {"b1": await queued(ctl, job("b1", BATCH)), "b2": await queued(ctl, job("b2", BATCH)),
             "i1": await queued(ctl, job("i1")), "i2": await queued(ctl, job("i2"))}
    assert await release_one_at_a_time([first], tasks) == ["i1", "i2", "b1", "b2"]


async def test_interactive_requests_run_at_once_when_batch_requests_hold_every_slot() -> None:
    # The engines preempt batch sequences for interactive ones, so batch requests
    # never hold interactive ones back; interactive ones still count against
    # each other, and a batch request waits for a slot free of both.
    ctl = controller(slots=2, kv=1000)
    batch = [await ctl.admit(job(f"b{i}", BATCH, prompt=200, max_tokens=200)) for i in range(2)]
    i1 = await ctl.admit(job("i1", prompt=200, max_tokens=200))
    i2 = await ctl.admit(job("i2", prompt=200, max_tokens=200))
    assert ctl.num_running == 4
    i3 = await queued(ctl, job("i3"))
    b3 = await queued(ctl, job("b3", BATCH))
    assert not i3.done() and not b3.done()
    i1.release()
    await asyncio.wait([i3, b3], timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
    assert i3.done() and not b3.done()
    for ticket in (*batch, i2):
        ticket.release()
    await asyncio.wait([b3], timeout=1.0)
    assert b3.done()  # i3 and b3 now fill the 2 slots
    assert ctl.num_running == 2


async def test_a_request_past_the_aging_bound_goes_first_whatever_its_class() -> None:
    clock = Clock()
    ctl = controller(slots=1, clock=clock, max_queue_wait_s=5.0)
    first = await ctl.admit(job("first"))
    tasks = {"old_batch": await queued(ctl, job("old_batch", BATCH))}
    clock.now += 6.0
    tasks["new_interactive"] = await queued(ctl, job("new_interactive"))
    assert await release_one_at_a_time([first], tasks) == ["old_batch", "new_interactive"]


async def test_vtc_a_flooding_tenant_cannot_starve_a_late_one() -> None:
    ctl = controller(slots=2)
    running = [await ctl.admit(job(f"a{i}", tenant="A", prompt=400)) for i in range(2)]
    tasks = {f"a{i}": await queued(ctl, job(f"a{i}", tenant="A", prompt=400))
             for i in range(2, 20)}
    tasks.update({f"b{i}": await queued(ctl, job(f"b{i}", tenant="B", prompt=20))
                  for i in range(2)})
    order = await release_one_at_a_time(running, tasks)
    # B is lifted to A's counter; ties go to the earlier arrival (A's head),
    # then A's counter is past B's: both of B's go before A's third queued one.
    assert order.index("b1") < order.index("a4"), order


async def test_without_tenants_the_order_is_fifo() -> None:
    ctl = controller(slots=1)
    first = await ctl.admit(job("first"))
    names = [f"r{i}" for i in range(8)]
    tasks = {n: await queued(ctl, job(n, prompt=10 * (8 - i))) for i, n in enumerate(names)}
    assert await release_one_at_a_time([first], tasks) == names


async def test_batch_requests_wait_the_window_then_go_together() -> None:
    ctl = controller(slots=8, batch_window_s=0.05)
    loop = asyncio.get_running_loop()
    began = loop.time()
    tasks = [await queued(ctl, job(f"b{i}", BATCH)) for i in range(3)]
    await asyncio.sleep(0.01)
    assert not any(t.done() for t in tasks)  # inside the window
    tickets = await asyncio.gather(*tasks)
    assert loop.time() - began >= 0.045
    assert len({t.dispatched_at for t in tickets}) == 1  # one dispatch
    interactive = await asyncio.wait_for(ctl.admit(job("i")), 0.01)  # no window for it
    assert interactive.job.priority is INTERACTIVE


async def test_a_deadline_that_the_predicted_wait_passes_is_refused_at_once() -> None:
    clock = Clock()
    ctl = controller(slots=1, clock=clock)
    running = await ctl.admit(job("run", max_tokens=100))
    running.on_tokens(1, clock.now)
    running.on_tokens(1, clock.now + 0.1)  # 100 ms/token, 98 left: ~9.8 s
    with pytest.raises(AdmissionRefused) as refused:
        await ctl.admit(job("hurry"), deadline=clock.now + 2.0)
    assert refused.value.reason == "deadline"
    assert refused.value.retry_after_s == pytest.approx(9.8, rel=0.05)
    assert ctl.queue_depth(INTERACTIVE) == 0
    patient = await queued(ctl, job("patient"), deadline=clock.now + 60.0)
    assert ctl.queue_depth(INTERACTIVE) == 1
    patient.cancel()


async def test_a_deadline_passing_in_the_queue_and_a_cancel_both_leave_no_entry() -> None:
    ctl = controller(slots=1)
    running = await ctl.admit(job("run", max_tokens=3))
    now = time.monotonic()
    running.on_tokens(1, now)
    running.on_tokens(1, now + 0.001)  # predicted to end in ~1 ms: the deadline is met...
    with pytest.raises(TimeoutError):  # ...but it never ends, so the wait runs out
        await ctl.admit(job("late"), deadline=time.monotonic() + 0.05)
    assert ctl.queue_depth(INTERACTIVE) == 0
    cancelled = await queued(ctl, job("gone"))
    cancelled.cancel()
    await asyncio.sleep(0)
    assert ctl.queue_depth(INTERACTIVE) == 0
    waiting = await queued(ctl, job("next"))
    running.release()
    ticket = await asyncio.wait_for(waiting, 1.0)
    assert ticket.job.request_id == "next" and ctl.num_running == 1


async def test_a_grant_racing_a_cancel_releases_the_slot() -> None:
    ctl = controller(slots=1)
    running = await ctl.admit(job("run"))
    waiting = await queued(ctl, job("raced"))
    waiting.cancel()      # the cancel is delivered at the task's next resume...
    running.release()     # ...after this grants it the slot
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert ctl.num_running == 0


async def test_kv_reservations_hold_a_request_that_does_not_fit_until_room_frees() -> None:
    ctl = controller(slots=8, kv=1000)
    big = await ctl.admit(job("big", prompt=500, max_tokens=300))
    second = await queued(ctl, job("second", prompt=200, max_tokens=100))
    assert not second.done()  # 800 + 300 > 1000
    big.release()
    assert (await asyncio.wait_for(second, 1.0)).job.request_id == "second"
    alone = controller(slots=8, kv=1000)
    assert (await alone.admit(job("huge", prompt=5000))).job.request_id == "huge"


def two_replicas(clock: Clock, slots: int = 2, kv: int = 0,
                 **config: object) -> AdmissionController:
    """A controller over replicas "a" and "b" of ``slots`` sequences each."""
    config.setdefault("batch_window_s", 0.0)
    return AdmissionController(
        AdmissionConfig(**config), "m",  # type: ignore[arg-type]
        {"a": ReplicaCapacity(slots, kv), "b": ReplicaCapacity(slots, kv)}, clock=clock)


async def test_requests_on_a_replica_that_left_hold_no_slot_of_those_that_remain() -> None:
    """QA: two 8-slot engines, one draining with 8 running: the cap fell to 8
    while those 8 still counted, so nothing was admitted until they ended and
    the other engine sat idle (a 376 s retry hint). Running requests count per
    replica: those on a replica that left hold none of the others' slots."""
    clock = Clock()
    ctl = two_replicas(clock, max_queued_requests=1)
    draining = [await ctl.admit(job(f"a{i}", max_tokens=5)) for i in range(2)]
    for ticket in draining:
        ticket.place("a")
    ctl.set_replicas({"b": ReplicaCapacity(2)})  # "a" drains: out of routing
    assert (ctl.max_running, ctl.num_running, ctl.num_running_in_service) == (2, 2, 0)
    on_b = [await asyncio.wait_for(ctl.admit(job(f"b{i}", max_tokens=10)), 0.5)
            for i in range(2)]
    for ticket in on_b:
        ticket.place("b")
    waiting = await queued(ctl, job("c"))
    draining[0].release()  # ends on "a": frees nothing on "b"
    await asyncio.sleep(0)
    assert not waiting.done() and ctl.num_running_in_service == 2
    # The hint is b's requests' end (10 tokens at the initial 50 ms + their
    # prefill), not the sooner end of a's (5 tokens), which frees no slot here.
    with pytest.raises(AdmissionRefused) as refused:
        await ctl.admit(job("d"))
    assert refused.value.retry_after_s == pytest.approx(10 * 0.05 + 10 * 0.0005)
    on_b[0].release()
    assert (await asyncio.wait_for(waiting, 0.5)).job.request_id == "c"
    # "a" serves again (its drain was undone): its running request counts again.
    ctl.set_replicas({"a": ReplicaCapacity(2), "b": ReplicaCapacity(2)})
    assert ctl.num_running_in_service == 3


async def test_a_request_with_n_choices_takes_n_sequence_slots() -> None:
    """QA: two 2-slot engines, four requests of n=2 at once: all four were
    admitted (one slot each), two of them waited ~10 s inside the engines for
    their first token, out of the router's queue and its hint. Replicas' caps
    count sequences, so an n-choice request takes n of them."""
    clock = Clock()
    ctl = two_replicas(clock, max_queued_requests=4)
    first = [await asyncio.wait_for(ctl.admit(Job(f"n{i}", INTERACTIVE, "", 10, 100, 2)), 0.5)
             for i in range(2)]
    for ticket, replica in zip(first, "ab", strict=True):
        ticket.place(replica)
    assert ctl.num_running_in_service == 4  # sequences
    third = await queued(ctl, Job("n2", INTERACTIVE, "", 10, 100, 2))
    one = await queued(ctl, job("one"))
    assert not third.done() and not one.done()
    first[0].release()  # two slots free on "a": the n=2 request first (FIFO), then nothing
    ticket = await asyncio.wait_for(third, 0.5)
    ticket.place("a")
    await asyncio.sleep(0)
    assert not one.done()
    # n larger than a replica's slots still runs once a whole replica is free
    ctl2 = two_replicas(clock)
    wide = await asyncio.wait_for(ctl2.admit(Job("wide", INTERACTIVE, "", 10, 100, 5)), 0.5)
    assert wide.job.sequences == 5


async def test_a_slot_placed_on_a_replica_that_left_meanwhile_frees_its_place() -> None:
    """A request granted while both replicas served, placed on one that left
    before its stream opened (or retried elsewhere), stops counting at once,
    and so does its KV reservation."""
    clock = Clock()
    ctl = two_replicas(clock, slots=1, kv=1000)
    first = await ctl.admit(job("first", prompt=500, max_tokens=400))
    ctl.set_replicas({"b": ReplicaCapacity(1, 1000)})
    waiting = await queued(ctl, job("next", prompt=500, max_tokens=400))
    assert not waiting.done()  # first is not placed: it may still go to "b"
    first.place("a")
    assert (await asyncio.wait_for(waiting, 0.5)).job.request_id == "next"
    first.release()
    assert ctl.num_running == 1 and ctl._tallies.keys() == {None}  # "a"'s tally forgotten


async def test_a_request_waiting_on_its_prefixs_full_replica_takes_no_slot_of_another() -> None:
    """QA: two 2-slot engines; "a" runs 2 streams (its 2 slots), "b" 1 (1
    free); a question about a document cached on "a" is admitted and routed
    to wait on "a". An unrelated request then queued in the router (0.3-0.9 s)
    although "b" had a free slot: the question counted against the global cap
    (2 + 2 = 4). Free slots are counted per replica, so it is admitted at once."""
    clock = Clock()
    ctl = two_replicas(clock, max_queued_requests=4)
    on_a = [await ctl.admit(job(f"a{i}")) for i in range(2)]
    for ticket in on_a:
        ticket.place("a")
    (on_b := await ctl.admit(job("b0"))).place("b")
    question = await asyncio.wait_for(ctl.admit(job("question", prompt=1500)), 0.5)
    assert ctl.would_queue(job("short"))  # granted, not placed: it may take b's slot
    question.place("a")  # the routing's choice: wait for "a", which holds its prefix
    assert not ctl.would_queue(job("short"))
    short = ctl.claim(job("short"))
    assert short.granted
    (await short.wait()).place("b")
    # Now every slot is taken: the next request queues, and a slot of "a"
    # freeing goes to the question waiting there, not to it.
    later = await queued(ctl, job("later"))
    on_a[0].release()
    await asyncio.sleep(0)
    assert not later.done()
    on_b.release()
    assert (await asyncio.wait_for(later, 0.5)).job.request_id == "later"


async def test_the_hint_skips_a_slot_end_that_goes_to_a_request_waiting_on_that_replica(
        ) -> None:
    """A slot freeing on a replica where a request waits (placed beyond its
    slots) goes to that request: the hint is the next slot to free elsewhere."""
    clock = Clock()
    ctl = two_replicas(clock, slots=1, max_queued_requests=1)
    first_a = await ctl.admit(job("a0"))
    first_a.place("a")
    (await ctl.admit(job("waits_on_a"))).place("a")
    first_b = await asyncio.wait_for(ctl.admit(job("b0")), 0.5)
    first_b.place("b")
    for ticket, tokens in ((first_a, 90), (first_b, 50)):  # 10 and 50 tokens left
        for step in range(tokens):
            ticket.on_tokens(1, clock.now + step * 0.01)
    hint = await refused_hint(ctl)
    assert hint == pytest.approx(50 * 0.01)  # b0's end, not a0's


async def test_kv_reserved_beyond_one_replicas_limit_takes_no_kv_of_another() -> None:
    """The KV limit is counted per replica as the slots are: a request placed
    to wait on a replica whose KV limit its reservations already pass does not
    eat into the other replica's (the old global sum refused 900 more tokens
    with 1000 free on "b")."""
    clock = Clock()
    ctl = two_replicas(clock, slots=8, kv=1000)
    (await ctl.admit(job("big", prompt=900, max_tokens=100))).place("a")
    (await ctl.admit(job("waits", prompt=400, max_tokens=100))).place("a")  # a: 1500 of 1000
    assert not ctl.would_queue(job("fits_b", prompt=800, max_tokens=100))
    assert ctl.would_queue(job("too_big", prompt=950, max_tokens=100))


@pytest.mark.parametrize("with_record", [False, True])
async def test_the_hint_follows_each_streams_own_progress_not_the_finished_ones_lengths(
        with_record: bool) -> None:
    """QA: 10 short requests ended at EOS after 5 of their 256 tokens, then 4
    streams of 800 tokens (ignore_eos) filled the slots: the hint was 10 ms
    (every stream looked one token from its end: 800 x the 2 % share the short
    ones used) and the first queued request started 3.96 s later. A running
    stream is expected to run as long as the finished ones that ran longer
    than it has, or to its max_tokens when none did. ``with_record``: placed
    with its stream's own record (:class:`OpenRequest`), else counted by the
    ticket's tokens alone."""
    clock = Clock()
    ctl = two_replicas(clock, max_queued_requests=1)
    for i in range(10):
        short = await ctl.admit(job(f"short{i}", max_tokens=256))
        short.place("a" if i % 2 else "b")
        for step in range(5):
            short.on_tokens(1, clock.now + step * 0.01)
        short.release()
    streams = [await ctl.admit(job(f"long{i}", max_tokens=800)) for i in range(4)]
    for i, ticket in enumerate(streams):
        opened = OpenRequest(INTERACTIVE, 800, [0])
        if with_record:
            ticket.place("ab"[i % 2], opened)
        else:
            ticket.place("ab"[i % 2])
        for step in range(100 + 50 * i):  # at 10 ms a token
            ticket.on_tokens(1, clock.now + step * 0.01)
            opened.advance(0, 1)
    clock.now += 1.0
    hint = await refused_hint(ctl)
    # The most advanced stream (250 of 800) ends first: 550 tokens at 10 ms.
    assert hint == pytest.approx(550 * 0.01, rel=0.02)


async def test_the_hint_keeps_finished_lengths_a_stream_has_not_reached_and_has_a_floor() -> None:
    """A stream short of the lengths finished requests reached is expected to
    end as they did (their mean share of max_tokens); a hint is never under
    100 ms, however close to its end the prediction puts a stream."""
    clock = Clock()
    ctl = controller(slots=1, clock=clock, max_queued_requests=1)
    for length in (40, 60):  # of 100: the mean share of the longer ones is 0.5
        done = await ctl.admit(job(f"done{length}"))
        for step in range(length):
            done.on_tokens(1, clock.now + step * 0.01)
        done.release()
    running, start = await ctl.admit(job("running")), clock.now
    for step in range(11):
        running.on_tokens(1, start + step * 0.01)
    clock.now = start + 0.1
    hint = await refused_hint(ctl)
    assert hint == pytest.approx((50 - 11) * 0.01, rel=0.02)
    for step in range(11, 59):  # 59 of 100: past 40, short of 60: 1 token (10 ms) left
        running.on_tokens(1, start + step * 0.01)
    clock.now = start + 0.58
    assert await refused_hint(ctl, fill=False) == pytest.approx(0.1)


async def test_the_hint_of_a_request_with_several_choices_waits_for_its_longest() -> None:
    """n = 2: the measured rate counts both choices' tokens (2 a step); once
    one choice ended, the request ends after the other's tokens left at one
    step each, i.e. twice its tokens left at the measured rate."""
    clock = Clock()
    ctl = controller(slots=1, clock=clock, max_queued_requests=1)
    ticket = await ctl.admit(job("two", max_tokens=100))
    opened = OpenRequest(INTERACTIVE, 100, [0, 0])
    ticket.place(0, opened)
    for step in range(21):  # a step of 20 ms yields a token of each choice
        ticket.on_tokens(2, clock.now + step * 0.02)
        opened.advance(0, 1)
        opened.advance(1, 1, finished=step == 20)
    clock.now += 0.4
    hint = await refused_hint(ctl)
    # Choice 0: 79 of 100 left, at 20 ms a step (10 ms a token of the two).
    assert hint == pytest.approx(79 * 0.02, rel=0.02)


async def test_disabled_admission_never_queues_or_refuses() -> None:
    ctl = controller(slots=1, enabled=False, max_queued_requests=0)
    tickets = [await ctl.admit(job(f"r{i}")) for i in range(5)]
    assert ctl.num_running == 5
    for t in tickets:
        t.release()
        t.release()  # idempotent
    assert ctl.num_running == 0


async def test_refuse_if_full_says_no_before_tokenization_only_when_admit_would() -> None:
    ctl = controller(slots=1, max_queued_requests=2)
    ctl.refuse_if_full(INTERACTIVE)  # nothing queued: no refusal, whatever the limit
    running = await ctl.admit(job("r"))
    tasks = [await queued(ctl, job(f"q{i}")) for i in range(2)]
    ctl.refuse_if_full(BATCH)  # another class's queue is not full
    with pytest.raises(AdmissionRefused) as refused:
        ctl.refuse_if_full(INTERACTIVE)
    assert refused.value.reason == "queue_full" and refused.value.retry_after_ms >= 1
    with pytest.raises(AdmissionRefused):
        await ctl.admit(job("late"))  # the same answer after tokenization
    running.release()
    await asyncio.wait(tasks, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
    ctl.refuse_if_full(INTERACTIVE)  # one dispatched: room again
    for task in tasks:
        task.cancel()


async def test_fail_queued_ends_every_queued_admit_and_keeps_the_running_ones() -> None:
    ctl = controller(slots=1)
    running = await ctl.admit(job("r"))
    tasks = [await queued(ctl, job("i")), await queued(ctl, job("b", BATCH))]
    assert ctl.fail_queued(NoReplicaServing("no replica")) == 2
    for task in tasks:
        with pytest.raises(NoReplicaServing):
            await task
    assert (ctl.queue_depth(INTERACTIVE), ctl.queue_depth(BATCH), ctl.num_running) == (0, 0, 1)
    running.release()
    assert ctl.num_running == 0
    assert (await ctl.admit(job("next"))) is not None  # the controller works on


async def test_a_claim_taken_before_its_size_is_known_is_settled_exactly() -> None:
    """A claim (a RAG request's place while its passages are retrieved) queues
    with 0 prompt tokens; settled while queued, the queue counts its tokens and
    refuses it for the queued-token limit (its place given up); settled once
    granted, its KV reservation moves to the real size."""
    ctl = controller(slots=1, kv=1000, max_queued_prompt_tokens=100)
    running = await ctl.admit(job("running", prompt=10, max_tokens=10))
    waiting = ctl.claim(job("rag", prompt=0, max_tokens=100))
    fits = ctl.claim(job("fits", prompt=0, max_tokens=100))
    assert ctl.queue_depth(INTERACTIVE) == 2 and ctl.queued_tokens(INTERACTIVE) == 0
    waiting.settle(60, 100)
    assert ctl.queued_tokens(INTERACTIVE) == 60
    with pytest.raises(AdmissionRefused) as refused:
        fits.settle(50, 100)
    assert refused.value.reason == "queued_tokens" and "60 prompt tokens" in str(refused.value)
    assert ctl.queue_depth(INTERACTIVE) == 1 and ctl.queued_tokens(INTERACTIVE) == 60
    running.release()
    ticket = await waiting.wait()
    assert ticket.job.prompt_tokens == 60 and ctl.reserved_kv_tokens == 160
    early = controller(slots=2, kv=1000)
    granted = early.claim(job("early", prompt=0, max_tokens=100))
    assert granted.granted and early.reserved_kv_tokens == 100
    granted.settle(300, 50)
    assert early.reserved_kv_tokens == 350
    granted.cancel()
    granted.cancel()
    assert early.num_running == 0 and early.reserved_kv_tokens == 0
