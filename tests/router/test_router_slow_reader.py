"""The slow-reader budget (services/router/slow_reader.py) on fake event streams."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from services.common.sampling import FinishReason
from services.common.wire.engine_stream import Usage
from services.router.generation import Delta, Finished, merge_deltas
from services.router.slow_reader import WriteStalled, paced


def test_deltas_that_wait_for_a_blocked_write_are_merged_into_one() -> None:
    async def scenario() -> list[object]:
        async def events():
            for i in range(5):
                yield Delta(f"t{i} ", (i,))
            yield Finished(FinishReason.LENGTH, "", Usage(3, 5, 0))

        got = []
        async with contextlib.aclosing(paced(events(), write_timeout_s=5, merge=merge_deltas,
                                             read_ahead_after_s=0.005)) as stream:
            async for event in stream:
                got.append(event)
                await asyncio.sleep(0.01)  # a slow write: the producer runs ahead
        return got

    got = asyncio.run(scenario())
    deltas = [e for e in got if isinstance(e, Delta)]
    assert len(deltas) <= 2  # the first write may go before the rest arrived
    assert "".join(d.text for d in deltas) == "t0 t1 t2 t3 t4 "
    assert sum((d.token_ids for d in deltas), ()) == (0, 1, 2, 3, 4)
    assert isinstance(got[-1], Finished)


def test_a_write_blocked_past_the_budget_cancels_the_generation() -> None:
    closed = asyncio.Event()
    stalls: list[int] = []

    async def scenario() -> tuple[list[object], BaseException | None]:
        async def events():
            try:
                for i in range(1000):
                    yield Delta("x", (i,))
                    await asyncio.sleep(0.005)
            finally:
                closed.set()  # where the engine stream closes

        got: list[object] = []
        error = None
        try:
            async with contextlib.aclosing(paced(events(), write_timeout_s=0.1,
                                                 merge=merge_deltas,
                                                 on_stall=lambda: stalls.append(1))) as stream:
                async for event in stream:
                    got.append(event)
                    if len(got) == 2:
                        await asyncio.wait_for(closed.wait(), 1.0)  # cancelled while blocked
                        await asyncio.sleep(0.05)
        except WriteStalled as err:
            error = err
        return got, error

    got, error = asyncio.run(scenario())
    assert isinstance(error, WriteStalled) and error.budget_s == 0.1
    assert len(got) == 2 and stalls == [1]


def test_a_slow_final_write_of_a_finished_generation_is_not_cancelled() -> None:
    async def scenario() -> list[object]:
        async def events():
            yield Delta("a", (1,))
            yield Finished(FinishReason.STOP, "", Usage(1, 1, 0))

        got = []
        async with contextlib.aclosing(paced(events(), write_timeout_s=0.05,
                                             merge=merge_deltas)) as stream:
            async for event in stream:
                got.append(event)
                await asyncio.sleep(0.15)
        return got

    assert len(asyncio.run(scenario())) == 2


def test_an_error_comes_after_the_events_before_it() -> None:
    async def scenario() -> list[object]:
        async def events():
            yield Delta("a", (1,))
            raise RuntimeError("upstream")

        got = []
        with pytest.raises(RuntimeError, match="upstream"):
            async for event in paced(events(), write_timeout_s=1, merge=merge_deltas):
                got.append(event)
        return got

    assert asyncio.run(scenario()) == [Delta("a", (1,))]


def test_choices_and_finals_are_never_merged() -> None:
    usage = Usage(1, 1, 0)
    assert merge_deltas(Delta("a", (1,), index=0), Delta("b", (2,), index=1)) is None
    assert merge_deltas(Delta("a", (1,)), Finished(FinishReason.STOP, "", usage)) is None


def test_a_client_whose_writes_return_at_once_costs_no_read_ahead_task() -> None:
    """The events of a client that reads run in the consumer's own task (one
    wake-up per event, not two); a blocked write moves them to a task of their
    own, from then on."""
    async def scenario() -> tuple[asyncio.Task[object] | None, list[object]]:
        tasks: list[object] = []

        async def events():
            for i in range(6):
                tasks.append(asyncio.current_task())
                yield Delta(f"t{i}", (i,))
            tasks.append(asyncio.current_task())

        async with contextlib.aclosing(paced(events(), write_timeout_s=5,
                                             merge=merge_deltas)) as stream:
            async for event in stream:
                if event.token_ids == (3,):
                    await asyncio.sleep(0.2)  # one blocked write
        return asyncio.current_task(), tasks

    consumer, tasks = asyncio.run(scenario())
    assert tasks[:4] == [consumer] * 4
    assert consumer not in tasks[4:]
