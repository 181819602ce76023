"""TensorRT-LLM's KV cache events → llmesh's KV event stream.

``LLM.get_kv_cache_events_async()`` yields one dict per event, as
``tensorrt_llm/_utils.py``'s ``KVCacheEventSerializer`` writes them (API
``LLM.get_kv_cache_events``: https://nvidia.github.io/TensorRT-LLM/llm-api/reference.html#tensorrt_llm.llmapi.LLM.get_kv_cache_events;
example https://nvidia.github.io/TensorRT-LLM/examples/llm_inference_kv_events.html)::

    {"event_id": 7, "window_size": 4096, "data": {"type": "stored", "parent_hash": 12 | None,
      "blocks": [{"type": "stored_block", "block_hash": 34, "cache_level": 0, "priority": 35,
                  "tokens": [{"type": "unique_token", "token_id": 1, "token_extra_id": 0}, ...]}]}}
    {"event_id": 8, "data": {"type": "removed", "block_hashes": [34, ...]}}
    {"event_id": 0, "data": {"type": "created", "num_blocks_per_cache_level": [..]}}
    {"event_id": 9, "data": {"type": "updated", "block_hash": 34, "cache_level": {..}, "priority": {..}}}

TensorRT-LLM names blocks with its own 64-bit hashes, which mean nothing to
the prefix index. :class:`KvEventConverter` recomputes OUR chained hash of
each stored block from its token ids (:func:`services.common.block_hash.hash_block`,
seeded like the torch engine's block pool), so the index cannot tell which
backend published an event, and keeps a map TRT hash → our hash so removals
translate. Rules:

* ``stored`` → :class:`BlockStored` of the blocks' OUR hashes. The chain starts
  at the seed when ``parent_hash`` is None, else at the parent's OUR hash. A
  stored event whose parent we never saw (it was stored before we listened,
  or its event was dropped) is dropped whole, and counted: we cannot name its
  blocks. A block with fewer than ``block_size`` tokens (partial reuse) or
  with a non-zero ``token_extra_id`` (multimodal content our hash does not
  cover) ends the chain there; its later removal is ignored.
* ``removed`` → :class:`BlockRemoved` of the OUR hashes we knew (unknown ones
  are skipped); they leave the map.
* ``created`` (the pool was (re)built: nothing cached) → :class:`AllBlocksCleared`;
  the map is emptied.
* ``updated`` (priority or cache level changed; the block stays reusable) →
  nothing.

Models with several attention windows (events per ``window_size``) are not
told apart: serve them with prefix caching off. Threading: not thread-safe;
one owner (the backend's event task).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.common.block_hash import BlockHash, hash_block
from services.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class KvEventConverter:
    """Translates TensorRT-LLM KV events of one engine (see the module docstring).

    Args:
      seed: the engine's block hash seed (:func:`~services.common.block_hash.block_hash_seed`).
      block_size: tokens per KV block (``tokens_per_block``).
    """

    def __init__(self, seed: BlockHash, block_size: int) -> None:
        self._seed = seed
        self._block_size = block_size
        self._ours: dict[int, BlockHash] = {}
        self.dropped_events = 0

    def convert(self, event: Mapping[str, Any]) -> list[KVEvent]:
        """Our events for one TensorRT-LLM event (none, or one), updating the hash map.

        Raises:
          KeyError / TypeError: ``event`` is not in the documented shape.
        """
        data = event["data"]
        kind = data["type"]
        if kind == "stored":
            return self._stored(data)
        if kind == "removed":
            ours = [self._ours.pop(h) for h in data["block_hashes"] if h in self._ours]
            return [BlockRemoved(tuple(ours))] if ours else []
        if kind == "created":
            self._ours.clear()
            return [AllBlocksCleared()]
        return []  # "updated": nothing the index tracks changed

    def block_hashes(self) -> tuple[BlockHash, ...]:
        """Our hashes of every block TensorRT-LLM holds as far as its events said."""
        return tuple(self._ours.values())

    def _stored(self, data: Mapping[str, Any]) -> list[KVEvent]:
        trt_parent = data.get("parent_hash")
        if trt_parent is None:
            parent, our_parent = self._seed, None
        elif trt_parent in self._ours:
            parent = our_parent = self._ours[trt_parent]
        else:
            self.dropped_events += 1
            return []
        hashes: list[BlockHash] = []
        token_ids: list[int] = []
        for block in data["blocks"]:
            tokens = block["tokens"]
            if len(tokens) != self._block_size or any(t.get("token_extra_id") for t in tokens):
                break
            ids = [int(t["token_id"]) for t in tokens]
            parent = hash_block(parent, ids)
            self._ours[block["block_hash"]] = parent
            hashes.append(parent)
            token_ids.extend(ids)
        if not hashes:
            return []
        return [BlockStored(tuple(hashes), our_parent, tuple(token_ids), self._block_size)]
