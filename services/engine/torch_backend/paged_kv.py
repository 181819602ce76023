"""Paged KV storage and paged attention in plain PyTorch.

Storage: one key and one value tensor of shape ``[num_layers, num_kv_heads,
num_blocks, block_size, head_dim]``, sized from a byte budget
(:func:`num_blocks_for_budget`) and zero-filled (attention multiplies the
probability 0 of a masked key by whatever a slot holds, so every slot must hold
a finite number). Heads come before blocks so that gathering a sequence's
blocks (``index_select`` on the block dim) yields the ``[heads, tokens,
head_dim]`` layout attention wants, without a permute.

A step's attention (:class:`AttentionBatch`, built once per step by the model
runner and shared by all layers) writes the step's new keys/values into their
slots (``block_id * block_size + offset``), then attends in groups: one
batched call for all sequences that compute one token (decodes, padded to the
longest context), and one call per sequence computing several (prefill
chunks). Queries are grouped per KV head (grouped-query attention: query head
``h`` reads KV head ``h // group``).

In batch-invariant mode (the default, see
:mod:`~services.engine.torch_backend.batch_invariant`) query rows are padded
to an M-independent count, key lengths to a multiple of ``KEY_CHUNK``, and the
value sum runs over fixed key chunks added in order, so a query's output does
not depend on its group, its chunk or the other sequences.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from services.engine.torch_backend.batch_invariant import KEY_CHUNK, MIN_FREE_ROWS, padded_rows
from services.engine.torch_backend.device import to_device
from services.engine.torch_backend.llama_config import LlamaConfig
from services.engine.torch_backend.rope import apply_rope_flipped


def kv_block_bytes(config: LlamaConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block's keys and values across all layers."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * config.num_kv_heads * block_size * config.head_dim * itemsize


def num_blocks_for_budget(config: LlamaConfig, block_size: int, dtype: torch.dtype,
                          budget_bytes: int) -> int:
    """How many blocks fit in ``budget_bytes`` (at least 0)."""
    return max(budget_bytes // kv_block_bytes(config, block_size, dtype), 0)


class PagedKVCache:
    """Zero-filled key and value storage for ``num_blocks`` blocks on a device.

    Args:
      scratch_blocks: blocks allocated past ``num_blocks`` that no sequence
        owns (ids ``num_blocks ..``): padding rows of a captured CUDA graph
        write their keys/values there (:mod:`~services.engine.torch_backend.cuda_graphs`).

    Attributes:
      k: ``[num_layers, num_kv_heads, num_blocks, block_size, head_dim]``, or with
        ``transposed_keys`` ``[num_layers, num_kv_heads, num_blocks, head_dim,
        block_size]`` (the native kernel's layout: 16 keys of one dim are one
        vector load).
      v: ``[num_layers, num_kv_heads, num_blocks, block_size, head_dim]``.
      transposed_keys: the key layout.
    """

    def __init__(self, config: LlamaConfig, num_blocks: int, block_size: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 transposed_keys: bool = False, scratch_blocks: int = 0) -> None:
        shape = (config.num_layers, config.num_kv_heads, num_blocks + scratch_blocks, block_size,
                 config.head_dim)
        key_shape = shape[:3] + (shape[4], shape[3]) if transposed_keys else shape
        self.k = torch.zeros(key_shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.transposed_keys = transposed_keys
        self.num_blocks = num_blocks
        self.block_size = block_size
        #: The first scratch block (None without): owned by no sequence.
        self.scratch_block = num_blocks if scratch_blocks else None

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values together (scratch blocks included)."""
        return self.k.nbytes + self.v.nbytes

    @property
    def num_tokens(self) -> int:
        """Token slots sequences can own (scratch blocks excluded)."""
        return self.num_blocks * self.block_size

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores new keys/values ``[tokens, kv_heads, head_dim]`` at ``slots`` ``[tokens]``."""
        heads, _, _, dim = self.k.shape[1:]
        self.k[layer].view(heads, -1, dim).index_copy_(1, slots, k.transpose(0, 1))
        self.v[layer].view(heads, -1, dim).index_copy_(1, slots, v.transpose(0, 1))

    def copy_blocks(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copies the keys and values of blocks ``src[i]`` to blocks ``dst[i]`` in
        every layer (a forked sequence's own copy of a shared partial block)."""
        device = self.k.device
        source = to_device(list(src), device)
        target = to_device(list(dst), device)
        for storage in (self.k, self.v):
            storage.index_copy_(2, target, storage.index_select(2, source))

    def gather(self, layer: int, block_ids: torch.Tensor, num_seqs: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[kv_heads, num_seqs, tokens, head_dim]`` of ``block_ids``
        ``[num_seqs * blocks_per_seq]`` (each sequence's blocks back to back)."""
        heads, dim = self.k.shape[1], self.k.shape[-1]
        k = self.k[layer].index_select(1, block_ids).view(heads, num_seqs, -1, dim)
        v = self.v[layer].index_select(1, block_ids).view(heads, num_seqs, -1, dim)
        return k, v


class StepAttention(Protocol):
    """One step's attention plan, shared by every layer: :class:`AttentionBatch`
    (PyTorch ops) or ``native_attention.NativeAttentionBatch`` (the C kernel)."""

    num_tokens: int

    def attend(self, layer: int, qkv: torch.Tensor, scale: float,
               out_dtype: torch.dtype) -> torch.Tensor:
        """Layer ``layer``'s attention from its fused QKV projection output ``qkv``
        ``[rows, (heads + 2 * kv_heads) * head_dim]``: rotates queries and new
        keys (RoPE at each token's position), writes the new keys/values into
        the cache, and returns the outputs ``[rows, heads * head_dim]`` in
        ``out_dtype`` (padding rows past :attr:`num_tokens` come back zero)."""
        ...


@dataclass(frozen=True, slots=True)
class AttentionGroup:
    """Query tokens attended in one batched call.

    Attributes:
      first_row: row of its first query token in the flat batch.
      num_seqs: sequences in the group.
      tokens_per_seq: query tokens of each sequence (1 for a decode group).
      rows: query rows per sequence and KV head (``tokens_per_seq * group``),
        padded for batch invariance.
      block_ids: ``[num_seqs * blocks_per_seq]`` blocks to gather (padded with block 0).
      mask: ``[num_seqs, rows or 1, keys]``, True where a query must not see a key.
    """

    first_row: int
    num_seqs: int
    tokens_per_seq: int
    rows: int
    block_ids: torch.Tensor
    mask: torch.Tensor


@dataclass(frozen=True)
class SeqAttention:
    """One sequence's share of a step, as attention sees it.

    Attributes:
      start: its tokens already in the cache (position of its first new token).
      num_tokens: its new tokens in the step.
      block_ids: its blocks, covering at least ``start + num_tokens`` tokens.
    """

    start: int
    num_tokens: int
    block_ids: Sequence[int]


class AttentionBatch:
    """The attention plan of one step, shared by every layer.

    Args:
      cache: the KV storage.
      seqs: the step's sequences in flat-batch order, those with one new token
        first (they form the decode group).
      slots: ``[num_tokens]`` slot of each new token.
      group_size: query heads per KV head.
      positions: ``[rows]`` each row's position (padding rows: any valid one).
      rope: the model's RoPE tables (cosine, signed sine; ``LlamaModel.rope``).
      batch_invariant: pad shapes so results do not depend on the batch.
      sliding_window: None (every query sees its whole causal context), or the
        keys a query sees, itself included: query at position ``i`` sees keys
        ``j`` with ``i - sliding_window < j <= i`` (Gemma 3's local layers;
        transformers' ``sliding_window_overlay``). Masked keys are still
        gathered: the window changes the mask, not the work.
    """

    def __init__(self, cache: PagedKVCache, seqs: Sequence[SeqAttention], slots: torch.Tensor,
                 group_size: int, positions: torch.Tensor,
                 rope: tuple[torch.Tensor, torch.Tensor], batch_invariant: bool = True,
                 sliding_window: int | None = None) -> None:
        self._setup(cache, slots, group_size, positions, rope, batch_invariant, sliding_window)
        device = slots.device
        num_decode = 0
        while num_decode < len(seqs) and seqs[num_decode].num_tokens == 1:
            num_decode += 1
        if num_decode:
            self.groups.append(self._decode_group(seqs[:num_decode], device))
        row = num_decode
        for seq in seqs[num_decode:]:
            self.groups.append(self._prefill_group(seq, row, device))
            row += seq.num_tokens

    def _setup(self, cache: PagedKVCache, slots: torch.Tensor, group_size: int,
               positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
               batch_invariant: bool, sliding_window: int | None) -> None:
        """The state every plan has; the groups are the constructor's job."""
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
        self.sliding_window = sliding_window
        if cache.transposed_keys:
            raise ValueError("AttentionBatch reads keys [blocks, block_size, head_dim]; "
                             "this cache holds them transposed (the native kernel's layout)")
        self.cache = cache
        self._cos = rope[0][positions].unsqueeze(1)
        self._sin_signed = rope[1][positions].unsqueeze(1)
        self.slots = slots
        self.num_tokens = int(slots.shape[0])
        self.group_size = group_size
        self.batch_invariant = batch_invariant
        self._key_multiple = math.lcm(KEY_CHUNK, cache.block_size) if batch_invariant \
            else cache.block_size
        self.groups: list[AttentionGroup] = []
        self._row_buffers: dict[int, torch.Tensor] = {}

    @classmethod
    def decode_only(cls, cache: PagedKVCache, slots: torch.Tensor, group_size: int,
                    positions: torch.Tensor, seq_lens: torch.Tensor, block_ids: torch.Tensor,
                    rope: tuple[torch.Tensor, torch.Tensor], batch_invariant: bool = True
                    ) -> AttentionBatch:
        """The plan of a step in which each of ``B`` sequences computes one token,
        built from device tensors with tensor ops only (no host data, no
        host-device copy): what a CUDA graph captures once and replays with
        new values in the same tensors.

        Args:
          slots, positions, seq_lens: ``[B]`` int64: each token's KV slot, its
            position, and its sequence's length with it (keys ``< seq_len`` are seen).
          block_ids: ``[B * blocks_per_seq]`` int64, each sequence's block table
            padded to ``blocks_per_seq`` (padding: any valid block, masked);
            ``blocks_per_seq * block_size`` keys must be a multiple of
            ``lcm(KEY_CHUNK, block_size)`` when ``batch_invariant``.
          Others: as the constructor.

        Raises:
          ValueError: a key count the batch-invariant value sum cannot chunk.
        """
        plan = cls.__new__(cls)
        plan._setup(cache, slots, group_size, positions, rope, batch_invariant, None)
        num_seqs = int(slots.shape[0])
        num_keys = int(block_ids.shape[0]) // num_seqs * cache.block_size
        if num_keys % plan._key_multiple:
            raise ValueError(f"{num_keys} keys per sequence is not a multiple of "
                             f"{plan._key_multiple}")
        keys = torch.arange(num_keys, device=slots.device)
        mask = keys[None, :] >= seq_lens[:, None]
        plan.groups.append(AttentionGroup(0, num_seqs, 1, plan._rows(group_size), block_ids,
                                          mask.unsqueeze(1)))
        return plan

    def _keys(self, num_keys: int) -> int:
        multiple = self._key_multiple
        return -(-num_keys // multiple) * multiple

    def _rows(self, rows: int) -> int:
        return padded_rows(rows) if self.batch_invariant else rows

    def _block_ids(self, seqs: Sequence[SeqAttention], num_keys: int) -> list[int]:
        per_seq = num_keys // self.cache.block_size
        ids: list[int] = []
        for seq in seqs:
            table = list(seq.block_ids[:per_seq])
            ids.extend(table)
            ids.extend([0] * (per_seq - len(table)))
        return ids

    def _decode_group(self, seqs: Sequence[SeqAttention], device: torch.device) -> AttentionGroup:
        lengths = [seq.start + 1 for seq in seqs]
        num_keys = self._keys(max(lengths))
        block_ids = to_device(self._block_ids(seqs, num_keys), device)
        keys = torch.arange(num_keys, device=device)
        ends = to_device(lengths, device)[:, None]
        mask = keys[None, :] >= ends
        if self.sliding_window is not None:  # query position = length - 1
            mask |= keys[None, :] <= ends - 1 - self.sliding_window
        return AttentionGroup(0, len(seqs), 1, self._rows(self.group_size), block_ids,
                              mask.unsqueeze(1))

    def _prefill_group(self, seq: SeqAttention, first_row: int,
                       device: torch.device) -> AttentionGroup:
        num_keys = self._keys(seq.start + seq.num_tokens)
        block_ids = to_device(self._block_ids([seq], num_keys), device)
        rows = seq.num_tokens * self.group_size
        padded = self._rows(rows)
        last_key = torch.arange(seq.start, seq.start + seq.num_tokens, device=device)
        last_key = last_key.repeat_interleave(self.group_size)
        if padded > rows:  # padding rows see every key (finite, discarded)
            last_key = F.pad(last_key, (0, padded - rows), value=num_keys)
        keys = torch.arange(num_keys, device=device)[None, :]
        mask = keys > last_key[:, None]
        if self.sliding_window is not None:  # padding rows keep their last keys
            mask |= keys <= last_key[:, None] - self.sliding_window
        return AttentionGroup(first_row, 1, seq.num_tokens, padded, block_ids, mask.unsqueeze(0))

    def attend(self, layer: int, qkv: torch.Tensor, scale: float,
               out_dtype: torch.dtype) -> torch.Tensor:
        """See :meth:`StepAttention.attend`. Q and K are rotated in one call in
        the cache's dtype (RoPE's "rotate half" as a flip of the two halves
        times a sign-folded sine table)."""
        kv_heads, dim = self.cache.k.shape[1], self.cache.k.shape[-1]
        heads = kv_heads * self.group_size
        qkv = qkv.to(self.cache.k.dtype)
        q_and_k = qkv[:, :(heads + kv_heads) * dim].view(-1, heads + kv_heads, dim)
        q_and_k = apply_rope_flipped(q_and_k, self._cos, self._sin_signed)
        v = qkv[:, (heads + kv_heads) * dim:].view(-1, kv_heads, dim)
        out = self._attend(layer, q_and_k[:, :heads], q_and_k[:, heads:], v, scale)
        return out.to(out_dtype)

    def _attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float) -> torch.Tensor:
        """Writes this layer's new ``k``/``v`` ``[tokens, kv_heads, head_dim]`` into
        the cache, then returns attention outputs ``[rows of q, heads * head_dim]``
        for ``q`` ``[rows, heads, head_dim]`` (rows past the step's tokens are
        padding and come back zero)."""
        tokens = self.num_tokens
        self.cache.write(layer, self.slots, k[:tokens], v[:tokens])
        groups = self.groups
        if len(groups) == 1 and tokens == q.shape[0]:  # e.g. a decode-only step
            return self._attend_group(layer, groups[0], q, scale)
        out = q.new_zeros(q.shape[0], q.shape[1] * q.shape[2])
        for group in groups:
            first, last = group.first_row, group.first_row + group.num_seqs * group.tokens_per_seq
            out[first:last] = self._attend_group(layer, group, q[first:last], scale)
        return out

    def _query_rows(self, group: AttentionGroup, q: torch.Tensor, scale: float) -> torch.Tensor:
        """``q * scale`` ``[seqs * tokens, heads, dim]`` laid out as the group's
        ``[kv_heads, seqs, rows, dim]`` query rows (one copy; padding rows zero).

        The padded buffer is allocated once per step and group and reused by every
        layer (its padding rows are never written)."""
        kv_heads, dim = self.cache.k.shape[1], q.shape[-1]
        seqs, tokens, size = group.num_seqs, group.tokens_per_seq, self.group_size
        rows = q.view(seqs, tokens, kv_heads, size, dim).permute(2, 0, 1, 3, 4)
        buffer = self._row_buffers.get(group.first_row)
        if buffer is None:
            buffer = q.new_zeros(kv_heads, seqs, group.rows, dim)
            self._row_buffers[group.first_row] = buffer
        target = buffer[:, :, :tokens * size].view(kv_heads, seqs, tokens, size, dim)
        torch.mul(rows, scale, out=target)
        return buffer

    def _attend_group(self, layer: int, group: AttentionGroup, q: torch.Tensor,
                      scale: float) -> torch.Tensor:
        kv_heads, dim = self.cache.k.shape[1], q.shape[-1]
        seqs, tokens, size = group.num_seqs, group.tokens_per_seq, self.group_size
        # [seqs * tokens, heads, dim] -> [kv_heads, seqs, rows (padded), dim]
        rows = self._query_rows(group, q, scale)
        keys, values = self.cache.gather(layer, group.block_ids, seqs)
        scores = torch.matmul(rows, keys.transpose(-1, -2))
        scores.masked_fill_(group.mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if self.batch_invariant:
            attended = _chunked_value_sum(probs, values)
        else:
            attended = torch.matmul(probs, values)
        # [kv_heads, seqs, rows, dim] -> [seqs * tokens, heads * dim]
        attended = attended[:, :, :tokens * size].reshape(kv_heads, seqs, tokens, size, dim)
        return attended.permute(1, 2, 0, 3, 4).reshape(seqs * tokens, kv_heads * size * dim)


#: Rows per tile of the batch-invariant value sum.
VALUE_SUM_TILE_ROWS = 48


def _row_tiles(rows: int) -> list[tuple[int, int]]:
    """``[start, end)`` row tiles of :data:`VALUE_SUM_TILE_ROWS` rows; a remainder
    under ``MIN_FREE_ROWS`` joins the tile before it, so every tile of a split
    has at least that many rows (from there on MKL's per-row result does not
    depend on the row count; a call that is not split keeps its padded rows)."""
    starts = list(range(0, rows, VALUE_SUM_TILE_ROWS))
    if len(starts) > 1 and rows - starts[-1] < MIN_FREE_ROWS:
        starts.pop()
    return [(s, starts[i + 1] if i + 1 < len(starts) else rows) for i, s in enumerate(starts)]


def _chunked_value_sum(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Batch-invariant ``probs @ values``: ``[kv_heads, seqs, rows, keys]`` x
    ``[kv_heads, seqs, keys, dim]`` -> ``[kv_heads, seqs, rows, dim]``.

    Each row's product is summed over fixed :data:`KEY_CHUNK`-key chunks in key
    order (a sequential scan), so it does not depend on how many keys the call
    pads to. Rows are independent, so long prefill chunks are processed in row
    tiles: the ``[chunks, rows, dim]`` partial products of a tile stay in cache
    instead of growing with context x rows (a 2,700-token prompt prefilled 6x
    slower untiled).
    """
    kv_heads, seqs, rows, keys = probs.shape
    dim = values.shape[-1]
    chunks = keys // KEY_CHUNK
    values = values.view(kv_heads, seqs, chunks, KEY_CHUNK, dim)
    tiles = _row_tiles(rows)
    parts = []
    for start, end in tiles:
        tile = probs[:, :, start:end].reshape(kv_heads, seqs, end - start, chunks, KEY_CHUNK)
        parts.append(torch.matmul(tile.transpose(2, 3), values).cumsum(dim=2)[:, :, -1])
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


@dataclass(frozen=True)
class LayerAttentionSpec:
    """How one layer attends, where layers differ (Gemma 3's local and global layers).

    Attributes:
      rope: the layer's RoPE tables (cosine, signed sine) ``[max_positions, head_dim]``.
      sliding_window: see :class:`AttentionBatch`; None for full causal attention.
    """

    rope: tuple[torch.Tensor, torch.Tensor]
    sliding_window: int | None = None


class LayerwiseAttention:
    """A step's attention plan for models whose layers attend differently: one
    :class:`AttentionBatch` per distinct :class:`LayerAttentionSpec` (built once
    per step, sharing the cache), and each layer's :meth:`attend` goes to its
    own. Same arguments as :class:`AttentionBatch`, plus ``specs`` (one per layer).
    """

    def __init__(self, cache: PagedKVCache, seqs: Sequence[SeqAttention], slots: torch.Tensor,
                 group_size: int, positions: torch.Tensor, specs: Sequence[LayerAttentionSpec],
                 batch_invariant: bool = True) -> None:
        self.num_tokens = int(slots.shape[0])
        plans: dict[tuple[int, int | None], AttentionBatch] = {}
        self._by_layer: list[AttentionBatch] = []
        for spec in specs:
            key = (id(spec.rope[0]), spec.sliding_window)
            if key not in plans:
                plans[key] = AttentionBatch(cache, seqs, slots, group_size, positions, spec.rope,
                                            batch_invariant, spec.sliding_window)
            self._by_layer.append(plans[key])

    def attend(self, layer: int, qkv: torch.Tensor, scale: float,
               out_dtype: torch.dtype) -> torch.Tensor:
        """See :meth:`StepAttention.attend`, with layer ``layer``'s spec."""
        return self._by_layer[layer].attend(layer, qkv, scale, out_dtype)
