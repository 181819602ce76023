"""services.common.wire: each hop's messages are defined once, and both ends
import that one definition; ``to_pb``/``from_pb`` round-trip every field."""

from __future__ import annotations

import pytest

from llmesh.v1 import engine_pb2
from services.common.step_profile import StepProfile
from services.common.wire.chat import ChatMessage, ChatPrompt
from services.common.wire.engine_info import LoadStats, ModelInfo
from services.common.wire.tokenizer_info import TokenizerInfo


def _round_trip(value: object) -> object:
    return type(value).from_pb(value.to_pb())  # type: ignore[attr-defined]


@pytest.mark.parametrize("value", [
    ChatMessage("user", "héllo 👋"),
    ChatPrompt((1, 2, 3), 2),
    TokenizerInfo("m", 100, (2, 7), 1, True, ("system", "user")),
    TokenizerInfo("m", 100, (2,), None, False),
    ModelInfo("m", 2048, 100, (2, 3), "torch", max_num_seqs=8, kv_capacity_tokens=4096,
              replica_id="r1", kv_block_size=16, kv_hash_seed=b"\x01\x02",
              max_num_batched_tokens=512),
    LoadStats(3, 1, 0.5, 77, StepProfile(2.0**-10, (0.25, 0.5), 2.0**-12)),  # float32-exact
], ids=lambda v: type(v).__name__)
def test_to_pb_then_from_pb_gives_the_value_back(value: object) -> None:
    assert _round_trip(value) == value


def test_router_and_tokenizer_share_one_definition() -> None:
    from services.router import clients, validation
    from services.tokenizer import service, tokenizer

    assert clients.ChatMessage is validation.ChatMessage is tokenizer.ChatMessage \
        is service.ChatMessage is ChatMessage
    assert clients.ChatPrompt is tokenizer.ChatPrompt is ChatPrompt
    assert clients.TokenizerInfo is tokenizer.TokenizerInfo is TokenizerInfo


def test_model_info_offload_blocks_stay_in_the_engine() -> None:
    info = ModelInfo("m", 2048, 100, (2,), "torch", kv_offload_blocks=64)
    assert ModelInfo.from_pb(info.to_pb()).kv_offload_blocks == 0


def test_load_with_a_bad_step_profile_reads_as_no_profile() -> None:
    pb = LoadStats(1, 0, 0.1, step_profile=StepProfile(1e-3, (0.5,))).to_pb()
    pb.decode_step_seconds[0] = -1.0
    assert LoadStats.from_pb(pb) == LoadStats(1, 0, pb.kv_cache_usage)


def test_engine_and_router_share_one_definition() -> None:
    from services.engine import types
    from services.router import load_watch, model_pool, routing

    assert types.ModelInfo is model_pool.ModelInfo is ModelInfo
    assert types.LoadStats is load_watch.LoadStats is routing.LoadStats is LoadStats
    assert isinstance(ModelInfo.from_pb(engine_pb2.GetModelInfoResponse()), ModelInfo)
