"""Paged attention through the native kernel (``kernels/paged_attention.c``).

One C call per layer and step rotates the queries and new keys (RoPE), writes
the new keys/values into their slots and attends every query row over its own
sequence's blocks, in place of the PyTorch path of
:mod:`~services.engine.torch_backend.paged_kv` (~12 padded tensor ops per
layer, a gathered copy of each sequence's blocks, and a chunked value sum kept
in key order by a ``cumsum``). Each row's arithmetic depends only on its own
query and keys in a fixed order, so it is batch-invariant without padding (the
C file says how); a 512-token prefill spends ~8x less time in attention than
the PyTorch path (docs/engine.md). The library is built by
:mod:`~services.engine.torch_backend.native`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from services.engine.torch_backend.native import load_library
from services.engine.torch_backend.paged_kv import PagedKVCache, SeqAttention

#: Return codes of ``llmesh_paged_attention``.
_ERRORS = {-1: "head_dim must be even and in [2, 256]",
           -2: "num_heads must be a multiple of num_kv_heads, at most 32 per KV head",
           -3: "out of memory", -4: "block_size must be at least 1"}


class StepPlan(ctypes.Structure):
    """``step_plan`` of the C file: one step's layout, shared by its layers."""

    _fields_ = [
        ("num_tokens", ctypes.c_int64), ("num_seqs", ctypes.c_int64),
        ("seq_first_row", ctypes.c_void_p), ("seq_num_tokens", ctypes.c_void_p),
        ("seq_start", ctypes.c_void_p), ("seq_table", ctypes.c_void_p),
        ("block_tables", ctypes.c_void_p), ("slots", ctypes.c_void_p),
        ("num_heads", ctypes.c_int64), ("num_kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64), ("block_size", ctypes.c_int64),
        ("cache_head_stride", ctypes.c_int64),
        ("rope_cos", ctypes.c_void_p), ("rope_sin", ctypes.c_void_p),
        ("qkv_bf16", ctypes.c_int32), ("out_bf16", ctypes.c_int32),
        ("scale", ctypes.c_float), ("num_threads", ctypes.c_int32),
    ]


class NativeAttentionBatch:
    """One step's attention through the kernel (see
    :class:`~services.engine.torch_backend.paged_kv.StepAttention`): RoPE, the
    KV write and paged attention in one call per layer.

    Args:
      cache: the KV storage (fp32, CPU), keys transposed (``transposed_keys``).
      seqs: the step's sequences in flat-batch order (any order).
      slots: ``[num_tokens]`` int64 slot of each new token, in row order.
      num_heads: query heads; ``cache`` gives the KV heads.
      rope: the model's RoPE tables ``[max_positions, head_dim]`` (cosine, sine
        with its first half negated; ``LlamaModel.rope``), fp32.

    Raises:
      NativeKernelUnavailable: see :func:`~services.engine.torch_backend.native.load_library`.
      ValueError: a sequence reaches past the RoPE tables or its blocks, a block
        id or slot is outside the cache, or the cache's keys are not transposed.
    """

    def __init__(self, cache: PagedKVCache, seqs: Sequence[SeqAttention], slots: torch.Tensor,
                 num_heads: int, rope: tuple[torch.Tensor, torch.Tensor]) -> None:
        self._function = load_library().llmesh_paged_attention
        self.cache = cache
        self.num_tokens = int(slots.shape[0])
        first_rows, counts, starts, tables, table_ids = [], [], [], [], []
        row = 0
        for seq in seqs:
            first_rows.append(row)
            counts.append(seq.num_tokens)
            starts.append(seq.start)
            tables.append(len(table_ids))
            table_ids.extend(seq.block_ids)
            row += seq.num_tokens
        cos, sin_signed = (table.contiguous() for table in rope)
        kv_heads, num_blocks, block_size, head_dim = cache.v.shape[1:]
        # The kernel trusts these: an out-of-range block or slot would read or
        # write outside the cache, so check them here (a ValueError fails the
        # step's requests; the engine lives).
        for seq in seqs:
            if seq.start + seq.num_tokens > cos.shape[0]:
                raise ValueError(f"position {seq.start + seq.num_tokens - 1} is past the RoPE "
                                 f"tables ({cos.shape[0]} positions)")
            if len(seq.block_ids) * block_size < seq.start + seq.num_tokens:
                raise ValueError(f"{len(seq.block_ids)} blocks cannot hold "
                                 f"{seq.start + seq.num_tokens} tokens")
        if table_ids and not 0 <= min(table_ids) <= max(table_ids) < num_blocks:
            raise ValueError(f"a block id is outside [0, {num_blocks})")
        if slots.numel() and not 0 <= int(slots.min()) <= int(slots.max()) < num_blocks * block_size:
            raise ValueError(f"a slot is outside [0, {num_blocks * block_size})")
        if slots.numel() != sum(counts):
            raise ValueError(f"{slots.numel()} slots for {sum(counts)} tokens")
        self._keep = [cos, sin_signed, slots.to(torch.int64).contiguous()]
        self._keep += [torch.tensor(values or [0], dtype=torch.int64)
                       for values in (first_rows, counts, starts, tables, table_ids)]
        if not cache.transposed_keys:
            raise ValueError("the native kernel needs the transposed key layout "
                             "(PagedKVCache(..., transposed_keys=True))")
        self.num_heads, self.head_dim = num_heads, int(head_dim)
        self._width = (num_heads + 2 * int(kv_heads)) * self.head_dim
        plan = StepPlan()
        plan.num_tokens, plan.num_seqs = self.num_tokens, len(seqs)
        (plan.rope_cos, plan.rope_sin, plan.slots, plan.seq_first_row, plan.seq_num_tokens,
         plan.seq_start, plan.seq_table, plan.block_tables) = (t.data_ptr() for t in self._keep)
        plan.num_heads, plan.num_kv_heads = num_heads, int(kv_heads)
        plan.head_dim, plan.block_size = self.head_dim, int(block_size)
        plan.cache_head_stride = int(num_blocks * block_size * head_dim)
        plan.num_threads = torch.get_num_threads()
        self._plan = plan
        self._layer_bytes = cache.k[0].nbytes
        self._out: dict[torch.dtype, torch.Tensor] = {}

    def attend(self, layer: int, qkv: torch.Tensor, scale: float,
               out_dtype: torch.dtype) -> torch.Tensor:
        """See :meth:`~services.engine.torch_backend.paged_kv.StepAttention.attend`;
        ``qkv`` fp32 or bf16, contiguous; ``out_dtype`` fp32 or bf16. The returned
        buffer is reused by the step's next layer.

        Raises:
          RuntimeError: another dtype or layout, or an error from the kernel.
        """
        if (qkv.dtype not in (torch.float32, torch.bfloat16) or not qkv.is_contiguous()
                or qkv.dim() != 2 or qkv.shape[1] != self._width
                or qkv.shape[0] < self.num_tokens
                or out_dtype not in (torch.float32, torch.bfloat16)):
            raise RuntimeError(f"paged attention kernel: qkv must be contiguous fp32/bf16 "
                               f"[rows >= {self.num_tokens}, {self._width}] and out fp32/bf16, "
                               f"got {qkv.dtype} {tuple(qkv.shape)} -> {out_dtype}")
        out = self._out.get(out_dtype)
        if out is None or out.shape[0] != qkv.shape[0]:  # padding rows stay zero
            out = self._out[out_dtype] = qkv.new_zeros(
                qkv.shape[0], self.num_heads * self.head_dim, dtype=out_dtype)
        plan = self._plan
        plan.qkv_bf16 = qkv.dtype == torch.bfloat16
        plan.out_bf16 = out_dtype == torch.bfloat16
        plan.scale = scale
        offset = layer * self._layer_bytes
        status = self._function(ctypes.addressof(plan), qkv.data_ptr(),
                                self.cache.k.data_ptr() + offset,
                                self.cache.v.data_ptr() + offset, out.data_ptr())
        if status != 0:
            raise RuntimeError(f"paged attention kernel: {_ERRORS.get(status, status)}")
        return out
