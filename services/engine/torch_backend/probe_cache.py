"""A disk cache of the start-up batch-invariance probe's verdict.

:meth:`~services.engine.torch_backend.model_runner.ModelRunner.probe_batch_invariance`
runs each of the model's layer-0 projections and its LM head on 1..39 rows
against a 41-row reference (:func:`~services.engine.torch_backend.batch_invariant.probe`):
~1,600 rows through a 49,152 x 576 LM head for SmolLM2: 0.6 s of every engine
start on this 2-core machine at load 2.8, 9.7 s at load 8, before the first request,
for a verdict that only the kernels decide. The verdict is a property of the
arithmetic, not of the weights: which kernel computes each projection, its
shapes and dtypes, the code that lays the rows out, the CPU, the thread count
and the PyTorch build. So it is saved once per such key and read back by every
later start of the same engine on the same machine (a test suite starts ~30).

Key (:func:`probe_key`): SHA-256 of the engine's own code (every
``torch_backend/*.py`` and ``kernels/*`` file), the native library's name
(itself keyed by the sources, flags, compiler and CPU flags), the PyTorch
version, the CPU's model name and flags, ``ONEDNN_MAX_CPU_ISA`` and
``ONEDNN_DEFAULT_FPMATH_MODE``, the intra-op thread count, the device (on CUDA
the GPU's name, compute capability and CUDA version), the dtype, and each
probed projection's kernel, shape and input dtype. Any change to one of them
probes again. Location: ``$LLMESH_PROBE_CACHE``, else
``$XDG_CACHE_HOME/llmesh/probe`` (``~/.cache`` without it), one JSON file per
key written to a temporary file and renamed into place. A cache that cannot be
read or written is skipped (the probe runs as without it);
``LLMESH_PROBE_CACHE=off`` turns it off.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from services.common.cache_dir import cache_dir
from services.engine.torch_backend import native
from services.engine.torch_backend.model import LlamaModel

log = structlog.get_logger(__name__)

CACHE_DIR_ENV = "LLMESH_PROBE_CACHE"
#: Bumped when what is saved or how it is keyed changes.
FORMAT = "1"
#: Environment variables that change which kernels PyTorch's oneDNN picks.
ONEDNN_ENV = ("ONEDNN_MAX_CPU_ISA", "ONEDNN_DEFAULT_FPMATH_MODE")
_PACKAGE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class ProbeVerdict:
    """What the probe found (``failures``: one message per violated case, empty
    when the rules hold) and whether it was read from the cache."""

    failures: list[str]
    cached: bool


def cache_root() -> Path | None:
    """The cache folder, or None when ``$LLMESH_PROBE_CACHE`` is ``off``."""
    return cache_dir(CACHE_DIR_ENV, "probe")


def _describe(projection: object) -> str:
    """A projection's kernel class, shape and input dtype (and those of the
    projections it wraps, e.g. ``Int8LMHead``'s ranking and dense parts)."""
    parts = [type(projection).__name__,
             f"{getattr(projection, 'out_features', '?')}x{getattr(projection, 'in_features', '?')}",
             str(getattr(projection, "input_dtype", ""))]
    kernel = getattr(projection, "kernel", None)
    if kernel is not None:
        parts.append(getattr(kernel, "__qualname__", type(kernel).__name__))
    for inner in ("ranking", "dense"):
        if getattr(projection, inner, None) is not None:
            parts.append(f"{inner}=({_describe(getattr(projection, inner))})")
    return " ".join(parts)


def _code_digest() -> str:
    """SHA-256 of the engine's Python modules and kernel sources."""
    digest = hashlib.sha256()
    for path in sorted([*_PACKAGE.glob("*.py"), *(_PACKAGE / "kernels").glob("*")]):
        if path.is_file():
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line
    return platform.processor()


def _native_library() -> str:
    try:
        return native.library_path().name
    except native.NativeKernelUnavailable as error:
        return f"unavailable: {error}"


def _accelerator(device: torch.device) -> str:
    """The GPU's name, compute capability and CUDA version on CUDA (cuBLAS picks
    kernels per GPU); empty on the CPU."""
    if device.type != "cuda":
        return ""
    return (f"{torch.cuda.get_device_name(device)} "
            f"sm_{''.join(map(str, torch.cuda.get_device_capability(device)))} "
            f"cuda {torch.version.cuda}")


def probe_key(model: LlamaModel, device: torch.device, dtype: torch.dtype) -> str:
    """Hex SHA-256 of what decides the probe's verdict for ``model`` run on
    ``device`` in ``dtype`` with the current thread count (see the module doc)."""
    config = model.config
    layer = model.layers[0]
    projections = [*layer.projections, *(layer.prompt_projections or ()), model.head]
    parts = [FORMAT, _code_digest(), _native_library(), torch.__version__,
             _cpu_model(), native._cpu_flags(),
             *(f"{name}={os.environ.get(name, '')}" for name in ONEDNN_ENV),
             f"threads={torch.get_num_threads()}", str(device), _accelerator(device), str(dtype),
             f"quantization={model.quantization} quant_kernel={model.quant_kernel} "
             f"prompt_kernel={model.prompt_kernel}",
             f"head_dim={config.head_dim} hidden={config.hidden_size} "
             f"heads={config.num_heads}/{config.num_kv_heads} "
             f"intermediate={config.intermediate_size} vocab={config.vocab_size}",
             *(_describe(p) for p in projections)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def cached_probe(model: LlamaModel, device: torch.device, dtype: torch.dtype,
                 run_probe: Callable[[], list[str]]) -> ProbeVerdict:
    """The verdict for ``model``: from the cache when an entry exists, else
    ``run_probe()`` (and the verdict saved for the next start).

    Raises:
      whatever ``run_probe`` raises; cache trouble (unreadable, full disk) is
      logged and skipped, never raised.
    """
    root = cache_root()
    if root is None:
        return ProbeVerdict(run_probe(), cached=False)
    entry = root / f"{probe_key(model, device, dtype)}.json"
    try:
        failures = json.loads(entry.read_text(encoding="utf-8"))["failures"]
        if isinstance(failures, list) and all(isinstance(f, str) for f in failures):
            return ProbeVerdict(failures, cached=True)
        raise ValueError("failures is not a list of strings")
    except FileNotFoundError:
        pass  # a miss: the first start for this key (new code, machine or shapes)
    except (OSError, ValueError, KeyError, TypeError) as error:  # a damaged entry
        log.warning("probe_cache_unreadable", entry=str(entry),
                    error=f"{type(error).__name__}: {error}")
    failures = run_probe()
    _save(entry, failures)
    return ProbeVerdict(failures, cached=False)


def _save(entry: Path, failures: list[str]) -> None:
    """The verdict as JSON in a temporary file beside ``entry``, then a rename;
    a failure leaves no entry."""
    staging: str | None = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        handle, staging = tempfile.mkstemp(prefix=f".{entry.stem}.", dir=entry.parent)
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            json.dump({"failures": failures}, out)
        os.replace(staging, entry)
        staging = None
    except OSError as error:
        log.warning("probe_cache_not_written", entry=str(entry), error=str(error))
    finally:
        if staging is not None:
            with contextlib.suppress(OSError):
                os.unlink(staging)
