"""``sampling.n`` through the whole mesh (Envoy, router, SmolLM2 engine): n
seeded choices are reproducible, distinct and equal to single requests seeded
``seed + i``; the engine computes the prompt once (its own counter says so);
a stop string ends only its choice; a cancel frees every KV block.

Each test uses a prompt of its own (a uuid tag), so no earlier request put
its blocks in the engine's prefix cache beyond the shared chat preamble."""

from __future__ import annotations

import uuid
from collections import defaultdict
from dataclasses import dataclass, field

import grpc
import pytest

from llmesh.v1 import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
)
from services.cli.mesh import Mesh
from tests.e2e.mesh_client import BidiSession, chat_request, generate
from tests.e2e.test_mesh_coalescing import engine_counter
from tests.e2e.test_mesh_e2e import IDLE_WITHIN_S, wait_engine_idle

pytestmark = pytest.mark.mesh

LENGTH = common_pb2.FINISH_REASON_LENGTH
STOP = common_pb2.FINISH_REASON_STOP
MAX_TOKENS = 10


@dataclass
class Choices:
    """A Generate stream split by choice index."""

    text: dict[int, str] = field(default_factory=lambda: defaultdict(str))
    ids: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))
    last: dict[int, generation_pb2.GenerateResponse] = field(default_factory=dict)


def by_choice(responses: list[generation_pb2.GenerateResponse]) -> Choices:
    out = Choices()
    for response in responses:
        assert response.index not in out.last, "a message after its choice's last"
        out.text[response.index] += response.text
        out.ids[response.index].extend(response.token_ids)
        if response.finish_reason:
            out.last[response.index] = response
    return out


def send(channel: grpc.Channel, content: str, **sampling: object) -> Choices:
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    return by_choice(list(stub.Generate(chat_request(content, **sampling), timeout=120)))


@pytest.fixture(scope="module")
def engine(mesh: Mesh) -> engine_pb2_grpc.EngineServiceStub:
    return engine_pb2_grpc.EngineServiceStub(grpc.insecure_channel(mesh.engines[0].grpc_address))


#: The seeded n=4 request of the first two tests.
SAMPLING = dict(temperature=1.0, seed=42, max_tokens=MAX_TOKENS, ignore_eos=True)


@dataclass
class SeededFour:
    content: str
    choices: Choices
    prompt_tokens_computed: float


@pytest.fixture(scope="module")
def seeded_four(mesh: Mesh, ingress_channel: grpc.Channel) -> SeededFour:
    """An n=4 request on a fresh prompt, and the prompt tokens the engine
    computed for it (its counter before and after)."""
    content = f"Write one line about the sea, tag {uuid.uuid4().hex[:8]}."
    before = engine_counter(mesh, "llmesh:prompt_tokens_computed_total")
    four = send(ingress_channel, content, n=4, **SAMPLING)
    computed = engine_counter(mesh, "llmesh:prompt_tokens_computed_total") - before
    return SeededFour(content, four, computed)


def test_four_seeded_choices_equal_four_single_requests_and_share_one_prefill(
        ingress_channel: grpc.Channel, seeded_four: SeededFour) -> None:
    four = seeded_four.choices
    assert sorted(four.last) == [0, 1, 2, 3]
    usage = four.last[0].usage
    assert seeded_four.prompt_tokens_computed == usage.prompt_tokens - usage.cached_prompt_tokens
    assert seeded_four.prompt_tokens_computed > 0  # computed once, not 4 times
    for index, last in four.last.items():
        assert last.finish_reason == LENGTH
        assert last.usage.completion_tokens == len(four.ids[index]) == MAX_TOKENS
    assert len({tuple(ids) for ids in four.ids.values()}) >= 2

    again = send(ingress_channel, seeded_four.content, n=4, **SAMPLING)
    assert again.ids == four.ids and again.text == four.text
    for index in range(4):
        single = generate(ingress_channel, chat_request(
            seeded_four.content, **{**SAMPLING, "seed": 42 + index}))
        assert single.token_ids == four.ids[index], index
        assert single.text == four.text[index]


def test_a_stop_string_ends_only_its_choice(ingress_channel: grpc.Channel,
                                            seeded_four: SeededFour) -> None:
    free = seeded_four.choices
    # a stop string from the middle of one choice that no other choice contains
    stop, stopped = next(
        (text[i:i + 4], index) for index, text in free.text.items()
        for i in range(2, len(text) - 4)
        if text[i:i + 4].strip() and all(text[i:i + 4] not in other
                                          for j, other in free.text.items() if j != index))
    cut = send(ingress_channel, seeded_four.content, n=4, stop=[stop], **SAMPLING)
    assert cut.last[stopped].finish_reason == STOP
    assert cut.last[stopped].matched_stop == stop
    assert cut.text[stopped] == free.text[stopped][:free.text[stopped].index(stop)]
    assert cut.last[stopped].usage.completion_tokens == len(cut.ids[stopped]) < MAX_TOKENS
    for index in set(free.text) - {stopped}:
        assert cut.text[index] == free.text[index]
        assert cut.last[index].finish_reason == LENGTH


def test_cancelling_four_choices_mid_way_frees_every_block(
        ingress_channel: grpc.Channel, engine: engine_pb2_grpc.EngineServiceStub) -> None:
    session = BidiSession(ingress_channel)
    session.start(chat_request(f"Tell a long story, tag {uuid.uuid4().hex[:8]}.", n=4,
                               temperature=1.0, max_tokens=1000, ignore_eos=True))
    seen: set[int] = set()
    while len(seen) < 4:  # every choice is decoding
        response = session.next()
        assert not response.finish_reason
        seen.add(response.index)
    assert engine.GetLoad(engine_pb2.GetLoadRequest(), timeout=5).kv_cache_usage > 0
    session.cancel()
    ended: set[int] = set()
    while len(ended) < 4:
        response = session.next()
        if response.finish_reason:
            assert response.finish_reason == common_pb2.FINISH_REASON_CANCELLED
            ended.add(response.index)
    session.close()
    assert wait_engine_idle(engine, within_s=IDLE_WITHIN_S) < IDLE_WITHIN_S
    assert engine.GetLoad(engine_pb2.GetLoadRequest(), timeout=5).kv_cache_usage == 0.0
