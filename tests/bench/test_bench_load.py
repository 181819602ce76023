"""services.bench.load: arrivals, concurrency cap, bounds, warm-up (a fake backend)."""

from __future__ import annotations

import asyncio
import math
import time

import numpy as np
import pytest

from services.bench.datasets import BenchRequest, ChatScript
from services.bench.load import LoadSettings, arrival_offsets, run_chats, run_load, run_warmup
from services.bench.records import RequestOutput
from services.bench.tokenizer import Message


class SleepBackend:
    """Answers every request after ``service_s``; tracks what ran when."""

    model_id = "fake"

    def __init__(self, service_s: float = 0.02) -> None:
        self.service_s = service_s
        self.in_flight = 0
        self.peak = 0
        self.sent: list[tuple[str, float]] = []

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def send(self, request: BenchRequest) -> RequestOutput:
        out = RequestOutput(prompt_len=request.prompt_len, start_time=time.perf_counter())
        self.sent.append((request.tag, out.start_time))
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            await asyncio.sleep(self.service_s)
        finally:
            self.in_flight -= 1
        out.success, out.output_tokens = True, request.output_len
        out.ttft = out.latency = time.perf_counter() - out.start_time
        return out


def requests(count: int, tag: str = "r") -> list[BenchRequest]:
    return [BenchRequest(f"p{i}", None, 3, 2, f"{tag}/{i}") for i in range(count)]


def test_poisson_gaps_have_the_requested_mean_and_spread() -> None:
    rng = np.random.default_rng(0)
    offsets = arrival_offsets(20_001, 10.0, 1.0, rng)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0
    assert gaps.mean() == pytest.approx(0.1, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_burstiness_is_the_gamma_shape(burstiness: float) -> None:
    gaps = np.diff(arrival_offsets(20_001, 5.0, burstiness, np.random.default_rng(1)))
    assert gaps.mean() == pytest.approx(0.2, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.06)


def test_infinite_rate_sends_everything_at_once_and_seed_repeats() -> None:
    assert arrival_offsets(4, math.inf, 1.0, np.random.default_rng(0)) == [0.0] * 4
    assert arrival_offsets(0, 1.0, 1.0, np.random.default_rng(0)) == []
    one = arrival_offsets(50, 3.0, 1.0, np.random.default_rng(7))
    assert one == arrival_offsets(50, 3.0, 1.0, np.random.default_rng(7))


def test_settings_are_validated() -> None:
    for bad in ({"request_rate": 0}, {"burstiness": 0}, {"max_concurrency": 0},
                {"duration_s": 0}, {"num_warmups": -1}):
        with pytest.raises(ValueError):
            LoadSettings(**bad)


async def test_max_concurrency_caps_requests_in_flight() -> None:
    backend = SleepBackend(0.02)
    done: list[RequestOutput] = []
    result = await run_load(backend, requests(12), LoadSettings(max_concurrency=3),
                            np.random.default_rng(0), on_done=done.append)
    assert backend.peak == 3
    assert len(result.outputs) == len(done) == 12 and result.not_sent == 0
    assert [o.tag for o in result.outputs] == [f"r/{i}" for i in range(12)]
    # 12 requests, 3 at a time, 20 ms each: at least 4 rounds.
    assert result.duration_s >= 0.08


async def test_no_cap_with_infinite_rate_sends_all_at_once() -> None:
    backend = SleepBackend(0.05)
    await run_load(backend, requests(8), LoadSettings(), np.random.default_rng(0))
    assert backend.peak == 8


async def test_request_rate_spaces_the_sends() -> None:
    backend = SleepBackend(0.001)
    rng_a, rng_b = np.random.default_rng(3), np.random.default_rng(3)
    expected = arrival_offsets(10, 20.0, 1.0, rng_b)
    result = await run_load(backend, requests(10), LoadSettings(request_rate=20.0), rng_a)
    sent = [t - result.start_time for _, t in backend.sent]
    for got, want in zip(sent, expected, strict=True):
        assert want - 0.002 <= got <= want + 0.2  # never early; late only by loop delays
    assert result.duration_s >= expected[-1]


async def test_duration_bound_stops_sending_and_lets_in_flight_finish() -> None:
    backend = SleepBackend(0.1)
    result = await run_load(backend, requests(100),
                            LoadSettings(max_concurrency=2, duration_s=0.15),
                            np.random.default_rng(0))
    # Slots free at 0 and 0.1 s (2 each); the ones at 0.2 s are past the bound,
    # and the second pair, sent before it, still runs to its end.
    assert len(result.outputs) == 4 and result.not_sent == 96
    assert all(o.success for o in result.outputs)
    assert 0.19 <= result.duration_s < 0.45


async def test_duration_bound_with_a_rate() -> None:
    backend = SleepBackend(0.01)
    result = await run_load(backend, requests(1000), LoadSettings(request_rate=40.0,
                                                                  duration_s=0.5),
                            np.random.default_rng(0))
    assert 5 <= len(result.outputs) <= 45
    assert all(t - result.start_time < 0.5 + 0.02 for _, t in backend.sent)


async def test_warmup_runs_before_and_is_not_counted() -> None:
    backend = SleepBackend(0.01)
    settings = LoadSettings(max_concurrency=2, num_warmups=5)
    warm = await run_warmup(backend, requests(3, "w"), settings)
    assert len(warm) == 5 and backend.peak == 2
    assert [tag for tag, _ in backend.sent] == ["w/0", "w/1", "w/2", "w/0", "w/1"]
    result = await run_load(backend, requests(4), settings, np.random.default_rng(0))
    assert len(result.outputs) == 4
    assert all(o.tag.startswith("r/") for o in result.outputs)
    assert await run_warmup(backend, requests(3), LoadSettings()) == []


class EchoTokenizer:
    """Counts characters as tokens; renders chat as ``role: content`` lines."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: list[int]) -> str:
        return "".join(map(chr, token_ids))

    def render_chat(self, messages: list[Message]) -> str:
        return "".join(f"{m.role}: {m.content}\n" for m in messages)


class ChatBackend(SleepBackend):
    """Replies ``reply to <tag>``; fails the requests whose tag is in ``fail``;
    keeps every request it got."""

    def __init__(self, service_s: float = 0.01, fail: frozenset[str] = frozenset()) -> None:
        super().__init__(service_s)
        self.fail = fail
        self.requests: list[BenchRequest] = []

    async def send(self, request: BenchRequest) -> RequestOutput:
        self.requests.append(request)
        out = await super().send(request)
        out.generated_text = f"reply to {request.tag}"
        if request.tag in self.fail:
            out.success, out.error = False, "UNAVAILABLE"
        return out


def chats(count: int, turns: int) -> list[ChatScript]:
    return [ChatScript(f"c{i}", "sys", tuple(f"q{i}.{t}" for t in range(turns)), 2)
            for i in range(count)]


async def test_chats_run_closed_loop_with_the_model_replies_as_history() -> None:
    backend = ChatBackend()
    result = await run_chats(backend, chats(6, 3), EchoTokenizer(),
                             LoadSettings(max_concurrency=2))
    assert len(result.outputs) == 18 and result.not_sent == 0 and backend.peak == 2
    assert [o.start_time for o in result.outputs] == sorted(o.start_time for o in result.outputs)
    for request in backend.requests:
        chat, turn = request.tag.split("/")[1], int(request.tag.split("/")[2])
        assert request.turn == turn and request.messages is not None
        expected = [Message("system", "sys")]
        for t in range(turn):
            expected += [Message("user", f"q{chat[1:]}.{t}"),
                         Message("assistant", f"reply to conversations/{chat}/{t}")]
        assert list(request.messages) == [*expected, Message("user", f"q{chat[1:]}.{turn}")]
    # User 0 holds c0, c2, c4 and answers them turn by turn: all of turn 0, then turn 1 ...
    user0 = [r.tag for r in backend.requests if r.tag.split("/")[1] in ("c0", "c2", "c4")]
    assert user0 == [f"conversations/c{c}/{t}" for t in range(3) for c in (0, 2, 4)]
    assert sorted(o.turn for o in result.outputs) == [0] * 6 + [1] * 6 + [2] * 6
    assert all(o.tag == f"conversations/c{o.tag.split('/')[1][1:]}/{o.turn}"
               for o in result.outputs)


async def test_a_failed_turn_ends_its_conversation() -> None:
    backend = ChatBackend(fail=frozenset({"conversations/c1/1"}))
    result = await run_chats(backend, chats(2, 4), EchoTokenizer(), LoadSettings())
    assert [r.tag for r in backend.requests if "/c1/" in r.tag] == [
        "conversations/c1/0", "conversations/c1/1"]
    assert len(result.outputs) == 6 and result.not_sent == 2
    assert backend.peak == 2  # one user per conversation without a cap


async def test_chats_stop_at_the_duration_and_need_an_infinite_rate() -> None:
    backend = ChatBackend(service_s=0.05)
    result = await run_chats(backend, chats(2, 50), EchoTokenizer(), LoadSettings(duration_s=0.3))
    assert 2 <= len(result.outputs) <= 16 and result.not_sent == 100 - len(result.outputs)
    with pytest.raises(ValueError, match="inf"):
        await run_chats(backend, chats(1, 1), EchoTokenizer(), LoadSettings(request_rate=2))
