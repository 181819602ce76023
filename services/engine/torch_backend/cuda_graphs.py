"""CUDA graphs for decode-only steps of the torch engine.

A decode step launches a few hundred small kernels (per layer: norm, QKV,
RoPE, KV write, gather, two attention products, softmax, MLP); at small batch
sizes the GPU waits on the host launching them. A CUDA graph records the
kernels of one step once and replays them with one launch (PyTorch,
"CUDA Graphs": ``torch.cuda.CUDAGraph``, ``torch.cuda.graph``; vLLM captures
its decode batches the same way).

A graph replays fixed shapes at fixed addresses, so:

- **Shapes**: one graph per (batch size, keys per sequence). Batch sizes are
  ``EngineConfig.graph_batch_sizes()`` (``--cuda-graph-sizes``; none with
  ``--enforce-eager``); a step of ``n`` decodes runs in the smallest captured
  size ``>= n`` (:func:`smallest_at_least`), its other rows padding. Keys per
  sequence come in :func:`key_lengths` buckets (doubling up to the context
  window): the PyTorch attention gathers every key of a sequence's padded
  block table, so one bucket for the whole window would make every short
  decode pay for the longest one.
- **Static inputs**: each graph owns one ``[rows, 4 + blocks_per_seq]`` int64
  device buffer (:class:`DecodeBuffers`): per row the token id, its position,
  its KV slot, its sequence length with it, then the block table padded with
  the scratch block. A step packs its inputs into a pinned host copy of that
  layout (:func:`pack_decode_inputs`) and sends it in one non-blocking copy;
  the replay reads the new values. Padding rows write their keys/values into
  the KV cache's scratch block (``PagedKVCache(scratch_blocks=1)``), which no
  sequence owns, and attend to it only.
- **Memory**: all graphs share one memory pool (``torch.cuda.graph_pool_handle()``),
  captured largest first, on one side stream used for warm-up and capture
  alike; one graph replays at a time. Shapes no step can reach with the KV
  cache's blocks are not captured (:func:`reachable_shapes`).
- **What runs eagerly**: prefill and mixed steps, steps scoring speculative
  tokens (``num_logits > 1``), steps with more decodes than the largest size
  or a context beyond the largest bucket, models whose layers attend
  differently (Gemma 3), quantized models (CPU only anyway).

The forward of a graph (:func:`decode_forward`) uses the same model code and
the same attention arithmetic as an eager step
(:meth:`~services.engine.torch_backend.paged_kv.AttentionBatch.decode_only`);
``tests/engine/test_cuda_graphs.py`` checks on the CPU that it gives the
eager step's logits bit for bit and leaves the real KV blocks as the eager
step does. Capture and replay themselves need a GPU
(``benchmarks/cuda_check.py``).

Host synchronisation: a replayed step reads no device value on the host; the
only transfer back is the sampled ids (``.tolist()`` in the step sampler).
A cancel is noticed between steps, not between layers (a graph has no
``should_stop`` check).
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from services.engine.torch_backend.batch_invariant import KEY_CHUNK
from services.engine.torch_backend.paged_kv import AttentionBatch, PagedKVCache

if TYPE_CHECKING:
    from services.engine.torch_backend.model import LlamaModel
    from services.engine.torch_backend.model_runner import StepInput

#: Columns of a row of :class:`DecodeBuffers` before its block table.
TOKEN, POSITION, SLOT, SEQ_LEN = 0, 1, 2, 3
HEADER_COLUMNS = 4
#: Shortest key bucket (tokens), before rounding to the key multiple.
MIN_KEY_BUCKET = 256


def smallest_at_least(value: int, sizes: Sequence[int]) -> int | None:
    """The smallest of the ascending ``sizes`` that is ``>= value``; None when all are smaller."""
    index = bisect.bisect_left(sizes, value)
    return sizes[index] if index < len(sizes) else None


def key_multiple(block_size: int, batch_invariant: bool) -> int:
    """Keys per sequence are padded to a multiple of this: whole blocks, and
    whole :data:`KEY_CHUNK` chunks for the batch-invariant value sum."""
    return math.lcm(KEY_CHUNK, block_size) if batch_invariant else block_size


def key_lengths(max_model_len: int, block_size: int, batch_invariant: bool,
                smallest: int = MIN_KEY_BUCKET) -> tuple[int, ...]:
    """Key buckets (keys per sequence) to capture, ascending: ``smallest``
    rounded up to :func:`key_multiple`, doubling, and the context window
    rounded up last. Every bucket is a multiple of :func:`key_multiple`.

    Raises:
      ValueError: ``max_model_len`` or ``block_size`` below 1.
    """
    if max_model_len < 1 or block_size < 1:
        raise ValueError(f"max_model_len and block_size must be >= 1, got {max_model_len} "
                         f"and {block_size}")
    multiple = key_multiple(block_size, batch_invariant)
    top = -(-max_model_len // multiple) * multiple
    length = -(-smallest // multiple) * multiple
    buckets = []
    while length < top:
        buckets.append(length)
        length *= 2
    buckets.append(top)
    return tuple(buckets)


def is_decode_only(inputs: Sequence[StepInput]) -> bool:
    """Every input computes one token and samples from its one logit row (what
    a captured graph computes)."""
    return bool(inputs) and all(len(item.token_ids) == 1 and item.samples
                                and item.num_logits == 1 for item in inputs)


def graph_shape(inputs: Sequence[StepInput], batch_sizes: Sequence[int],
                key_buckets: Sequence[int]) -> tuple[int, int] | None:
    """``(batch size, keys per sequence)`` of the graph that runs ``inputs``: the
    smallest captured size holding them and the smallest key bucket holding the
    longest sequence (with its new token); None when the step must run eagerly
    (not all decodes, too many, or too long)."""
    if not is_decode_only(inputs):
        return None
    size = smallest_at_least(len(inputs), batch_sizes)
    keys = smallest_at_least(max(item.start for item in inputs) + 1, key_buckets)
    if size is None or keys is None:
        return None
    return size, keys


def reachable_shapes(batch_sizes: Sequence[int], key_buckets: Sequence[int], num_blocks: int,
                     block_size: int) -> list[tuple[int, int]]:
    """The ``(batch size, key bucket)`` pairs some step can map to: the fewest
    sequences that take size ``s`` (one more than the next smaller size) each
    with the fewest keys that take bucket ``k`` (one more than the next
    smaller bucket) must fit the ``num_blocks`` KV blocks. Capturing the others
    would only cost memory (64 sequences of a 128k-token bucket gather more
    keys than any cache holds). Largest first (the capture order)."""
    shapes = []
    for i, size in enumerate(batch_sizes):
        fewest = (batch_sizes[i - 1] if i else 0) + 1
        for j, keys in enumerate(key_buckets):
            shortest = (key_buckets[j - 1] if j else 0) + 1
            if fewest * -(-shortest // block_size) <= num_blocks:
                shapes.append((size, keys))
    return sorted(shapes, reverse=True)


@dataclass
class DecodeBuffers:
    """The static inputs of one graph: ``table`` ``[rows, 4 + blocks_per_seq]``
    int64 on the device; row ``r`` holds token id, position, KV slot, sequence
    length (with this token), then the sequence's block ids padded with the
    scratch block. The views below are taken inside the captured forward, so
    a replay reads what the last :meth:`load` wrote."""

    table: torch.Tensor

    @classmethod
    def allocate(cls, rows: int, blocks_per_seq: int, device: torch.device) -> DecodeBuffers:
        """Zeroed buffers (token 0 at position 0 in slot 0: fill them with
        :func:`pack_decode_inputs` of no input before a capture)."""
        return cls(torch.zeros(rows, HEADER_COLUMNS + blocks_per_seq, dtype=torch.int64,
                               device=device))

    @property
    def rows(self) -> int:
        return int(self.table.shape[0])

    @property
    def blocks_per_seq(self) -> int:
        return int(self.table.shape[1]) - HEADER_COLUMNS

    def load(self, host: torch.Tensor) -> None:
        """Copies a packed host table (pinned on CUDA: the copy does not block
        the host) into the buffers."""
        self.table.copy_(host, non_blocking=True)


def pack_decode_inputs(inputs: Sequence[StepInput], out: np.ndarray, block_size: int,
                       scratch_block: int) -> None:
    """Writes ``inputs`` (decodes: one token each) into ``out``
    ``[rows, 4 + blocks_per_seq]`` int64 (the :class:`DecodeBuffers` layout);
    rows past ``len(inputs)`` become padding: token 0 at position 0, its slot
    the scratch block's first, length 1, a block table of the scratch block.

    Raises:
      ValueError: more inputs than rows, an input that is not one token, or a
        sequence whose blocks do not fit ``blocks_per_seq``.
    """
    rows, width = out.shape
    blocks_per_seq = width - HEADER_COLUMNS
    if len(inputs) > rows:
        raise ValueError(f"{len(inputs)} decodes do not fit a graph of {rows} rows")
    out[:, HEADER_COLUMNS:] = scratch_block
    out[len(inputs):, :HEADER_COLUMNS] = (0, 0, scratch_block * block_size, 1)
    for row, item in enumerate(inputs):
        if len(item.token_ids) != 1:
            raise ValueError(f"a graph step computes one token per sequence, got "
                             f"{len(item.token_ids)}")
        position = item.start
        needed = position // block_size + 1
        if needed > blocks_per_seq:
            raise ValueError(f"position {position} needs {needed} blocks; the graph holds "
                             f"{blocks_per_seq} per sequence")
        blocks = item.block_ids
        out[row, :HEADER_COLUMNS] = (item.token_ids[0], position,
                                     blocks[position // block_size] * block_size
                                     + position % block_size, position + 1)
        out[row, HEADER_COLUMNS:HEADER_COLUMNS + needed] = blocks[:needed]


def decode_forward(model: LlamaModel, cache: PagedKVCache, buffers: DecodeBuffers,
                   logit_rows: torch.Tensor, group_size: int,
                   batch_invariant: bool) -> torch.Tensor:
    """One decode step over the rows of ``buffers`` with tensor ops only (what
    a graph captures): writes every row's keys/values into its slot and
    returns logits ``[rows, vocab]`` for ``logit_rows`` (``arange(rows)``)."""
    table = buffers.table
    with torch.inference_mode():
        attention = AttentionBatch.decode_only(
            cache, table[:, SLOT], group_size, table[:, POSITION], table[:, SEQ_LEN],
            table[:, HEADER_COLUMNS:].reshape(-1), model.rope, batch_invariant)
        return model(table[:, TOKEN], attention, logit_rows)


@dataclass
class DecodeGraph:
    """One captured decode step: ``batch_size`` sequences (``rows`` with the
    batch-invariant row padding), ``keys`` per sequence."""

    batch_size: int
    keys: int
    buffers: DecodeBuffers
    host: torch.Tensor
    logits: torch.Tensor
    graph: Any  # torch.cuda.CUDAGraph
    copied: Any  # torch.cuda.Event: the last copy out of ``host`` has run


@dataclass(frozen=True)
class CaptureStats:
    """What :meth:`CudaGraphRunner.capture` did: graphs, seconds, bytes the
    graph pool reserved (``torch.cuda.memory_reserved`` growth)."""

    num_graphs: int
    seconds: float
    pool_bytes: int


class CudaGraphRunner:
    """Captured decode graphs for one model runner and its KV cache.

    Args:
      model: a dense Llama-shaped model on a CUDA device (uniform attention).
      cache: its KV cache, with a scratch block.
      batch_sizes: decode batch sizes to capture (ascending, >= 1).
      max_model_len: the longest sequence; the last key bucket covers it.
      batch_invariant: the runner's row/key padding rules.

    Raises:
      ValueError: the model or cache cannot be captured (the message says why).
    """

    def __init__(self, model: LlamaModel, cache: PagedKVCache, batch_sizes: Sequence[int],
                 max_model_len: int, batch_invariant: bool) -> None:
        reason = capture_refusal(model, cache)
        if reason is not None:
            raise ValueError(reason)
        if not batch_sizes or min(batch_sizes) < 1:
            raise ValueError(f"graph batch sizes must be >= 1, got {list(batch_sizes)}")
        self.model = model
        self.cache = cache
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.key_lengths = key_lengths(max_model_len, cache.block_size, batch_invariant)
        self.batch_invariant = batch_invariant
        self._group_size = model.config.num_heads // model.config.num_kv_heads
        self._graphs: dict[tuple[int, int], DecodeGraph] = {}
        self.replays = 0

    def capture(self, warmup_runs: int = 2) -> CaptureStats:
        """Captures every reachable (batch size, key bucket)
        (:func:`reachable_shapes`), largest first, into one shared pool, each after ``warmup_runs`` eager runs on the capture stream (cuBLAS
        handles and workspaces are made outside the capture). Every run writes
        only the scratch block. Blocking (seconds)."""
        device = self.cache.k.device
        began = time.perf_counter()
        reserved = torch.cuda.memory_reserved(device)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        for size, keys in reachable_shapes(self.batch_sizes, self.key_lengths,
                                           self.cache.num_blocks, self.cache.block_size):
            self._graphs[(size, keys)] = self._capture_one(size, keys, pool, stream, warmup_runs)
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        return CaptureStats(len(self._graphs), time.perf_counter() - began,
                            torch.cuda.memory_reserved(device) - reserved)

    def _capture_one(self, size: int, keys: int, pool: Any, stream: Any,
                     warmup_runs: int) -> DecodeGraph:
        device = self.cache.k.device
        rows = self.model.padded_rows(size) if self.batch_invariant else size
        assert self.cache.scratch_block is not None  # capture_refusal checked
        with torch.cuda.stream(stream):  # every tensor made and filled on the capture stream
            buffers = DecodeBuffers.allocate(rows, keys // self.cache.block_size, device)
            host = torch.empty_like(buffers.table, device="cpu").pin_memory()
            pack_decode_inputs([], host.numpy(), self.cache.block_size, self.cache.scratch_block)
            logit_rows = torch.arange(rows, device=device)
            buffers.load(host)
            for _ in range(warmup_runs):
                self._forward(buffers, logit_rows)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            logits = self._forward(buffers, logit_rows)
        return DecodeGraph(size, keys, buffers, host, logits, graph, torch.cuda.Event())

    def _forward(self, buffers: DecodeBuffers, logit_rows: torch.Tensor) -> torch.Tensor:
        return decode_forward(self.model, self.cache, buffers, logit_rows, self._group_size,
                              self.batch_invariant)

    def select(self, inputs: Sequence[StepInput]) -> DecodeGraph | None:
        """The graph that runs ``inputs``, or None (run them eagerly): not all
        decodes, more than the largest batch size, or a context beyond the
        largest key bucket."""
        shape = graph_shape(inputs, self.batch_sizes, self.key_lengths)
        return None if shape is None else self._graphs.get(shape)

    def run(self, graph: DecodeGraph, inputs: Sequence[StepInput]) -> torch.Tensor:
        """Replays ``graph`` for ``inputs``; logits ``[len(inputs), vocab]`` (a copy:
        the graph's output is overwritten by its next replay). The host waits
        only if the previous copy out of the pinned table has not run yet."""
        if not graph.copied.query():
            graph.copied.synchronize()
        assert self.cache.scratch_block is not None
        pack_decode_inputs(inputs, graph.host.numpy(), self.cache.block_size,
                           self.cache.scratch_block)
        graph.buffers.load(graph.host)
        graph.copied.record()
        graph.graph.replay()
        self.replays += 1
        return graph.logits[:len(inputs)].clone()

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)


def capture_refusal(model: LlamaModel, cache: PagedKVCache) -> str | None:
    """Why decode steps of ``model`` over ``cache`` cannot be captured, or None."""
    if cache.k.device.type != "cuda":
        return f"CUDA graphs need a CUDA device, the KV cache is on {cache.k.device}"
    if cache.scratch_block is None:
        return "the KV cache has no scratch block for padding rows"
    if cache.transposed_keys:
        return "the KV cache is in the native kernel's layout"
    if model.layer_attention is not None:
        return (f"the {model.config.architecture} model's layers attend differently "
                "(sliding window): its decode steps run eagerly")
    if model.quantization != "none" or model.has_prompt_projections:
        return "quantized models run eagerly"
    return None
