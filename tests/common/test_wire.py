"""services.common.wire: each hop's messages are defined once, and both ends
import that one definition; ``to_pb``/``from_pb`` round-trip every field."""

from __future__ import annotations

import pytest

from llmesh.v1 import engine_pb2
from services.cache.keys import entry_key
from services.common.sampling import FinishReason, SamplingOptions
from services.common.step_profile import StepProfile
from services.common.wire.cache import CachedResponse, CacheKey
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
    CachedResponse((5, 6, 2), "ok", FinishReason.STOP, "\n\n"),
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


def test_cached_response_with_an_unknown_finish_reason_reads_as_error() -> None:
    pb = CachedResponse((1,), "a", FinishReason.STOP).to_pb()
    pb.finish_reason = 99
    assert CachedResponse.from_pb(pb).finish_reason is FinishReason.ERROR


def test_cache_key_is_built_once_from_the_routers_options_and_hashed_by_the_cache() -> None:
    sampling = SamplingOptions(temperature=0.0, max_tokens=16, stop=("x",), seed=3)
    key = CacheKey("m", (1, 2, 3), sampling, cache_scope="t")
    assert key.to_pb() is key.to_pb()  # the lookup and the store share one message
    same = CacheKey("m", (1, 2, 3), SamplingOptions(temperature=0.0, max_tokens=16,
                                                     stop=("x",)), cache_scope="t")
    # greedy: the seed does not change the output, so the cache service keys both alike
    assert entry_key(key.to_pb()) == entry_key(same.to_pb())
    assert entry_key(key.to_pb()).deterministic
    fresh = CacheKey("m", (1, 2, 3), sampling, cache_scope="t")  # its message not built
    assert key == fresh and hash(key) == hash(fresh)  # a dict key still (pending stores)


def test_router_and_cache_client_share_one_definition() -> None:
    from services.router import clients

    assert clients.CacheKey is CacheKey and clients.CachedResponse is CachedResponse
