"""The KV offload tier with the real SmolLM2 weights: a prompt evicted from a
tiny KV pool and sent again is restored from the tier instead of recomputed,
with the greedy output of a run without the tier, no block leaked, the tier's
blocks in the KV events and its counts in the engine's metrics."""

from __future__ import annotations

import random

import pytest
import torch
from prometheus_client import CollectorRegistry

from llmesh.v1 import cache_pb2
from services.common.kv_events import BlockStored, Medium
from services.engine.kv_publisher import event_to_pb
from services.engine.metrics import EngineMetrics
from services.engine.torch_backend.model import LlamaModel
from services.engine.torch_backend.paged_kv import kv_block_bytes
from services.common.sampling import SamplingOptions
from services.engine.types import SequenceRequest, StepStats
from tests.engine.test_batch_exactness import idle, run, start_backend

pytestmark = pytest.mark.model

BLOCK = 16
#: Pool blocks: a 100-token prompt (6 full blocks), then a 180-token one, takes them all.
POOL_BLOCKS = 12


def prompt(length: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(100, 48000) for _ in range(length))


FIRST = prompt(100, 1)
OTHER = prompt(180, 2)  # with its 8 new tokens: the whole pool


def greedy(request_id: str, tokens: tuple[int, ...]) -> SequenceRequest:
    return SequenceRequest(request_id, tokens, SamplingOptions(max_tokens=8, ignore_eos=True))


class Observer:
    """Feeds the metrics and keeps the prompt tokens computed per step."""

    def __init__(self) -> None:
        self.metrics = EngineMetrics(CollectorRegistry())
        self.steps: list[StepStats] = []

    def __call__(self, stats: StepStats) -> None:
        self.steps.append(stats)
        self.metrics.observe_step(stats)

    def computed(self) -> int:
        """Prompt tokens computed since the last call."""
        total = sum(s.num_prompt_tokens_computed for s in self.steps)
        self.steps.clear()
        return total

    def value(self, name: str) -> float:
        found = self.metrics.registry.get_sample_value(name)
        assert found is not None, name
        return found


async def test_an_evicted_prompt_comes_back_from_the_tier(smollm2: LlamaModel) -> None:
    block_bytes = kv_block_bytes(smollm2.config, BLOCK, torch.float32)
    plain = Observer()
    tiered = Observer()
    settings = dict(max_model_len=256, block_size=BLOCK, kv_cache_bytes=POOL_BLOCKS * block_bytes,
                    max_num_batched_tokens=256)
    off = await start_backend(smollm2, plain, **settings)  # type: ignore[arg-type]
    on = await start_backend(smollm2, tiered,  # type: ignore[arg-type]
                             kv_offload_bytes=64 * block_bytes, **settings)
    try:
        outputs = {}
        for name, backend, observer in (("off", off, plain), ("on", on, tiered)):
            first = await run(backend, greedy(f"{name}-1", FIRST))
            await run(backend, greedy(f"{name}-other", OTHER))  # evicts FIRST's blocks
            observer.computed()
            again = await run(backend, greedy(f"{name}-2", FIRST))
            outputs[name] = (first, again, observer.computed())
            await idle(backend)  # free + cached == total, nothing used
        assert outputs["on"][:2] == outputs["off"][:2]
        assert outputs["on"][0] == outputs["on"][1]
        assert outputs["off"][2] == 100  # recomputed in full without the tier
        assert outputs["on"][2] == 100 - 6 * BLOCK  # 6 full blocks restored

        offloaded = [event for event in on.drain_kv_events()
                     if isinstance(event, BlockStored) and event.medium is Medium.OFFLOAD]
        stored = {h for event in offloaded for h in event.block_hashes}
        assert event_to_pb(offloaded[0]).stored.medium == cache_pb2.KV_MEDIUM_OFFLOAD
        snapshot = on.kv_snapshot()
        assert snapshot is not None and set(snapshot.offloaded_hashes) <= stored
        assert len(stored) >= 6

        # the router prices a tier hit by the engine's measured restore time
        restore_token_s = on.load().to_pb().restore_seconds_per_token
        assert 0 < restore_token_s < on.load().to_pb().prefill_seconds_per_token

        value = tiered.value
        assert value("llmesh:kv_offload_hits_total") == 6
        assert value("llmesh:kv_offload_restored_blocks_total") == 6
        assert value("llmesh:kv_offload_queries_total") >= 6
        assert value("llmesh:kv_offload_stored_blocks_total") >= 6
        assert value("llmesh:kv_offload_bytes") >= 6 * block_bytes
        assert on.resources().kv_offload_capacity_bytes == 64 * block_bytes
        assert value("llmesh:kv_offload_restore_seconds_count") == 1
        tiered.metrics.track_blocks(on.kv_block_counts)
        free, cached, used = (tiered.metrics.registry.get_sample_value(
            "llmesh:kv_cache_blocks", {"state": state}) for state in ("free", "cached", "used"))
        assert used == 0 and free + cached == value("llmesh:kv_cache_num_blocks") == POOL_BLOCKS
    finally:
        await off.shutdown()
        await on.shutdown()
