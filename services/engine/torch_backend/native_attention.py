"""The engine's paged attention kernel (``kernels/paged_attention.c``), built on first use.

One C call per layer and step writes the step's new keys/values into their
slots and attends every query row over its own sequence's blocks, in place of
the PyTorch path of :mod:`~services.engine.torch_backend.paged_kv` (~12 padded
tensor ops per layer, a gathered copy of each sequence's blocks, and a
chunked value sum kept in key order by a ``cumsum``). Each row's arithmetic
depends only on its own query and keys in a fixed order, so it is
batch-invariant without padding (the C file says how); a 512-token prefill
spends ~40x less time in attention than the PyTorch path (docs/engine.md).

Build: the C compiler (``$CC``, else ``cc``) compiles the source with
``-O3 -march=native -fopenmp`` into ``$LLMESH_KERNEL_CACHE`` (default
``~/.cache/llmesh/kernels``), keyed by a hash of the source, the flags, the
compiler's version and the CPU's flags, under a file lock (engines that start
together build once) and renamed into place (never half written). The
library links ``libgomp.so.1``: the process already has PyTorch's copy loaded,
so the kernel's threads are PyTorch's own OpenMP pool. fp32 on CPU only.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from services.engine.torch_backend.paged_kv import PagedKVCache, SeqAttention

SOURCE = Path(__file__).with_name("kernels") / "paged_attention.c"
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
#: Return codes of ``llmesh_paged_attention``.
_ERRORS = {-1: "head_dim must be in [1, 256]",
           -2: "at most 32 query heads per KV head", -3: "out of memory"}


class NativeKernelUnavailable(RuntimeError):
    """The kernel cannot be built or loaded here (the message says why)."""


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


def cache_dir() -> Path:
    """Where built kernels are kept: ``$LLMESH_KERNEL_CACHE`` or ``~/.cache/llmesh/kernels``."""
    configured = os.environ.get("LLMESH_KERNEL_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "llmesh" / "kernels"


def _compiler() -> str:
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        raise NativeKernelUnavailable(
            f"no C compiler {compiler!r} on PATH (apt-get install gcc, or set CC)")
    return compiler


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def library_path() -> Path:
    """The built library's path for this source, compiler and CPU (may not exist yet).

    Raises:
      NativeKernelUnavailable: no C compiler.
    """
    compiler = _compiler()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             check=False).stdout
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(CFLAGS).encode(), version.encode(),
                 _cpu_flags().encode()):
        digest.update(part)
    return cache_dir() / f"paged_attention-{digest.hexdigest()[:16]}.so"


@functools.lru_cache(maxsize=1)
def load_library() -> ctypes.CDLL:
    """Builds the kernel if this machine has no build of it yet, loads it (once
    per process) and returns it.

    Raises:
      NativeKernelUnavailable: not on Linux, no compiler, the build failed
        (with the compiler's message) or the library does not load.
    """
    if os.name != "posix":
        raise NativeKernelUnavailable("the native attention kernel builds on Linux only")
    target = library_path()
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not target.exists():
                _build(target)
    torch.ones(1).add_(1)  # make sure PyTorch's libgomp is loaded first
    try:
        library = ctypes.CDLL(str(target))
    except OSError as exc:
        raise NativeKernelUnavailable(f"cannot load {target}: {exc}") from exc
    function = library.llmesh_paged_attention
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.POINTER(StepPlan)] + [ctypes.c_void_p] * 4
    return library


def _build(target: Path) -> None:
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        output = Path(scratch) / target.name
        result = subprocess.run([_compiler(), *CFLAGS, "-o", str(output), str(SOURCE)],
                                capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise NativeKernelUnavailable(
                f"building {SOURCE.name} failed: {result.stderr.strip()[-2000:]}")
        os.replace(output, target)


#: Largest head_dim and query heads per KV head the kernel takes.
MAX_HEAD_DIM = 256
MAX_GROUP = 32


def unavailable_reason(device: torch.device, dtype: torch.dtype, head_dim: int = 64,
                       group_size: int = 1) -> str | None:
    """Why the kernel cannot serve ``device``/``dtype`` and a model of ``head_dim``
    with ``group_size`` query heads per KV head here, or None when it can
    (builds it on first call)."""
    if device.type != "cpu" or dtype != torch.float32:
        return f"the native attention kernel is fp32 on CPU only (got {dtype} on {device})"
    if not 1 <= head_dim <= MAX_HEAD_DIM or not 1 <= group_size <= MAX_GROUP:
        return (f"the native attention kernel takes head_dim <= {MAX_HEAD_DIM} and <= "
                f"{MAX_GROUP} query heads per KV head (got {head_dim} and {group_size})")
    try:
        load_library()
    except NativeKernelUnavailable as exc:
        return str(exc)
    return None


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
      NativeKernelUnavailable: see :func:`load_library`.
      ValueError: a sequence reaches past the RoPE tables, or the cache's keys
        are not transposed.
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
        if seqs and max(s.start + s.num_tokens for s in seqs) > cos.shape[0]:
            raise ValueError(f"a position is past the RoPE tables ({cos.shape[0]} positions)")
        self._keep = [cos, sin_signed, slots.to(torch.int64).contiguous()]
        self._keep += [torch.tensor(values or [0], dtype=torch.int64)
                       for values in (first_rows, counts, starts, tables, table_ids)]
        if not cache.transposed_keys:
            raise ValueError("the native kernel needs the transposed key layout "
                             "(PagedKVCache(..., transposed_keys=True))")
        kv_heads, num_blocks, block_size, head_dim = cache.v.shape[1:]
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
                or out_dtype not in (torch.float32, torch.bfloat16)):
            raise RuntimeError(f"paged attention kernel: qkv must be contiguous fp32/bf16 "
                               f"[rows, {self._width}] and out fp32/bf16, got {qkv.dtype} "
                               f"{tuple(qkv.shape)} -> {out_dtype}")
        out = self._out.get(out_dtype)
        if out is None:  # padding rows stay zero
            out = self._out[out_dtype] = qkv.new_zeros(
                qkv.shape[0], self.num_heads * self.head_dim, dtype=out_dtype)
        plan = self._plan
        plan.qkv_bf16 = qkv.dtype == torch.bfloat16
        plan.out_bf16 = out_dtype == torch.bfloat16
        plan.scale = scale
        offset = layer * self._layer_bytes
        status = self._function(ctypes.byref(plan), qkv.data_ptr(),
                                self.cache.k.data_ptr() + offset,
                                self.cache.v.data_ptr() + offset, out.data_ptr())
        if status != 0:
            raise RuntimeError(f"paged attention kernel: {_ERRORS.get(status, status)}")
        return out
