"""Builders for the scheduler and block-manager tests (no model, CPU only), in the
manner of vLLM's ``make_request`` / ``create_scheduler``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as SequenceOf

from services.common.sampling import Priority, SamplingOptions
from services.engine.torch_backend.kv_cache_manager import KVCacheManager
from services.engine.torch_backend.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from services.engine.torch_backend.sequence import Sequence
from services.engine.types import SequenceRequest, TokenDelta

_arrivals = itertools.count()
EOS = 2


def make_request(request_id: str, prompt: SequenceOf[int] | int, max_tokens: int = 16,
                 priority: Priority = Priority.INTERACTIVE, ignore_eos: bool = True,
                 stop_token_ids: tuple[int, ...] = (), cache_scope: str = "") -> Sequence:
    """A sequence; an int ``prompt`` means that many distinct tokens (100, 101, ...)."""
    tokens = tuple(range(100, 100 + prompt)) if isinstance(prompt, int) else tuple(prompt)
    options = SamplingOptions(max_tokens=max_tokens, ignore_eos=ignore_eos,
                              stop_token_ids=stop_token_ids)
    return Sequence(SequenceRequest(request_id, tokens, options, priority,
                                    cache_scope=cache_scope), next(_arrivals))


def create_manager(num_blocks: int = 10, block_size: int = 4,
                   enable_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size, enable_caching, model_id="test-model")


def create_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_batched_tokens: int = 64,
                     max_num_seqs: int = 16, enable_caching: bool = True,
                     max_model_len: int = 1024, max_chunk_tokens: int | None = None
                     ) -> Scheduler:
    config = SchedulerConfig(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens,
                             max_chunk_tokens=max_chunk_tokens, eos_token_ids=frozenset({EOS}))
    return Scheduler(config, create_manager(num_blocks, block_size, enable_caching))


def compute(manager: KVCacheManager, seq: Sequence, num_tokens: int | None = None) -> None:
    """Pretends a step computed ``seq``'s tokens up to ``num_tokens`` (default all)
    and registers its full blocks, as ``update_from_output`` does."""
    seq.num_computed_tokens = seq.num_tokens if num_tokens is None else num_tokens
    manager.cache_computed_blocks(seq)


def step(scheduler: Scheduler, token: int = 7) -> tuple[list[tuple[str, int, int, bool]], list]:
    """One step with every sampled token equal to ``token``: the plan as
    ``(request_id, start, num_tokens, samples)`` rows, and the deltas (:func:`book`)."""
    out = scheduler.schedule()
    plan = [(s.seq.request_id, s.start, s.num_tokens, s.samples) for s in out.scheduled]
    sampled = [token for s in out.scheduled if s.samples]
    return plan, book(scheduler, out, sampled)


def book(scheduler: Scheduler, out: SchedulerOutput,
         sampled: SequenceOf[int | SequenceOf[int]]) -> list[TokenDelta]:
    """``scheduler.update_from_output(out, sampled)``, each sequence it returns
    delivered (its :meth:`Sequence.delta`, as the engine core does at once)."""
    return [seq.delta() for seq in scheduler.update_from_output(out, sampled)]
