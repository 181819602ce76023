"""TensorRT-LLM iteration stats → llmesh's load snapshot and step metrics.

``LLM.get_stats_async()`` yields one entry per engine iteration (a dict, or
its JSON text in older releases) when the LLM was built with
``enable_iter_perf_stats=True`` (API: https://nvidia.github.io/TensorRT-LLM/llm-api/reference.html#tensorrt_llm.llmapi.LLM.get_stats_async;
keys: the executor's ``IterationStats``, ``cpp/include/tensorrt_llm/executor/types.h``).
The keys read here::

    {"iter": 12, "iterLatencyMS": 7.9, "numActiveRequests": 3, "numQueuedRequests": 1,
     "inflightBatchingStats": {"numScheduledRequests": 3, "numContextRequests": 1,
                               "numGenRequests": 2, "numPausedRequests": 0, "numCtxTokens": 512},
     "kvCacheStats": {"maxNumBlocks": 4096, "freeNumBlocks": 4000, "usedNumBlocks": 96,
                      "tokensPerBlock": 32},
     "specDecodingStats": {"numDraftTokens": 6, "numAcceptedTokens": 4,
                           "numRequestsWithDraftTokens": 2}}

Mapping:

* :class:`LoadStats` (then :func:`capped_load`): running = ``numActiveRequests``; waiting =
  ``numQueuedRequests`` + ``numPausedRequests`` (paused = preempted, waiting
  to resume); KV usage = ``usedNumBlocks / maxNumBlocks``; pending prefill
  tokens are not reported by TensorRT-LLM (0).
* :class:`StepStats` (step metrics): duration = ``iterLatencyMS`` / 1000;
  tokens computed = ``numCtxTokens`` + ``numGenRequests`` + ``numDraftTokens``
  (a decode computes its sampled token and its drafts); batch size =
  ``numScheduledRequests``; spec-decode drafts / draft tokens / accepted from
  ``specDecodingStats``. Missing sections count as 0.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.engine.types import LoadStats, StepStats


@dataclass(frozen=True)
class IterationSnapshot:
    """One iteration's stats in llmesh's terms.

    Attributes:
      load: the load after the iteration.
      step: what the iteration did (for the step metrics).
      kv_capacity_blocks: blocks in the KV cache (``maxNumBlocks``).
      tokens_per_block: tokens per KV block (``tokensPerBlock``); 0 if unreported.
    """

    load: LoadStats
    step: StepStats
    kv_capacity_blocks: int
    tokens_per_block: int


def parse_iteration_stats(entry: Mapping[str, Any] | str) -> IterationSnapshot:
    """The snapshot of one ``get_stats_async`` entry (see the module docstring).

    Raises:
      ValueError: a string entry that is not JSON, or an entry that is not an object.
    """
    stats: Any = json.loads(entry) if isinstance(entry, str) else entry
    if not isinstance(stats, Mapping):
        raise ValueError(f"an iteration stats entry is a JSON object, got {type(stats).__name__}")
    batching = stats.get("inflightBatchingStats") or {}
    kv = stats.get("kvCacheStats") or {}
    spec = stats.get("specDecodingStats") or {}
    max_blocks = int(kv.get("maxNumBlocks", 0))
    used = int(kv.get("usedNumBlocks", 0))
    load = LoadStats(
        num_running=int(stats.get("numActiveRequests", 0)),
        num_waiting=int(stats.get("numQueuedRequests", 0))
        + int(batching.get("numPausedRequests", 0)),
        kv_cache_usage=used / max_blocks if max_blocks else 0.0)
    draft_tokens = int(spec.get("numDraftTokens", 0))
    step = StepStats(
        duration_s=float(stats.get("iterLatencyMS", 0.0)) / 1000.0,
        num_scheduled_tokens=int(batching.get("numCtxTokens", 0))
        + int(batching.get("numGenRequests", 0)) + draft_tokens,
        batch_size=int(batching.get("numScheduledRequests", 0)),
        spec_num_drafts=int(spec.get("numRequestsWithDraftTokens", 0)),
        spec_num_draft_tokens=draft_tokens,
        spec_num_accepted_tokens=int(spec.get("numAcceptedTokens", 0)))
    return IterationSnapshot(load, step, max_blocks, int(kv.get("tokensPerBlock", 0)))


def capped_load(stats: LoadStats | None, in_flight: int, with_output: int) -> LoadStats:
    """The backend's ``load()``: the latest iteration's running / waiting
    counts capped by the requests in flight on this backend (its only
    client), and its KV usage. TensorRT-LLM reports no iteration once it
    idles, so its last stats may still count requests that have finished.
    Before the first stats (``stats`` None): the backend's own count, a
    request waiting until its first output.

    Args:
      stats: the latest iteration's load, or None.
      in_flight: requests this backend is streaming.
      with_output: of those, the ones that have had output.
    """
    if stats is None:
        return LoadStats(with_output, in_flight - with_output, 0.0)
    running = min(stats.num_running, in_flight)
    return LoadStats(running, min(stats.num_waiting, in_flight - running), stats.kv_cache_usage)
