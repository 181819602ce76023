"""The torch engine core on a tiny random-weight Llama (same code, milliseconds a
step): the worker thread, in-flight batching, chunked prefill, priority, cancels,
limits, errors, shutdown, and random submit/cancel traffic that must leave the
KV cache as it found it."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import torch

from services.common.sampling import FinishReason, Priority, SamplingOptions
from services.engine.backend import DuplicateRequestError, EngineUnavailableError, QueueFullError
from services.engine.torch_backend.engine_core import EngineCore, Submitted
from services.engine.torch_backend.llama_config import LlamaConfig
from services.engine.torch_backend.kv_cache_manager import KVCacheManager
from services.engine.torch_backend.model import LlamaModel
from services.engine.torch_backend.model_runner import ModelRunner
from services.engine.torch_backend.paged_kv import kv_block_bytes
from services.engine.torch_backend.scheduler import Scheduler, SchedulerConfig
from services.engine.types import SequenceRequest, StepStats, TokenDelta

TINY = LlamaConfig(name="tiny", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=8, intermediate_size=64, vocab_size=64, rope_theta=10000.0,
                   rms_norm_eps=1e-5, context_length=512, tie_word_embeddings=True,
                   bos_token_id=None, eos_token_ids=(1,))
#: max_tokens of a request that must still be running when the test acts on it.
LONG = 400


@pytest.fixture(scope="module")
def tiny_model() -> LlamaModel:
    torch.manual_seed(0)
    model = LlamaModel(TINY)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(std=0.2)
    return model.eval().requires_grad_(False)


class Recorder:
    def __init__(self) -> None:
        self.threads: list[str] = []
        self.steps: list[StepStats] = []

    def __call__(self, stats: StepStats) -> None:
        assert stats.duration_s >= 0
        self.threads.append(threading.current_thread().name)
        self.steps.append(stats)


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def make_core(tiny_model: LlamaModel, recorder: Recorder) -> Iterator:
    cores: list[EngineCore] = []

    def make(max_model_len: int = 512, num_blocks: int = 128, block_size: int = 4,
             max_num_batched_tokens: int = 64, max_num_seqs: int = 16,
             max_num_waiting: int = 256, enable_caching: bool = True,
             step_observer: object = recorder,
             max_chunk_tokens: int | None = None,
             layer_observer: object = None,
             first_token_handoff_s: float | None = None) -> EngineCore:
        runner = ModelRunner(tiny_model, torch.device("cpu"), torch.float32)
        runner.allocate_kv_cache(num_blocks * kv_block_bytes(TINY, block_size, torch.float32),
                                 block_size)
        kv = KVCacheManager(num_blocks, block_size, enable_caching, model_id="tiny")
        scheduler = Scheduler(SchedulerConfig(
            max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_chunk_tokens=max_chunk_tokens,
            eos_token_ids=frozenset(TINY.eos_token_ids)), kv)
        handoff = {} if first_token_handoff_s is None else {
            "first_token_handoff_s": first_token_handoff_s}
        core = EngineCore(runner, scheduler, max_num_waiting=max_num_waiting,
                          step_observer=step_observer,  # type: ignore[arg-type]
                          layer_observer=layer_observer, **handoff)  # type: ignore[arg-type]
        core.start()
        cores.append(core)
        return core

    yield make
    for core in cores:
        core.stop()


def request(request_id: str, prompt: int = 4, max_tokens: int = 8,
            priority: Priority = Priority.INTERACTIVE, first: int = 2) -> SequenceRequest:
    return SequenceRequest(request_id, tuple(range(first, first + prompt)),
                           SamplingOptions(max_tokens=max_tokens, ignore_eos=True), priority)


class QueueSink:
    """A test's sink: the core's deltas, one by one, unmerged, on an asyncio
    queue (``deliver`` is called on ``loop``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[TokenDelta] = asyncio.Queue()

    def deliver(self, delta: TokenDelta) -> None:
        self.queue.put_nowait(delta)

    def fail(self, error: Exception) -> None:
        raise AssertionError(f"the engine core fails no sink: {error!r}")


async def deltas(submitted: Submitted) -> AsyncIterator[TokenDelta]:
    # asyncio.timeout, not wait_for: wait_for wraps each get in a new task, a
    # trip through the event loop per delta even when the queue holds it, so
    # under load a reader with a backlog finished after one the engine
    # finished later (test_priority_then_arrival_order read "inter-1" before
    # "first" once in a full run).
    while True:
        async with asyncio.timeout(10):
            delta = await submitted.sink.queue.get()
        yield delta
        if delta.finished:
            return


async def collect(submitted: Submitted) -> list[TokenDelta]:
    return [delta async for delta in deltas(submitted)]


def tokens(out: list[TokenDelta]) -> list[int]:
    return [token for delta in out for token in delta.token_ids]


async def test_steps_run_on_the_worker_thread(make_core, recorder: Recorder) -> None:
    core = make_core()
    out = await collect(core.submit(request("a", max_tokens=3),
                                    QueueSink(asyncio.get_running_loop())))
    assert [len(d.token_ids) for d in out] == [1, 1, 1]
    assert recorder.threads == ["engine-step"] * 3
    assert threading.current_thread().name != "engine-step"


async def test_a_first_token_is_taken_by_the_loop_before_the_next_step(make_core) -> None:
    """After a step that produced a request's first token, the worker starts
    the next step only once the event loop has run the step's deliveries and
    the task they woke (the transport's write of the first token): the next
    step's Python parts and OpenMP team no longer hold the GIL and the cores
    while the loop waits to write (the engine's gRPC edge, issue 32). Later
    tokens do not wait. On the old code the worker ran on into the next
    step's layers before the reader ran."""
    events: list[str] = []  # appended by both threads, in order (list.append is atomic)
    core = make_core(layer_observer=lambda: events.append("layer"),
                     step_observer=lambda stats: events.append("step"),
                     first_token_handoff_s=5.0)  # the bound, never reached here
    aio = asyncio.get_running_loop()
    for i in range(5):
        events.clear()
        submitted = core.submit(request(f"r{i}", max_tokens=3), QueueSink(aio))
        async for delta in deltas(submitted):
            events.append(f"read {delta.num_generated_tokens}")
        first_step_end = events.index("step")
        assert events[first_step_end + 1] == "read 1", events  # before any layer of step 2
        assert events.count("read 1") == 1 and events[-1] == "read 3"
    assert core.check_integrity().used == 0


async def test_prefill_is_chunked_under_the_step_budget(make_core, recorder: Recorder) -> None:
    core = make_core(max_num_batched_tokens=8)
    out = await collect(core.submit(request("a", prompt=20, max_tokens=2),
                                    QueueSink(asyncio.get_running_loop())))
    assert sum(len(d.token_ids) for d in out) == 2
    # prefill 8 + 8 + 4 (samples token 1), then decode token 2
    assert [s.num_scheduled_tokens for s in recorder.steps] == [8, 8, 4, 1]


@pytest.mark.parametrize("block_size", [4, 24])  # 24 does not divide the 32-key chunks
async def test_sequences_share_steps_and_match_their_solo_runs(make_core, recorder: Recorder,
                                                               block_size: int) -> None:
    core = make_core(max_num_batched_tokens=16, block_size=block_size)
    aio = asyncio.get_running_loop()
    solo = [tokens(await collect(core.submit(request(f"solo-{i}", prompt=3 + 5 * i, first=i),
                                             QueueSink(aio)))) for i in range(3)]
    recorder.steps.clear()
    together = await asyncio.gather(*(collect(core.submit(
        request(f"both-{i}", prompt=3 + 5 * i, first=i), QueueSink(aio))) for i in range(3)))
    assert [tokens(out) for out in together] == solo
    assert max(s.batch_size for s in recorder.steps) == 3
    assert len(recorder.steps) < 3 * 8  # far fewer steps than one sequence at a time
    assert core.check_integrity().used == 0


async def test_full_context_finishes_with_length(make_core) -> None:
    core = make_core(max_model_len=12)
    out = await collect(core.submit(request("a", prompt=4, max_tokens=100),
                                    QueueSink(asyncio.get_running_loop())))
    assert out[-1].finish_reason is FinishReason.LENGTH
    assert out[-1].num_generated_tokens == 8 == sum(len(d.token_ids) for d in out)


async def test_priority_then_arrival_order(make_core) -> None:
    core = make_core(max_num_seqs=1)
    aio = asyncio.get_running_loop()
    first = core.submit(request("first", max_tokens=LONG), QueueSink(aio))
    await first.sink.queue.get()  # "first" is running; the rest queue behind it
    queues = {
        "batch-1": core.submit(request("batch-1", max_tokens=2, priority=Priority.BATCH),
                               QueueSink(aio)),
        "batch-2": core.submit(request("batch-2", max_tokens=2, priority=Priority.BATCH),
                               QueueSink(aio)),
        "inter-1": core.submit(request("inter-1", max_tokens=2), QueueSink(aio)),
        "inter-2": core.submit(request("inter-2", max_tokens=2), QueueSink(aio)),
    }
    assert core.load().num_waiting == 4
    finished: list[str] = []

    async def watch(name: str, submitted: Submitted) -> None:
        await collect(submitted)
        finished.append(name)

    await asyncio.gather(watch("first", first), *(watch(n, q) for n, q in queues.items()))
    assert finished == ["first", "inter-1", "inter-2", "batch-1", "batch-2"]


async def test_cancel_waiting_leaves_the_queue_at_once(make_core) -> None:
    core = make_core(max_num_seqs=1)
    aio = asyncio.get_running_loop()
    running = core.submit(request("running", max_tokens=LONG), QueueSink(aio))
    await running.sink.queue.get()
    waiting = core.submit(request("waiting"), QueueSink(aio))
    assert core.load().num_waiting == 1
    assert core.cancel("waiting") is True
    assert core.load().num_waiting == 0
    out = await collect(waiting)
    assert [(d.token_ids, d.finish_reason) for d in out] == [((), FinishReason.CANCELLED)]
    assert core.cancel("waiting") is False
    assert core.load().kv_cache_usage > 0
    assert core.cancel("running") is True
    last = (await collect(running))[-1]
    assert last.finish_reason is FinishReason.CANCELLED
    assert core.load().num_running == 0
    assert core.load().kv_cache_usage == 0.0
    assert core.check_integrity().used == 0


class PauseAfter:
    """Step observer that holds the engine thread after step ``step`` until released,
    so a test can act on a sequence in a known state."""

    def __init__(self, step: int) -> None:
        self.step, self.count = step, 0
        self.paused, self.release = threading.Event(), threading.Event()

    def __call__(self, stats: StepStats) -> None:
        self.count += 1
        if self.count == self.step:
            self.paused.set()
            self.release.wait(timeout=10)


@pytest.mark.parametrize("state", ["waiting", "mid-prefill", "decoding"])
async def test_cancel_at_any_point_returns_every_block(make_core, state: str) -> None:
    # 40-token prompt, 8 tokens a step: prefill takes 5 steps; "other" holds the
    # only running slot while the victim waits.
    pause = PauseAfter(step={"waiting": 1, "mid-prefill": 2, "decoding": 6}[state])
    core = make_core(max_num_batched_tokens=8, max_num_seqs=1, step_observer=pause)
    aio = asyncio.get_running_loop()
    if state == "waiting":
        other = core.submit(request("other", prompt=2, max_tokens=LONG), QueueSink(aio))
    victim = core.submit(request("victim", prompt=40, max_tokens=LONG), QueueSink(aio))
    assert await asyncio.to_thread(pause.paused.wait, 10)
    load = core.load()
    assert (load.num_running, load.num_waiting) == ((1, 1) if state == "waiting" else (1, 0))
    used = {"waiting": 1, "mid-prefill": 4, "decoding": 11}[state]  # blocks of 4 tokens
    assert core.check_integrity().used == used
    assert core.cancel("victim") is True
    pause.release.set()
    out = await collect(victim)
    assert out[-1].finish_reason is FinishReason.CANCELLED
    assert len(tokens(out)) == (2 if state == "decoding" else 0)  # sampled in steps 5 and 6
    if state == "waiting":
        core.cancel("other")
        await collect(other)
    while core.load().num_running:
        await asyncio.sleep(0.001)
    counts = core.check_integrity()
    assert counts.used == 0 and counts.free + counts.cached == 128


class ChunkHook:
    """Watches the forwards of one engine core: which of ``victim``'s prompt
    chunks each step computes (``started``), which steps completed
    (``completed``), and, once armed on a chunk index, holds the engine thread
    there (``where``: ``before_forward``, or ``inside_chunk`` = inside the
    model's first layer) until released."""

    def __init__(self, core: EngineCore, monkeypatch: pytest.MonkeyPatch, first_token: int,
                 chunk: int, where: str) -> None:
        self.first_token, self.chunk, self.where = first_token, chunk, where
        self.started: list[int | None] = []  # per forward: victim chunk index, or None
        self.completed: list[int | None] = []
        self.layer_calls = [0] * TINY.num_layers
        self.paused, self.release = threading.Event(), threading.Event()
        runner = core._runner
        real_run = runner.run
        self._armed = False

        def run(inputs, should_stop=None):
            index = self._victim_chunk(inputs)
            self.started.append(index)
            if index == self.chunk:
                self._armed = True
                if where == "before_forward":
                    self._hold()
            logits = real_run(inputs) if should_stop is None else real_run(inputs, should_stop)
            self.completed.append(index)
            return logits

        monkeypatch.setattr(runner, "run", run)
        name = "forward_fused" if runner.attention_backend == "native" else "forward"
        for number, layer in enumerate(runner.model.layers):
            monkeypatch.setattr(layer, name, self._counting(number, getattr(layer, name)))

    def _victim_chunk(self, inputs) -> int | None:
        for item in inputs:
            if len(item.token_ids) > 1 and item.token_ids[0] == self.first_token + item.start:
                return item.start // len(item.token_ids)
        return None

    def _counting(self, number: int, forward):
        def counted(*args, **kwargs):
            if number == 0 and self._armed and self.where == "inside_chunk":
                self._hold()
            self.layer_calls[number] += 1
            return forward(*args, **kwargs)
        return counted

    def _hold(self) -> None:
        self._armed = False
        self.paused.set()
        self.release.wait(timeout=10)

    def victim_chunks_completed(self) -> int:
        return sum(index is not None for index in self.completed)


@pytest.mark.parametrize("where", ["between_chunks", "before_forward", "inside_chunk"])
async def test_cancel_during_a_long_prefill_computes_no_further_chunk(
        make_core, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    # Issue 12, bug 9: a 40-token prompt in chunks of 8 (5 steps); cancelled after
    # its first chunk, between steps, just before the second chunk's forward, or
    # inside it. No chunk after the cancel completes; a chunk in progress that
    # has the step to itself is abandoned at the next layer; every block returns.
    pause = PauseAfter(step=1) if where == "between_chunks" else None
    core = make_core(max_num_batched_tokens=8, step_observer=pause)
    hook = ChunkHook(core, monkeypatch, first_token=20, chunk=1, where=where)
    held = pause if pause is not None else hook
    aio = asyncio.get_running_loop()
    victim = core.submit(request("victim", prompt=40, max_tokens=4, first=20), QueueSink(aio))
    assert await asyncio.to_thread(held.paused.wait, 10)
    assert hook.victim_chunks_completed() == 1  # chunk 0 done; chunk 1 next or in progress
    layer_calls = list(hook.layer_calls)
    assert core.cancel("victim") is True
    held.release.set()
    out = await collect(victim)
    assert [(d.token_ids, d.finish_reason) for d in out] == [((), FinishReason.CANCELLED)]
    assert hook.victim_chunks_completed() == 1
    if where == "before_forward":  # no layer of chunk 1 ran
        assert hook.layer_calls == layer_calls
    if where == "inside_chunk":  # chunk 1 stopped after its first layer
        assert hook.layer_calls == [layer_calls[0] + 1, *layer_calls[1:]]
    assert core.load().num_running == 0
    counts = core.check_integrity()
    # Only chunk 0's two full blocks stay, in the prefix cache; the half-computed
    # chunk's blocks are free, never cached.
    assert (counts.used, counts.cached, counts.free) == (0, 2, 126)
    # The engine serves on, and the prompt's cached prefix is sound: the same
    # prompt gives the tokens of a fresh engine.
    again = tokens(await collect(core.submit(request("again", prompt=40, max_tokens=4,
                                                     first=20), QueueSink(aio))))
    fresh = make_core(max_num_batched_tokens=8, step_observer=None)
    assert again == tokens(await collect(fresh.submit(request("fresh", prompt=40, max_tokens=4,
                                                              first=20), QueueSink(aio))))
    assert core.check_integrity().used == 0


async def test_cancel_in_a_step_shared_with_live_sequences_waits_that_step(
        make_core, monkeypatch: pytest.MonkeyPatch) -> None:
    # The victim's chunk shares its step with "other"'s decode: the step completes
    # for "other", the victim leaves at its end (at most one chunk more than at the
    # cancel), and "other" decodes on to its limit.
    core = make_core(max_num_batched_tokens=9, max_chunk_tokens=8, step_observer=None)
    hook = ChunkHook(core, monkeypatch, first_token=20, chunk=1, where="inside_chunk")
    aio = asyncio.get_running_loop()
    other = core.submit(request("other", prompt=2, max_tokens=30), QueueSink(aio))
    await other.sink.queue.get()  # decoding
    victim = core.submit(request("victim", prompt=40, max_tokens=4, first=20), QueueSink(aio))
    assert await asyncio.to_thread(hook.paused.wait, 10)
    at_cancel = hook.victim_chunks_completed()
    assert core.cancel("victim") is True
    hook.release.set()
    out = await collect(victim)
    assert out[-1].finish_reason is FinishReason.CANCELLED
    assert hook.victim_chunks_completed() == at_cancel + 1  # the shared step, no more
    last = (await collect(other))[-1]
    assert (last.finish_reason, last.num_generated_tokens) == (FinishReason.LENGTH, 30)
    counts = core.check_integrity()
    assert counts.used == 0 and counts.free + counts.cached == 128


async def test_queue_limit_and_duplicate_ids(make_core) -> None:
    core = make_core(max_num_waiting=1, max_num_seqs=1)
    aio = asyncio.get_running_loop()
    running = core.submit(request("a", max_tokens=LONG), QueueSink(aio))
    await running.sink.queue.get()
    assert core.load().num_running == 1
    assert 0 < core.load().kv_cache_usage <= 1
    core.submit(request("b"), QueueSink(aio))
    with pytest.raises(QueueFullError, match="limit 1"):
        core.submit(request("c"), QueueSink(aio))
    with pytest.raises(DuplicateRequestError, match="'a'"):
        core.submit(request("a"), QueueSink(aio))
    core.cancel("a")
    core.cancel("b")


async def test_a_burst_into_an_idle_engine_fills_the_free_slots_and_the_queue(make_core) -> None:
    # Requests about to take free slots are not waiting: slots + queue are
    # admitted at once, the next one is refused (issue 14).
    core = make_core(max_num_waiting=2, max_num_seqs=4)
    aio = asyncio.get_running_loop()
    streams = [core.submit(request(f"burst-{i}", max_tokens=3), QueueSink(aio)) for i in range(6)]
    with pytest.raises(QueueFullError, match="limit 2 beyond the free slots"):
        core.submit(request("burst-6"), QueueSink(aio))
    ends = [(await collect(stream))[-1] for stream in streams]
    assert [(d.finish_reason, d.num_generated_tokens) for d in ends] == [
        (FinishReason.LENGTH, 3)] * 6
    assert core.check_integrity().used == 0


async def test_failed_step_fails_its_requests_and_the_engine_lives(make_core) -> None:
    core = make_core()
    aio = asyncio.get_running_loop()
    bad = SequenceRequest("bad", (TINY.vocab_size + 5,), SamplingOptions(max_tokens=2))
    out = await collect(core.submit(bad, QueueSink(aio)))
    assert out[-1].finish_reason is FinishReason.ERROR
    assert "IndexError" in out[-1].error
    good = await collect(core.submit(request("good", max_tokens=2), QueueSink(aio)))
    assert good[-1].finish_reason is FinishReason.LENGTH
    assert core.check_integrity().used == 0


async def test_stop_fails_leftovers_and_refuses_new_work(make_core) -> None:
    core = make_core(max_num_seqs=1)
    aio = asyncio.get_running_loop()
    running = core.submit(request("running", max_tokens=LONG), QueueSink(aio))
    await running.sink.queue.get()
    waiting = core.submit(request("waiting"), QueueSink(aio))
    await asyncio.to_thread(core.stop)
    for queue in (running, waiting):
        last = (await collect(queue))[-1]
        assert (last.finish_reason, last.error) == (FinishReason.ERROR, "the engine shut down")
    with pytest.raises(EngineUnavailableError):
        core.submit(request("late"), QueueSink(aio))
    assert core.load().num_running == core.load().num_waiting == 0


async def test_random_traffic_with_the_model_leaves_no_block_behind(make_core,
                                                                    recorder: Recorder) -> None:
    # 24 blocks of 4 tokens for up to 6 sequences of up to 40 tokens: preemptions happen.
    core = make_core(num_blocks=24, max_num_seqs=6, max_num_batched_tokens=24)
    aio = asyncio.get_running_loop()
    rng = random.Random(7)
    streams: dict[str, asyncio.Task[list[TokenDelta]]] = {}
    for event in range(300):
        if rng.random() < 0.6:
            name = f"r{event}"
            streams[name] = asyncio.create_task(collect(core.submit(request(
                name, prompt=rng.randint(1, 24), max_tokens=rng.randint(1, 16),
                priority=rng.choice(list(Priority)), first=rng.randint(2, 10)), QueueSink(aio))))
        elif streams:
            core.cancel(rng.choice(sorted(streams)))
        await asyncio.sleep(rng.choice([0, 0, 0.001, 0.005]))
    results = await asyncio.wait_for(asyncio.gather(*streams.values()), timeout=120)
    reasons = {out[-1].finish_reason for out in results}
    assert reasons <= {FinishReason.LENGTH, FinishReason.CANCELLED}
    assert FinishReason.CANCELLED in reasons and FinishReason.LENGTH in reasons
    assert all(sum(d.finished for d in out) == 1 for out in results)
    assert core.load().num_running == core.load().num_waiting == 0
    counts = core.check_integrity()
    assert counts.used == 0 and counts.free + counts.cached == 24
    assert sum(s.num_preemptions for s in recorder.steps) > 0


async def test_a_scheduler_bug_fails_the_requests_not_the_engine(make_core,
                                                                 monkeypatch) -> None:
    core = make_core()
    aio = asyncio.get_running_loop()
    scheduler = core._scheduler
    real = scheduler.schedule
    calls = {"n": 0}

    def broken():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("scheduler bug")
        return real()

    monkeypatch.setattr(scheduler, "schedule", broken)
    out = await collect(core.submit(request("victim", max_tokens=LONG), QueueSink(aio)))
    assert (out[-1].finish_reason, out[-1].error) == (FinishReason.ERROR,
                                                      "RuntimeError: scheduler bug")
    good = await collect(core.submit(request("after", max_tokens=2), QueueSink(aio)))
    assert good[-1].finish_reason is FinishReason.LENGTH
    assert core.check_integrity().used == 0


# ---- the command inbox: one owner, callers never wait for a step ---------------------


class HoldSchedule:
    """Holds the engine thread inside ``Scheduler.schedule`` (under its state
    lock) from the ``after``-th call on, until released."""

    def __init__(self, core: EngineCore, monkeypatch: pytest.MonkeyPatch, after: int) -> None:
        self.after, self.calls = after, 0
        self.paused, self.release = threading.Event(), threading.Event()
        real = core._scheduler.schedule

        def schedule():
            self.calls += 1
            if self.calls == self.after:
                self.paused.set()
                self.release.wait(timeout=10)
            return real()

        monkeypatch.setattr(core._scheduler, "schedule", schedule)


async def test_submit_and_cancel_never_wait_for_the_engine_thread(
        make_core, monkeypatch: pytest.MonkeyPatch) -> None:
    # The engine thread is held inside schedule() (holding its state lock): a
    # submit is accepted and a cancel of that pending submit ends it, both at
    # once, from the event loop, before the thread moves again.
    core = make_core()
    aio = asyncio.get_running_loop()
    hold = HoldSchedule(core, monkeypatch, after=2)
    running = core.submit(request("running", max_tokens=LONG), QueueSink(aio))
    assert await asyncio.to_thread(hold.paused.wait, 10)
    began = time.monotonic()
    pending = core.submit(request("pending"), QueueSink(aio))
    assert core.load().num_waiting == 1
    assert core.cancel("pending") is True
    assert time.monotonic() - began < 1.0  # the hold lasts up to 10 s
    out = await collect(pending)  # while the engine thread is still held
    assert [(d.token_ids, d.finish_reason) for d in out] == [((), FinishReason.CANCELLED)]
    assert hold.paused.is_set() and not hold.release.is_set()
    assert core.load().num_waiting == 0
    hold.release.set()
    core.cancel("running")
    assert (await collect(running))[-1].finish_reason is FinishReason.CANCELLED
    assert core.check_integrity().used == 0


@pytest.mark.parametrize("state", ["pending", "waiting", "running"])
async def test_a_cancelled_id_may_be_submitted_again_at_once(make_core, state: str) -> None:
    # Issue 13 QA (Q2): the id leaves the request table with the cancel, before
    # the engine thread frees the old sequence; the new request runs as if alone.
    core = make_core(max_num_seqs=1)
    aio = asyncio.get_running_loop()
    solo = tokens(await collect(core.submit(request("solo", max_tokens=6, first=5),
                                            QueueSink(aio))))
    blocker = None
    if state != "running":
        blocker = core.submit(request("blocker", max_tokens=LONG), QueueSink(aio))
        await blocker.sink.queue.get()
    old = core.submit(request("same", max_tokens=LONG, first=5), QueueSink(aio))
    if state == "running":
        await old.sink.queue.get()
    elif state == "waiting":
        while core._inbox.has_commands():  # taken in by the engine thread
            await asyncio.sleep(0.001)
    assert core.cancel("same") is True
    new = core.submit(request("same", max_tokens=6, first=5), QueueSink(aio))
    if blocker is not None:
        core.cancel("blocker")
        await collect(blocker)
    assert (await collect(old))[-1].finish_reason is FinishReason.CANCELLED
    out = await collect(new)
    assert (out[-1].finish_reason, tokens(out)) == (FinishReason.LENGTH, solo)
    assert core.cancel("same") is False
    assert core.check_integrity().used == 0


def test_racing_submits_of_one_id_admit_exactly_one(make_core) -> None:
    # Issue 13 QA (b): two event loops submitting one id at once both passed a
    # lock-free duplicate check. The inbox's table decides under its lock.
    core = make_core(max_num_seqs=4)
    for round_ in range(50):
        barrier = threading.Barrier(4)
        outcomes: list[object] = []

        def submit(name: str = f"dup-{round_}") -> None:
            aio = asyncio.new_event_loop()
            barrier.wait()
            try:
                outcomes.append(core.submit(request(name, max_tokens=LONG), QueueSink(aio)))
            except DuplicateRequestError as exc:
                outcomes.append(exc)
            finally:
                aio.close()  # its deltas are dropped

        threads = [threading.Thread(target=submit) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sum(not isinstance(o, DuplicateRequestError) for o in outcomes) == 1
        assert core.cancel(f"dup-{round_}") is True
    deadline = time.monotonic() + 10
    while (core.load().num_running or core._inbox.has_commands()) and (
            time.monotonic() < deadline):
        time.sleep(0.001)
    assert len(core._inbox) == 0 and core.check_integrity().used == 0


def test_the_queue_limit_is_exact_under_racing_submits(make_core) -> None:
    # Issue 13 QA (c): 8 threads submit at once into an engine whose thread is
    # held; exactly max_num_seqs + max_num_waiting are admitted, every time.
    core = make_core(max_num_seqs=2, max_num_waiting=3)
    for round_ in range(30):
        barrier = threading.Barrier(8)
        admitted: list[Submitted] = []
        refused: list[QueueFullError] = []
        aio = asyncio.new_event_loop()

        def submit(index: int) -> None:
            barrier.wait()
            try:
                admitted.append(core.submit(request(f"q{round_}-{index}", max_tokens=LONG),
                                            QueueSink(aio)))
            except QueueFullError as exc:
                refused.append(exc)

        threads = [threading.Thread(target=submit, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert (len(admitted), len(refused)) == (5, 3)
        for submitted in admitted:
            core.cancel(submitted.seq.request_id)
        aio.close()
        deadline = time.monotonic() + 10
        while core.load().num_running and time.monotonic() < deadline:
            time.sleep(0.001)
    assert core.check_integrity().used == 0


async def test_a_submit_that_fails_to_join_fails_alone(make_core,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # Each command applies on its own: a submit the scheduler refuses (a bug)
    # ends with ERROR; the others of the same intake run.
    core = make_core()
    aio = asyncio.get_running_loop()
    real = core._scheduler.add

    def add(seq):
        if seq.request_id == "bad":
            raise RuntimeError("add bug")
        real(seq)

    monkeypatch.setattr(core._scheduler, "add", add)
    streams = [core.submit(request(name, max_tokens=2), QueueSink(aio))
               for name in ("a", "bad", "b")]
    ends = [(await collect(s))[-1] for s in streams]
    assert [(d.finish_reason, d.error) for d in ends] == [
        (FinishReason.LENGTH, ""), (FinishReason.ERROR, "RuntimeError: add bug"),
        (FinishReason.LENGTH, "")]
    assert core.cancel("bad") is False  # its id left the table
    assert core.check_integrity().used == 0
