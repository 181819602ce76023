"""The chained hash of a full KV block: one definition for engine, router and cache.

A prompt's KV blocks are named by hashes that chain from a seed: block ``i``
of ``block_size`` tokens hashes as ``SHA-256(hash(block i-1) || ids of block
i)``, and the block before block 0 is the seed (vLLM v1's scheme,
``vllm/v1/core/kv_cache_utils.py``). Token ids are hashed as little-endian
int64. The engine's block pool names its cached blocks this way
(:mod:`services.engine.torch_backend.kv_cache_manager`), the engines publish
the names in their KV events, the cache service indexes them
(:mod:`services.cache.prefix_index`), and the router hashes a prompt the same
way to ask which replica holds its longest prefix.

The seed covers everything besides the token ids that decides a block's
keys and values: the model id and the engine's KV layout (quantization mode,
dtype, whether prompt tokens take other projections). Two engines agree on a
hash only if they agree on all of these; the engine computes the seed and
hands it to the router in ``GetModelInfo`` (``kv_hash_seed``), so the router
never has to know the recipe.

Cache scopes. A request's cache scope (the router resolves it from the tenant,
its cache group and the request's ``cache_salt``: an opaque string, "" for
the shared scope) salts the seed: :func:`scoped_seed` ``(seed, scope)`` is the
parent of that request's block 0, like vLLM's ``cache_salt`` in its first
block's hash. Equal token ids in two scopes thus hash apart in every block, so
the engine's prefix cache reuses blocks only within a scope, the KV events name
the blocks so, and the prefix index (and KV-aware routing, which hashes a
prompt with the same :func:`scoped_seed`) follows without knowing of scopes.
The shared scope is the seed itself: hashes are as before scopes existed.

Collisions: a hash names the whole prefix up to the end of its block, since
each block's input contains its parent's digest. Two different prefixes with
one hash would be a SHA-256 collision; with at most ~10^9 blocks ever indexed,
the birthday bound puts its probability below 10^18 / 2^256 ≈ 10^-59, so the
index (and the engine's prefix cache) treat equal hashes as equal prefixes.
Python's ``hash()`` is not used: it is salted per process and only 64 bits.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

#: A chained block hash: a SHA-256 digest, 32 bytes.
BlockHash = bytes

_SEED_TAG = b"llmesh-kv-block\0"
_SCOPE_TAG = b"\0scope\0"


def block_hash_seed(model_id: str, kv_layout: str = "") -> BlockHash:
    """The engine's seed: the parent hash of a sequence's first block in the
    shared scope (in another scope: :func:`scoped_seed` of it).

    Args:
      model_id: the served model id.
      kv_layout: everything else of the engine that changes the KV values
        (e.g. ``"int4/float32"``); "" for none.
    """
    data = _SEED_TAG + model_id.encode()
    if kv_layout:
        data += b"\0layout\0" + kv_layout.encode()
    return hashlib.sha256(data).digest()


def scoped_seed(seed: BlockHash, cache_scope: str) -> BlockHash:
    """The parent hash of block 0 of a request in ``cache_scope``.

    Args:
      seed: the engine's :func:`block_hash_seed` (``kv_hash_seed``).
      cache_scope: the request's cache scope; "" (the shared scope) gives
        ``seed`` itself.

    Returns:
      ``seed`` for "", else ``SHA-256(seed || "\\0scope\\0" || scope)``: 32 bytes.
    """
    if not cache_scope:
        return seed
    return hashlib.sha256(seed + _SCOPE_TAG + cache_scope.encode()).digest()


def _ids_bytes(token_ids: Sequence[int]) -> bytes:
    ids = array("q", token_ids)
    if sys.byteorder != "little":
        ids.byteswap()
    return ids.tobytes()


def hash_block(parent: BlockHash, token_ids: Sequence[int],
               num_prompt_tokens: int | None = None) -> BlockHash:
    """The chained hash of one full block.

    Args:
      parent: the previous block's hash (the seed for block 0).
      token_ids: the block's ``block_size`` token ids.
      num_prompt_tokens: how many of its tokens are prompt tokens, hashed only
        when given and fewer than all (an engine whose prompt tokens take other
        projections than generated ones: their KV differs).
    """
    data = parent + _ids_bytes(token_ids)
    if num_prompt_tokens is not None and num_prompt_tokens < len(token_ids):
        data += b"\0generated-from\0" + array("q", [num_prompt_tokens]).tobytes()
    return hashlib.sha256(data).digest()


def prompt_block_hashes(seed: BlockHash, token_ids: Sequence[int], block_size: int,
                        max_blocks: int | None = None) -> list[BlockHash]:
    """The chained hashes of the full blocks of a prompt, in order.

    A partial last block has no hash. ~1 µs per block here (125 blocks for a
    2,000-token prompt at ``block_size`` 16: ~0.15 ms).

    Args:
      seed: :func:`block_hash_seed` of the engine.
      token_ids: the prompt's ids.
      block_size: tokens per block (> 0).
      max_blocks: hash at most this many leading blocks (None: all).

    Raises:
      ValueError: ``block_size`` is not positive.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    count = len(token_ids) // block_size
    if max_blocks is not None:
        count = min(count, max_blocks)
    hashes: list[BlockHash] = []
    parent = seed
    for index in range(count):
        parent = hash_block(parent, token_ids[index * block_size:(index + 1) * block_size])
        hashes.append(parent)
    return hashes
