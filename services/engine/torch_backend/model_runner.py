"""Runs the model for the engine core: one batched forward per step over the paged KV cache.

The loop hands over each scheduled sequence's new tokens, its position and its
block ids (:class:`StepInput`); this module lays them out as the model's flat
``[num_tokens]`` batch (generated tokens first, one-token sequences leading:
they form the PyTorch attention's decode group; then prompt tokens, which a
quantized model with prompt projections computes with dense weights),
computes the KV slot of every new token, builds the step's attention plan
(the native kernel's :class:`~services.engine.torch_backend.native_attention.NativeAttentionBatch`
or :class:`~services.engine.torch_backend.paged_kv.AttentionBatch`), and
returns the next-token logits of the sequences that sample. In batch-invariant mode it
pads the token rows and the logit rows to counts whose matmul results do not
depend on the count (:func:`~services.engine.torch_backend.batch_invariant.padded_linear_rows`).

It owns the device, the dtype and the KV storage.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.engine.torch_backend.batch_invariant import probe, prompt_rows
from services.engine.torch_backend.cuda_graphs import CaptureStats, CudaGraphRunner
from services.engine.torch_backend.device import to_device
from services.common.checkpoint import gguf_architecture
from services.engine.torch_backend.gguf_loader import load_gguf
from services.engine.torch_backend.llama_config import LlamaConfig
from services.engine.torch_backend.start_checks import (
    ATTENTION_BACKENDS,
    DTYPE_NAMES,
    auto_quantization,
)
from services.engine.torch_backend.hf_loader import load_hf_checkpoint
from services.engine.torch_backend.model import LlamaModel, build_model
from services.engine.torch_backend.native import unavailable_reason
from services.engine.torch_backend.native_attention import NativeAttentionBatch
from services.engine.torch_backend.paged_kv import (
    AttentionBatch,
    LayerwiseAttention,
    PagedKVCache,
    SeqAttention,
    StepAttention,
    num_blocks_for_budget,
)
from services.engine.torch_backend.quant import (
    check_mode,
    resolve_quant_kernel,
)

#: ``--dtype`` names → torch dtypes.
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}

# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def resolve_attention_backend(choice: str, device: torch.device, dtype: torch.dtype,
                              config: LlamaConfig | None = None) -> str:
    """``native`` or ``torch`` for the ``--attention-backend`` ``choice`` (``auto``
    picks ``native`` where the kernel builds and serves ``device``/``dtype`` and
    the head shapes of ``config``).

    Raises:
      ValueError: an unknown choice, or ``native`` where the kernel cannot run
        (the message says why: device/dtype, no compiler, a failed build).
    """
    if choice not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {choice!r}")
    if choice == "torch":
        return choice
    if config is not None and not config.uniform_attention:
        reason = (f"the {config.architecture} model's layers attend differently (sliding "
                  "window, per-layer RoPE base), which only the PyTorch attention serves")
        if choice == "native":
            raise ValueError(f"--attention-backend native: {reason}; use --attention-backend torch")
        return "torch"
    shape = {} if config is None else {"head_dim": config.head_dim,
                                       "group_size": config.num_heads / config.num_kv_heads}
    reason = unavailable_reason(device, dtype, **shape)
    if reason is None:
        return "native"
    if choice == "native":
        raise ValueError(f"--attention-backend native: {reason}; use --attention-backend torch")
    return "torch"


def keep_freed_memory(trim_bytes: int = 1 << 30, mmap_bytes: int = 32 << 20) -> bool:
    """Tells glibc's allocator to keep freed memory for reuse instead of giving
    it back to the OS after each step.

    A CPU step frees and re-allocates tens of MB of temporaries per layer
    (gathered KV blocks, scores); with glibc's adaptive thresholds some steps
    returned them to the OS and page-faulted them back (~90,000 minor faults and
    2x the step time measured at 32 sequences). Fixed thresholds (trim above
    ``trim_bytes``, mmap only above ``mmap_bytes``) keep them in the heap. The
    setting is process-wide; the engine runs in its own process. Skipped where
    the user set ``MALLOC_TRIM_THRESHOLD_`` / ``MALLOC_MMAP_THRESHOLD_`` or the C
    library is not glibc.

    Returns:
      True if both thresholds were set.
    """
    if "MALLOC_TRIM_THRESHOLD_" in os.environ or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_TRIM_THRESHOLD, trim_bytes)) and bool(
        mallopt(_M_MMAP_THRESHOLD, mmap_bytes))


@dataclass(frozen=True, slots=True)
class StepInput:
    """One sequence's share of a step.

    Attributes:
      token_ids: tokens to compute now (a prefill chunk, or the last sampled token).
      start: tokens of this sequence already in the cache (position of the first).
      block_ids: the sequence's KV blocks, covering ``start + len(token_ids)`` tokens.
      samples: compute logits for this sequence.
      num_logits: how many of its last tokens get logits when it samples (1 for
        a plain step; ``k + 1`` to score ``k`` speculative tokens and the token
        after them; ``len(token_ids)`` for the log-likelihood of a whole chunk).
      prompt_len: the sequence's prompt length: its tokens at positions below
        it are prompt tokens, which take the model's prompt projections where
        it has them (:meth:`LlamaModel.add_prompt_projections`); None: every
        token is treated as generated.
    """

    token_ids: Sequence[int]
    start: int
    block_ids: Sequence[int]
    samples: bool = True
    num_logits: int = 1
    prompt_len: int | None = None


@dataclass
class StepBatch:
    """One step's flat batch, as :meth:`ModelRunner.prepare` lays it out.

    Attributes:
      token_ids, positions: per row (padding rows: token 0 at position 0).
      slots: the KV slot of each real row (block id * block size + offset).
      seqs: one :class:`SeqAttention` per part (a sequence's tokens of one role).
      logit_rows: the rows whose logits are returned, padded like the rows.
      num_logits: the real ones among ``logit_rows``.
      num_generated_rows: leading rows of generated tokens (the rest are prompt
        rows), None when the model has no separate prompt projections.
    """

    num_generated_rows: int | None
    token_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    seqs: list[SeqAttention] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)
    num_logits: int = 0


class ModelRunner:
    """Owns the model and its paged KV storage on one device.

    Not thread-safe: one thread (the engine core's worker) calls :meth:`run`.

    Args:
      model: the decoder, ready on ``device`` in ``dtype``.
      batch_invariant: pad shapes for batch-invariant results (see ``batch_invariant.py``).
      attention_backend: ``auto``, ``native`` or ``torch`` (see
        :func:`resolve_attention_backend`); :attr:`attention_backend` holds the
        one in use. The native kernel is batch-invariant by construction.

    Raises:
      ValueError: see :func:`resolve_attention_backend`.
    """

    def __init__(self, model: LlamaModel, device: torch.device, dtype: torch.dtype,
                 batch_invariant: bool = True, attention_backend: str = "auto") -> None:
        self.model = model
        self.config: LlamaConfig = model.config
        self.device = device
        self.dtype = dtype
        self.batch_invariant = batch_invariant
        self.attention_backend = resolve_attention_backend(attention_backend, device, dtype,
                                                           model.config)
        #: Why ``auto`` fell back to the PyTorch attention (None: it did not).
        self.native_unavailable_reason: str | None = None
        if attention_backend == "auto" and self.attention_backend == "torch":
            self.native_unavailable_reason = (unavailable_reason(
                device, dtype, model.config.head_dim,
                model.config.num_heads / model.config.num_kv_heads)
                if model.config.uniform_attention else "per-layer attention (sliding window)")
        self.kv_cache: PagedKVCache | None = None
        self._group_size = self.config.num_heads // self.config.num_kv_heads
        #: Captured decode graphs (CUDA, :meth:`capture_cuda_graphs`); None: every step eager.
        self.graphs: CudaGraphRunner | None = None

    @classmethod
    def from_gguf(cls, path: str | Path, device: str = "cpu", dtype: str = "float32",
                  max_positions: int | None = None, batch_invariant: bool = True,
                  quantization: str = "none", attention_backend: str = "auto",
                  dense_prefill: bool | None = False, quant_kernel: str = "auto") -> ModelRunner:
        """Loads the GGUF at ``path`` onto ``device`` in ``dtype``: dequantized for
        ``quantization="none"``; for ``int4`` its Q4_1 blocks go to the int4
        kernel as they are, for ``int8`` they are requantized per row (see
        :mod:`~services.engine.torch_backend.quant`); ``auto`` picks per
        :func:`~services.engine.torch_backend.start_checks.auto_quantization`; with
        ``dense_prefill`` a quantized model also gets dense bf16 prompt projections (None: only
        when its quantized kernels are PyTorch's, see ``EngineConfig.dense_prefill``)
        (:meth:`~services.engine.torch_backend.model.LlamaModel.add_prompt_projections`).

        Raises:
          FileNotFoundError, ValueError: see :func:`load_gguf`; ValueError for an
            unknown dtype or quantization name, a quantized mode for a non-Llama
            file (Gemma 3 is served dense), or a contradictory combination
            (:func:`~services.engine.torch_backend.quant.check_mode`), or an
            attention backend or quantized kernel that cannot run
            (:func:`resolve_attention_backend`,
            :func:`~services.engine.torch_backend.quant.resolve_quant_kernel`).
        """
        torch_device = _checked_device(dtype, device)
        if quantization == "auto":
            quantization = auto_quantization(gguf_architecture(path), dtype, torch_device.type)
        _check_options(quantization, dtype, torch_device, attention_backend, quant_kernel)
        loaded = load_gguf(path, keep_q4_1=quantization != "none")
        if loaded.config.architecture != "llama" and quantization != "none":
            raise ValueError(
                f"--quantization {quantization} is for Llama GGUFs (their Q4_1 blocks); this "
                f"{loaded.config.architecture} file's K-quant weights would be requantized, "
                "which is not quality-checked: use --quantization none (dense weights in --dtype)")
        model = build_model(loaded.config, loaded.state_dict, torch_device, DTYPES[dtype],
                            max_positions, quantization, loaded.q4_1, quant_kernel)
        _add_dense_prefill(model, dense_prefill)
        return cls(model, torch_device, DTYPES[dtype], batch_invariant, attention_backend)

    @classmethod
    def from_path(cls, path: str | Path, device: str = "cpu", dtype: str = "float32",
                  max_positions: int | None = None, batch_invariant: bool = True,
                  quantization: str = "none", attention_backend: str = "auto",
                  dense_prefill: bool | None = False, quant_kernel: str = "auto") -> ModelRunner:
        """:meth:`from_hf` for a checkpoint directory (holding ``config.json``),
        else :meth:`from_gguf`; same arguments."""
        load = cls.from_hf if Path(path).is_dir() else cls.from_gguf
        return load(path, device, dtype, max_positions, batch_invariant, quantization,
                    attention_backend, dense_prefill, quant_kernel)

    @classmethod
    def from_hf(cls, path: str | Path, device: str = "cpu", dtype: str = "float32",
                max_positions: int | None = None, batch_invariant: bool = True,
                quantization: str = "none", attention_backend: str = "auto",
                dense_prefill: bool | None = False, quant_kernel: str = "auto") -> ModelRunner:
        """Loads the Hugging Face safetensors checkpoint directory ``path``
        (:func:`~services.engine.torch_backend.hf_loader.load_hf_checkpoint`) onto
        ``device`` in ``dtype``, one tensor at a time. ``quantization``: ``auto``
        and ``none`` give dense weights in ``dtype``; ``int8`` / ``int4``
        quantize the dense weights at load (CPU, fp32; not quality-checked the
        way the GGUF's own Q4_1 blocks are). Other arguments as :meth:`from_gguf`.

        Raises:
          FileNotFoundError, ValueError: see :func:`~services.engine.torch_backend.hf_loader.load_hf_checkpoint`;
            ValueError as :meth:`from_gguf` for dtype, quantization, attention
            backend and quantized kernel.
        """
        torch_device = _checked_device(dtype, device)
        if quantization == "auto":
            quantization = "none"
        _check_options(quantization, dtype, torch_device, attention_backend, quant_kernel)
        # Quantizing starts from fp32 weights; a dense model reads them in its dtype.
        loaded = load_hf_checkpoint(path, torch.float32 if quantization != "none"
                                    else DTYPES[dtype])
        model = build_model(loaded.config, loaded.state_dict, torch_device, DTYPES[dtype],
                            max_positions, quantization, quant_kernel=quant_kernel)
        _add_dense_prefill(model, dense_prefill)
        return cls(model, torch_device, DTYPES[dtype], batch_invariant, attention_backend)

    @property
    def quantization(self) -> str:
        """The model's projection mode: ``none``, ``int8`` or ``int4``."""
        return self.model.quantization

    def decode_weight_bytes(self) -> int:
        """Bytes of weights read from memory by one decode step at batch 1 (all
        projections with their scales and zeros, the LM head, the norms; the
        embedding table only as the LM head; not the KV cache). Divided by the
        memory bandwidth it gives the step's roofline."""
        return self.model.decode_weight_bytes()

    def allocate_kv_cache(self, budget_bytes: int, block_size: int) -> PagedKVCache:
        """Allocates (zero-filled) as many KV blocks as fit in ``budget_bytes``; on
        CUDA one block more, the scratch block of the decode graphs' padding rows
        (``PagedKVCache.scratch_block``, owned by no sequence).

        Raises:
          ValueError: not even one block fits.
        """
        num_blocks = num_blocks_for_budget(self.config, block_size, self.dtype, budget_bytes)
        scratch = 1 if self.device.type == "cuda" else 0
        if num_blocks < 1:
            raise ValueError(f"a KV budget of {budget_bytes} bytes holds no block of "
                             f"{block_size} tokens")
        self.kv_cache = PagedKVCache(self.config, num_blocks, block_size, self.device,
                                     self.dtype, transposed_keys=self.attention_backend == "native",
                                     scratch_blocks=scratch)
        return self.kv_cache

    def capture_cuda_graphs(self, batch_sizes: Sequence[int], max_model_len: int
                            ) -> CaptureStats:
        """Captures decode steps of ``batch_sizes`` sequences as CUDA graphs (see
        :mod:`~services.engine.torch_backend.cuda_graphs`); later decode-only
        steps that fit one replay it. Call after :meth:`warm_up`.

        Raises:
          RuntimeError: no KV cache was allocated.
          ValueError: the model or device cannot be captured (the reason).
        """
        if self.kv_cache is None:
            raise RuntimeError("allocate_kv_cache() before capture_cuda_graphs()")
        graphs = CudaGraphRunner(self.model, self.kv_cache, batch_sizes, max_model_len,
                                 self.batch_invariant)
        stats = graphs.capture()
        self.graphs = graphs
        return stats

    def run(self, inputs: Sequence[StepInput],
            should_stop: Callable[[], bool] | None = None) -> torch.Tensor:
        """Computes one step: writes every new token's keys/values into its slots
        and returns logits ``[sum of num_logits over the inputs that sample, vocab]``:
        for each sampling input in input order, the logits of its last
        ``num_logits`` tokens in position order (row ``j`` predicts the token
        after position ``start + len(token_ids) - num_logits + j``).
        ``should_stop`` is asked before each layer (see :meth:`LlamaModel.forward`).
        A decode-only step that fits a captured CUDA graph replays it
        (:attr:`graphs`; ``should_stop`` is not asked then); any other step is
        :meth:`prepare` (the layout) then :meth:`run_model` (the eager forward).

        Raises:
          RuntimeError: no KV cache was allocated.
          ValueError: an input asks for more logits than it has tokens, or none.
          StepAbandoned: ``should_stop`` returned True; the new tokens' KV slots
            are partly written (free them, never cache them).
        """
        graphs = self.graphs
        if graphs is not None and (graph := graphs.select(inputs)) is not None:
            return graphs.run(graph, inputs)
        return self.run_model(self.prepare(inputs), should_stop)

    def prepare(self, inputs: Sequence[StepInput]) -> StepBatch:
        """The flat batch of ``inputs``: generated-token parts first (one-token
        parts leading: the PyTorch attention's decode group), then prompt-token
        parts when the model has prompt projections; padded to the model's row
        buckets when batch invariant. Pure (reads the block tables only).

        Raises:
          RuntimeError: no KV cache was allocated.
          ValueError: an input asks for more logits than it has tokens, or none.
        """
        cache = self.kv_cache
        if cache is None:
            raise RuntimeError("allocate_kv_cache() before run()")
        size = cache.block_size
        roles = self.model.has_prompt_projections
        # Parts of the flat batch: (input, first token, tokens).
        generated: list[tuple[int, int, int]] = []
        prompt: list[tuple[int, int, int]] = []
        for index, item in enumerate(inputs):
            count = len(item.token_ids)
            num_prompt = 0
            if roles and item.prompt_len is not None:
                num_prompt = min(max(item.prompt_len - item.start, 0), count)
            if num_prompt:
                prompt.append((index, 0, num_prompt))
            if num_prompt < count:
                generated.append((index, num_prompt, count - num_prompt))
        parts = sorted(generated, key=lambda part: part[2] != 1) + prompt
        batch = StepBatch(num_generated_rows=(sum(part[2] for part in generated)
                                              if roles else None))
        token_rows: list[list[int]] = [[0] * len(item.token_ids) for item in inputs]
        for index, first, count in parts:
            item = inputs[index]
            blocks = item.block_ids
            start = item.start + first
            end = start + count
            rows = len(batch.token_ids)
            token_rows[index][first:first + count] = range(rows, rows + count)
            batch.token_ids.extend(item.token_ids[first:first + count])
            batch.positions.extend(range(start, end))
            batch.slots.extend(blocks[p // size] * size + p % size for p in range(start, end))
            batch.seqs.append(SeqAttention(start, count, blocks))
        for index, item in enumerate(inputs):
            if item.samples:
                count = len(item.token_ids)
                if not 1 <= item.num_logits <= count:
                    raise ValueError(f"num_logits must be in [1, {count}], "
                                     f"got {item.num_logits}")
                batch.logit_rows.extend(token_rows[index][count - item.num_logits:])
        batch.num_logits = len(batch.logit_rows)
        if self.batch_invariant:
            padded_rows = self.model.padded_rows
            padding = padded_rows(len(batch.token_ids)) - len(batch.token_ids)
            batch.token_ids.extend([0] * padding)
            batch.positions.extend([0] * padding)
            batch.logit_rows.extend([0] * (padded_rows(batch.num_logits) - batch.num_logits))
        return batch

    def run_model(self, batch: StepBatch,
                  should_stop: Callable[[], bool] | None = None) -> torch.Tensor:
        """The forward of a batch from :meth:`prepare` on the chosen attention
        backend; logits ``[batch.num_logits, vocab]`` (see :meth:`run`)."""
        cache = self.kv_cache
        assert cache is not None  # prepare() checked
        device = self.device
        slot_tensor = to_device(batch.slots, device)
        attention: StepAttention
        if self.attention_backend == "native":
            attention = NativeAttentionBatch(cache, batch.seqs, slot_tensor,
                                             self.config.num_heads, self.model.rope)
        elif (specs := self.model.layer_attention) is not None:
            attention = LayerwiseAttention(cache, batch.seqs, slot_tensor, self._group_size,
                                           to_device(batch.positions, device),
                                           specs, self.batch_invariant)
        else:
            attention = AttentionBatch(cache, batch.seqs, slot_tensor, self._group_size,
                                       to_device(batch.positions, device),
                                       self.model.rope, self.batch_invariant)
        logits = self.model(to_device(batch.token_ids, device), attention,
                            to_device(batch.logit_rows, device),
                            batch.num_generated_rows,
                            fused=self.attention_backend == "native", should_stop=should_stop)
        return logits[:batch.num_logits]

    def warm_up(self, num_tokens: int = 16) -> float:
        """Runs a prefill of ``num_tokens`` and one decode step in the first blocks
        (no block is registered; their contents are overwritten later); returns
        seconds taken.

        Raises:
          RuntimeError: no KV cache was allocated.
        """
        cache = self.kv_cache
        if cache is None:
            raise RuntimeError("allocate_kv_cache() before warm_up()")
        began = time.perf_counter()
        blocks = list(range(min(cache.num_blocks, -(-(num_tokens + 1) // cache.block_size))))
        num_tokens = min(num_tokens, len(blocks) * cache.block_size - 1)
        prompt = [i % self.config.vocab_size for i in range(num_tokens)]
        self.run([StepInput(prompt, 0, blocks)])
        self.run([StepInput([0], num_tokens, blocks)])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - began

    def probe_batch_invariance(self) -> list[str]:
        """Checks the batch-invariance rules on this machine for the model's layer
        shapes (see :func:`~services.engine.torch_backend.batch_invariant.probe`);
        empty when they hold."""
        config = self.config
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        shapes = [(q_size + 2 * kv_size, config.hidden_size), (config.hidden_size, q_size),
                  (2 * config.intermediate_size, config.hidden_size),
                  (config.hidden_size, config.intermediate_size)]
        model = self.model
        if model.quantization == "none":
            return probe(shapes, config.head_dim, device=self.device.type, dtype=self.dtype)
        layer = model.layers[0]
        names = ("qkv", "o", "gate_up", "down")
        projections = [(f"{model.quantization} {name}", p) for name, p in
                       zip(names, layer.projections, strict=True)]
        projections.append(("lm_head", model.head))
        failures = probe([], config.head_dim, device=self.device.type, dtype=self.dtype,
                         projections=projections, padded_linear_rows=model.padded_rows)
        if layer.prompt_projections is not None:  # one row is computed as two
            prompt = [(f"prompt {name} ({model.prompt_kernel})", p) for name, p in
                      zip(names, layer.prompt_projections, strict=True)]
            failures += probe([], config.head_dim, device=self.device.type, dtype=self.dtype,
                              projections=prompt, padded_linear_rows=prompt_rows)
        return failures


def _checked_device(dtype: str, device: str) -> torch.device:
    """``device`` parsed, after refusing an unknown ``dtype`` name (ValueError)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return torch.device(device)


def _check_options(quantization: str, dtype: str, device: torch.device,
                   attention_backend: str, quant_kernel: str) -> None:
    """The loaders' shared refusals (ValueError): a quantization that contradicts
    dtype or device, an attention backend or quantized kernel that cannot run."""
    check_mode(quantization, DTYPES[dtype], device)
    resolve_attention_backend(attention_backend, device, DTYPES[dtype])
    if quantization != "none":
        resolve_quant_kernel(quant_kernel)


def _add_dense_prefill(model: LlamaModel, dense_prefill: bool | None) -> None:
    """Gives a quantized ``model`` dense bf16 prompt projections when
    ``dense_prefill`` says so (None, auto: where its quantized kernels are
    PyTorch's)."""
    if model.quantization == "none":
        return
    if dense_prefill is None:
        dense_prefill = model.quant_kernel == "torch"
    if dense_prefill:
        model.add_prompt_projections()
