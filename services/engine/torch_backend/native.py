"""The engine's native CPU kernels (``kernels/*.c``): built on first use, loaded once.

* ``paged_attention.c``: RoPE, the KV write and batch-invariant paged attention
  in one call per layer (used by
  :class:`~services.engine.torch_backend.native_attention.NativeAttentionBatch`).
* ``int_matmul.c``: Q4_1 or int8 weights x activations quantized to int16,
  exact integer dot products on AVX512-VNNI or AVX2 (:func:`q4_1_matmul`,
  :func:`q8_matmul`; the quantized projections and LM head of
  ``--quant-kernel native``, see :mod:`~services.engine.torch_backend.quant`).
* ``fused_ops.c``: the residual add with RMSNorm and the cast to the next
  projection's input dtype (:func:`add_rms_norm`), and SiLU(gate) * up
  (:func:`silu_mul`), one call each instead of three to five PyTorch ops.

Build: the C compiler (``$CC``, else ``cc``) compiles the sources together
with ``-O3 -march=native -fopenmp`` into ``$LLMESH_KERNEL_CACHE`` (default
``~/.cache/llmesh/kernels``), keyed by a hash of the sources, the flags, the
compiler's version and the CPU's flags, under a file lock (engines that start
together build once) and renamed into place (never half written). The library
links ``libgomp.so.1``: the process already has PyTorch's copy loaded, so the
kernels' threads are PyTorch's own OpenMP pool. fp32 residual stream on CPU only.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

KERNELS = Path(__file__).with_name("kernels")
#: The C sources of the library, compiled together.
SOURCES = (KERNELS / "paged_attention.c", KERNELS / "fused_ops.c", KERNELS / "int_matmul.c")
#: Headers they include (part of the build's cache key).
HEADERS = (KERNELS / "simd.h", KERNELS / "llmesh_kernels.h")
#: ``-ffp-contract=fast`` (GCC's default in GNU C, pinned here) fuses a * b + c
#: into FMA: the bits of a result are those of this build on this CPU; a mesh
#: whose nodes must agree bit for bit needs the same compiler and ISA.
CFLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC",
          "-std=gnu11")
class NativeKernelUnavailable(RuntimeError):
    """The kernel cannot be built or loaded here (the message says why)."""


def cache_dir() -> Path:
    """Where built kernels are kept: ``$LLMESH_KERNEL_CACHE`` or ``~/.cache/llmesh/kernels``."""
    configured = os.environ.get("LLMESH_KERNEL_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "llmesh" / "kernels"


def _compiler() -> list[str]:
    """``$CC`` (may carry arguments, e.g. ``ccache gcc``), else ``cc``, as argv."""
    compiler = shlex.split(os.environ.get("CC", "cc")) or ["cc"]
    if shutil.which(compiler[0]) is None:
        raise NativeKernelUnavailable(
            f"no C compiler {compiler[0]!r} on PATH (apt-get install gcc, or set CC)")
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
    version = subprocess.run([*compiler, "--version"], capture_output=True, text=True,
                             check=False).stdout
    digest = hashlib.sha256()
    for part in (*(path.read_bytes() for path in SOURCES + HEADERS), " ".join(CFLAGS).encode(),
                 " ".join(compiler).encode(), version.encode(), _cpu_flags().encode()):
        digest.update(part)
    return cache_dir() / f"llmesh_kernels-{digest.hexdigest()[:16]}.so"


def load_library() -> ctypes.CDLL:
    """Builds the kernels if this machine has no build of them yet, loads them
    (once per process) and returns the library. A failure is remembered too
    (one build attempt per process; ``load_library.cache_clear()`` forgets).

    Raises:
      NativeKernelUnavailable: not on Linux, no compiler, the cache folder is
        not writable, the build failed (with the compiler's message) or the
        library does not load.
    """
    outcome = _load_once()
    if isinstance(outcome, NativeKernelUnavailable):
        raise NativeKernelUnavailable(str(outcome))
    return outcome


@functools.lru_cache(maxsize=1)
def _load_once() -> ctypes.CDLL | NativeKernelUnavailable:
    try:
        return _load()
    except NativeKernelUnavailable as exc:
        return exc


load_library.cache_clear = _load_once.cache_clear  # type: ignore[attr-defined]


def _load() -> ctypes.CDLL:
    if os.name != "posix":
        raise NativeKernelUnavailable("the native kernels build on Linux only")
    target = library_path()
    if not target.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target.with_suffix(".lock"), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not target.exists():
                    _build(target)
        except OSError as exc:
            raise NativeKernelUnavailable(
                f"cannot build into {target.parent} ({exc}); set LLMESH_KERNEL_CACHE to a "
                f"writable folder") from exc
    torch.ones(1).add_(1)  # make sure PyTorch's libgomp is loaded first
    try:
        library = ctypes.CDLL(str(target))
    except OSError as exc:
        raise NativeKernelUnavailable(f"cannot load {target}: {exc}") from exc
    for name, argtypes in _SIGNATURES.items():
        function = getattr(library, name)
        function.restype = ctypes.c_int
        function.argtypes = argtypes
    return library


def _build(target: Path) -> None:
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        output = Path(scratch) / target.name
        result = subprocess.run([*_compiler(), *CFLAGS, "-o", str(output),
                                 *(str(source) for source in SOURCES)],
                                capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise NativeKernelUnavailable(
                f"building the native kernels failed: {result.stderr.strip()[-2000:]}")
        os.replace(output, target)


_SIGNATURES = {
    # (plan, qkv, k_cache, v_cache, out)
    "llmesh_paged_attention": [ctypes.c_void_p] * 5,
    # (hidden, delta, delta_bf16, weight, rows, n, eps, out, out_bf16, threads)
    "llmesh_add_rms_norm": [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p,
                            ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p,
                            ctypes.c_int32, ctypes.c_int32],
    # (gate_up, in_bf16, rows, n, out, out_bf16, threads)
    "llmesh_silu_mul": [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_int64,
                        ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32],
    # (x, x_bf16, rows, in_features, packed, out_features, out, out_bf16, threads)
    "llmesh_q4_1_matmul": [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_int64,
                           ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int32,
                           ctypes.c_int32],
    # (x, x_bf16, rows, in_features, packed, scales, out_features, out, out_bf16, threads)
    "llmesh_q8_matmul": [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_int64,
                         ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                         ctypes.c_int32, ctypes.c_int32],
    "llmesh_int_matmul_row_chunk": [],
}
_NARROW = (torch.float32, torch.bfloat16)


#: Largest head_dim and query heads per KV head the kernel takes.
MAX_HEAD_DIM = 256
MAX_GROUP = 32


def unavailable_reason(device: torch.device, dtype: torch.dtype, head_dim: int = 64,
                       group_size: float = 1) -> str | None:
    """Why the kernel cannot serve ``device``/``dtype`` and a model of ``head_dim``
    with ``group_size`` query heads per KV head (a whole number: heads divide
    evenly) here, or None when it can (builds it on first call)."""
    if device.type != "cpu" or dtype != torch.float32:
        return f"the native attention kernel is fp32 on CPU only (got {dtype} on {device})"
    if (not 2 <= head_dim <= MAX_HEAD_DIM or head_dim % 2
            or not 1 <= group_size <= MAX_GROUP or group_size != int(group_size)):
        return (f"the native attention kernel takes an even head_dim <= {MAX_HEAD_DIM} and "
                f"1..{MAX_GROUP} query heads per KV head (got {head_dim} and {group_size})")
    try:
        load_library()
    except NativeKernelUnavailable as exc:
        return str(exc)
    return None


def add_rms_norm(hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """``hidden += delta`` in place (the residual add; skipped for None), then
    ``RMSNorm(hidden) * weight`` in ``out_dtype``.

    Args:
      hidden: ``[rows, n]`` fp32, contiguous (updated in place).
      delta: ``[rows, n]`` fp32 or bf16, contiguous, or None.
      weight: ``[n]`` fp32, contiguous.
      eps: RMSNorm's epsilon.
      out_dtype: fp32 or bf16.

    Returns:
      ``[rows, n]`` in ``out_dtype``.

    Raises:
      NativeKernelUnavailable: see :func:`load_library`.
      ValueError: other dtypes, shapes or layouts.
    """
    rows, n = hidden.shape
    if (hidden.dtype != torch.float32 or not hidden.is_contiguous() or weight.shape != (n,)
            or weight.dtype != torch.float32 or not weight.is_contiguous()
            or out_dtype not in _NARROW
            or (delta is not None and (delta.shape != hidden.shape or delta.dtype not in _NARROW
                                       or not delta.is_contiguous()))):
        raise ValueError("add_rms_norm: hidden fp32 [rows, n] contiguous, delta the same shape "
                         "in fp32/bf16, weight fp32 [n], out fp32/bf16")
    out = torch.empty(rows, n, dtype=out_dtype)
    load_library().llmesh_add_rms_norm(
        hidden.data_ptr(), None if delta is None else delta.data_ptr(),
        delta is not None and delta.dtype == torch.bfloat16, weight.data_ptr(),
        rows, n, eps, out.data_ptr(), out_dtype == torch.bfloat16, torch.get_num_threads())
    return out


def silu_mul(gate_up: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """SwiGLU's ``SiLU(gate) * up`` of the fused gate/up projection output.

    Args:
      gate_up: ``[rows, 2 n]`` fp32 or bf16, contiguous (gate, then up).
      out_dtype: fp32 or bf16.

    Returns:
      ``[rows, n]`` in ``out_dtype``.

    Raises:
      NativeKernelUnavailable: see :func:`load_library`.
      ValueError: other dtypes, shapes or layouts.
    """
    rows, width = gate_up.shape
    if (gate_up.dtype not in _NARROW or not gate_up.is_contiguous() or width % 2
            or out_dtype not in _NARROW):
        raise ValueError("silu_mul: gate_up fp32/bf16 [rows, 2 n] contiguous, out fp32/bf16")
    out = torch.empty(rows, width // 2, dtype=out_dtype)
    load_library().llmesh_silu_mul(gate_up.data_ptr(), gate_up.dtype == torch.bfloat16, rows,
                                   width // 2, out.data_ptr(), out_dtype == torch.bfloat16,
                                   torch.get_num_threads())
    return out



#: Output features per tile and inputs per block of the packed layouts
#: (``kernels/int_matmul.c``), and bytes per (tile, block) record: Q4_1 and int8.
Q4_TILE = 16
Q4_BLOCK = 32
Q4_RECORD = 320
Q8_RECORD = 512


class IntMatmul:
    """``x @ W.T`` on the integer-dot kernels (``kernels/int_matmul.c``) for one
    packed weight, checked once here so that each call checks only ``x``.

    Each row of ``x`` is quantized to int16 per 32 inputs; the
    dot products are exact integer sums (AVX512-VNNI, AVX2 or portable C: the
    same bits), so a row's result
    depends only on that row: batch-invariant at any row count.

    Args:
      packed: ``[ceil(out_features / 16), in_features / 32, 320]`` uint8 for
        Q4_1 weights (:func:`~services.engine.torch_backend.quant.pack_q4_1`), or
        ``[..., 512]`` for int8 weights (:func:`~services.engine.torch_backend.quant.pack_int8`).
      out_features: output features (the packed tiles may be zero-padded).
      out_dtype: fp32 or bf16.
      scales: ``[out_features]`` fp32 scales of int8 weights (None for Q4_1).

    Raises:
      NativeKernelUnavailable: see :func:`load_library`.
      ValueError: other dtypes, shapes or layouts.
    """

    def __init__(self, packed: torch.Tensor, out_features: int, out_dtype: torch.dtype,
                 scales: torch.Tensor | None = None) -> None:
        record = Q4_RECORD if scales is None else Q8_RECORD
        if (packed.dtype != torch.uint8 or not packed.is_contiguous() or packed.dim() != 3
                or packed.shape[0] != -(-out_features // Q4_TILE) or packed.shape[1] < 1
                or packed.shape[2] != record or out_dtype not in _NARROW):
            raise ValueError(f"integer matmul: packed uint8 [ceil({out_features} / {Q4_TILE}), "
                             f"in / {Q4_BLOCK}, {record}] contiguous and out fp32/bf16 (got "
                             f"{tuple(packed.shape)} {packed.dtype} -> {out_dtype})")
        if scales is not None and (scales.dtype != torch.float32 or not scales.is_contiguous()
                                   or scales.shape != (out_features,)):
            raise ValueError(f"integer matmul: scales fp32 [{out_features}] contiguous, got "
                             f"{tuple(scales.shape)} {scales.dtype}")
        self.packed, self.scales = packed, scales
        self.in_features = int(packed.shape[1]) * Q4_BLOCK
        self.out_features, self.out_dtype = out_features, out_dtype
        library = load_library()
        self._function = library.llmesh_q4_1_matmul if scales is None else library.llmesh_q8_matmul
        self._weights = ((packed.data_ptr(),) if scales is None
                         else (packed.data_ptr(), scales.data_ptr()))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[rows, in_features]`` fp32 or bf16, contiguous → ``[rows, out_features]``.

        Raises:
          ValueError: another shape, dtype or layout.
          MemoryError: no memory for the quantized activations.
        """
        if (x.dim() != 2 or x.shape[1] != self.in_features or x.dtype not in _NARROW
                or not x.is_contiguous()):
            raise ValueError(f"integer matmul: x fp32/bf16 [rows, {self.in_features}] "
                             f"contiguous, got {tuple(x.shape)} {x.dtype}")
        rows = x.shape[0]
        out = torch.empty(rows, self.out_features, dtype=self.out_dtype)
        code = self._function(x.data_ptr(), x.dtype == torch.bfloat16, rows, self.in_features,
                              *self._weights, self.out_features, out.data_ptr(),
                              self.out_dtype == torch.bfloat16, torch.get_num_threads())
        if code == -3:
            raise MemoryError(f"integer matmul: out of memory for {rows} rows")
        if code != 0:
            raise ValueError(f"integer matmul: the kernel refused the shapes (code {code})")
        return out


def int_matmul_row_chunk() -> int:
    """Rows of one integer matmul call that share each widening of a block's
    weights (``ROW_CHUNK`` of ``int_matmul.c``): a prompt's rows cost their dot
    products, not a weight unpacking per few rows.

    Raises:
      NativeKernelUnavailable: see :func:`load_library`.
    """
    return int(load_library().llmesh_int_matmul_row_chunk())


def q4_1_matmul(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                out_dtype: torch.dtype) -> torch.Tensor:
    """``x @ W.T`` for Q4_1 ``W`` (see :class:`IntMatmul`): ``x`` ``[rows, in]``
    fp32/bf16 contiguous, ``packed`` ``[ceil(out_features / 16), in / 32, 320]``.

    Raises:
      NativeKernelUnavailable, ValueError, MemoryError: see :class:`IntMatmul`.
    """
    return IntMatmul(packed, out_features, out_dtype)(x)


def q8_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """``x @ W.T`` for int8 ``W`` with ``scales`` ``[out_features]`` fp32 (see
    :class:`IntMatmul`): ``packed`` ``[ceil(out_features / 16), in / 32, 512]``.

    Raises:
      NativeKernelUnavailable, ValueError, MemoryError: see :class:`IntMatmul`.
    """
    return IntMatmul(packed, int(scales.shape[0]) if scales.dim() == 1 else -1, out_dtype,
                     scales)(x)
