"""The torch backend's start-up refusals, importing no torch.

An engine start refused for a bad flag or a broken ``--model-path`` answers
in one line before anything heavy loads: this module resolves ``auto``
options and checks names, values and model files from strings, the GGUF
header and ``config.json`` (``python -m services.engine`` runs
:func:`check_config` then :func:`check_model_files` before it imports the
backend; :class:`~services.engine.torch_backend.backend.TorchBackend` runs
the same checks when it is built in process). torch is imported only by a
check that needs it: a device other than the CPU (is CUDA there?),
``--attention-backend native`` and ``--quant-kernel native`` (do the C
kernels build?), a model given in process.
"""

from __future__ import annotations

import os
import re
from dataclasses import replace
from typing import TYPE_CHECKING

from services.common.checkpoint import check_model_path, gguf_architecture
from services.common.cli_args import env_refusal
from services.common.model_files import MODEL_PATH_ENV, default_model_path
from services.common.sampling import SpeculativeMethod
from services.engine.config import EngineConfig
from services.engine.torch_backend.hf_config import read_hf_config
from services.engine.torch_backend.spec_options import SpeculativeConfig, SuffixOptions

if TYPE_CHECKING:
    from services.engine.torch_backend.model import LlamaModel

#: ``--dtype`` choices besides ``auto`` (torch dtype names).
DTYPE_NAMES = ("float32", "bfloat16", "float16")
#: ``--attention-backend`` choices: ``native`` is the C kernel
#: (:mod:`~services.engine.torch_backend.native_attention`, fp32 on CPU),
#: ``torch`` the PyTorch ops of :mod:`~services.engine.torch_backend.paged_kv`,
#: ``auto`` the native kernel where it builds and serves the device/dtype.
ATTENTION_BACKENDS = ("auto", "native", "torch")
#: ``--quant-kernel`` choices: ``native`` is
#: :class:`~services.engine.torch_backend.quant.NativeInt4Projection` (the engine's C
#: kernel, built on first use), ``torch``
#: :class:`~services.engine.torch_backend.quant.Int4Projection`, ``auto`` the native
#: kernel where it builds.
QUANT_KERNELS = ("auto", "native", "torch")
#: The ``--quantization`` choices.
QUANTIZATIONS = ("none", "int8", "int4")

_CPU_DEVICE = re.compile(r"cpu(:\d+)?")


def device_type(device: str) -> str:
    """``torch.device(device).type``: ``cpu`` for ``cpu`` / ``cpu:N`` without
    importing torch, else parsed by torch.

    Raises:
      ValueError: a string torch cannot parse (e.g. ``gpu``).
    """
    if _CPU_DEVICE.fullmatch(device):
        return "cpu"
    import torch

    try:
        return torch.device(device).type
    except RuntimeError as err:
        raise ValueError(f"--device {device!r}: {err}") from None


def auto_quantization(architecture: str, dtype: str, device: str) -> str:
    """What ``--quantization auto`` means for a model (``dtype`` a name of
    :data:`DTYPE_NAMES`, ``device`` a device type): ``int4`` for a Llama GGUF
    in float32 on the CPU (its Q4_1 blocks as they are: the fastest mode that
    passes the quality guard), ``none`` otherwise (the quantized kernels are
    CPU fp32 ones; other architectures' K-quants would be requantized, which
    is not quality-checked)."""
    if architecture == "llama" and dtype == "float32" and device == "cpu":
        return "int4"
    return "none"


def check_quantization(quantization: str, dtype: str, device: str) -> None:
    """Rejects a quantization that contradicts ``dtype`` (a torch dtype name)
    or ``device`` (a device string).

    Raises:
      ValueError: an unknown mode; a quantized mode off the CPU (checked first)
        (the ``*_for_cpu`` kernels); or a quantized mode with a dtype other
        than float32 (the quantized modes run their projections in bf16 and
        keep the residual stream, norms and attention in fp32: ``--dtype``
        float32, the CPU's ``auto``).
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    if quantization == "none":
        return
    if device_type(device) != "cpu":
        raise ValueError(f"--quantization {quantization} uses PyTorch's CPU kernels; "
                         f"use --quantization none on {device}")
    if dtype != "float32":
        raise ValueError(f"--quantization {quantization} runs bf16 projections on an fp32 "
                         f"residual stream; leave --dtype at float32 (got torch.{dtype})")


def resolve_dtype(config: EngineConfig, model: LlamaModel | None = None) -> EngineConfig:
    """``--dtype auto`` made concrete: the given model's dtype; else float32 on
    the CPU (what the quantized kernels' fp32 residual stream needs) and
    bfloat16 on any other device. Other values pass through."""
    if config.dtype != "auto":
        return config
    if model is not None:
        return replace(config, dtype=str(model.embed_tokens.dtype).removeprefix("torch."))
    return replace(config, dtype="float32" if device_type(config.device) == "cpu"
                   else "bfloat16")


def resolve_quantization(config: EngineConfig, model: LlamaModel | None = None) -> EngineConfig:
    """``config`` with ``quantization: auto`` made concrete: the given model's
    mode; ``none`` for a Hugging Face checkpoint directory (dense weights in
    ``dtype``: requantizing them is not quality-checked; ask for ``int8`` /
    ``int4`` explicitly on CPU fp32); else :func:`auto_quantization` of the
    GGUF's architecture (read from its header). A missing or unreadable file
    resolves as a Llama one and fails when it loads.
    """
    if config.quantization != "auto":
        return config
    if model is not None:
        return replace(config, quantization=model.quantization)
    path = config.model_path or default_model_path()
    if path.is_dir():  # a Hugging Face checkpoint: dense weights, no Q4_1 blocks to keep
        return replace(config, quantization="none")
    try:
        architecture = gguf_architecture(path)
    except (FileNotFoundError, ValueError):
        architecture = "llama"
    dtype = config.dtype if config.dtype in DTYPE_NAMES else "float32"
    return replace(config, quantization=auto_quantization(architecture, dtype,
                                                          device_type(config.device)))


def check_config(config: EngineConfig) -> None:
    """Rejects options this backend cannot start with, before any file is read or
    port bound (rules that need the model, such as ``draft_num_layers`` against
    its depth, are checked when it loads).

    Raises:
      ValueError: an unknown dtype; a device PyTorch cannot use here
        (:func:`~services.engine.torch_backend.device.check_device`); a quantization that
        contradicts dtype or device (:func:`check_quantization`); an unknown
        attention backend or quantized kernel, or ``native`` where the
        kernels cannot serve the device/dtype or cannot be built (the model's
        head shapes are checked when it loads); bad speculative options
        (:class:`SpeculativeConfig`, :class:`SuffixOptions`); a second KV
        tier without its size or without prefix caching
        (:func:`check_kv_offload`); a structured-output compile timeout <= 0.
    """
    config = resolve_dtype(config)
    if config.dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_NAMES)} or auto, "
                         f"got {config.dtype!r}")
    config = resolve_quantization(config)  # auto: what the model's file makes it
    check_quantization(config.quantization, config.dtype, config.device)
    if config.attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, "
                         f"got {config.attention_backend!r}")
    if config.attention_backend == "native":  # builds the kernels now if it must
        _check_native_attention(config)
    if config.quant_kernel not in QUANT_KERNELS:
        raise ValueError(f"quant kernel must be one of {QUANT_KERNELS}, "
                         f"got {config.quant_kernel!r}")
    if config.quantization != "none" and config.quant_kernel == "native":
        from services.engine.torch_backend.quant import resolve_quant_kernel

        resolve_quant_kernel("native")  # builds the kernels now if it must
    speculative_config(config)
    suffix_options(config)
    check_kv_offload(config)
    if not config.structured_output_compile_timeout_s > 0:
        raise ValueError("structured_output_compile_timeout_s must be > 0, got "
                         f"{config.structured_output_compile_timeout_s}")
    if device_type(config.device) != "cpu":  # last: a contradiction in the flags is named first
        from services.engine.torch_backend.device import check_device

        check_device(config.device)


def check_kv_offload(config: EngineConfig) -> None:
    """Rejects second-KV-tier flags that do not go together (the tier's
    memory itself is checked when it is allocated).

    Raises:
      ValueError: ``--kv-offload-dir`` without ``--kv-offload-bytes`` (the
        tier's size); ``--kv-offload-bytes`` with prefix caching off (the
        tier keeps evicted prefix-cache blocks); a ``--kv-offload-dir`` that
        is not a writable directory, or whose file system has less free space
        than ``--kv-offload-bytes`` (the tier's file is allocated in full).
    """
    if config.kv_offload_bytes is None:
        if config.kv_offload_dir is not None:
            raise ValueError("--kv-offload-dir needs --kv-offload-bytes (the tier's size)")
        return
    if not config.enable_prefix_caching:
        raise ValueError("--kv-offload-bytes needs prefix caching (--enable-prefix-caching)")
    if config.kv_offload_dir is not None:
        _check_offload_dir(str(config.kv_offload_dir), config.kv_offload_bytes)


def _check_offload_dir(directory: str, nbytes: int) -> None:
    """The disk-backed tier's directory can take its ``nbytes`` file (ValueError saying why not)."""
    if not os.path.isdir(directory):
        why = "not a directory" if os.path.exists(directory) else "no such directory"
        raise ValueError(f"--kv-offload-dir {directory}: {why}")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(f"--kv-offload-dir {directory}: not writable by this user")
    stats = os.statvfs(directory)
    free = stats.f_bavail * stats.f_frsize
    if free < nbytes:
        raise ValueError(f"--kv-offload-dir {directory}: {free} bytes free, the tier "
                         f"(--kv-offload-bytes) needs {nbytes}")


def _check_native_attention(config: EngineConfig) -> None:
    """``--attention-backend native``: the kernel serves the device and dtype
    and builds (ValueError saying why not)."""
    import torch

    from services.engine.torch_backend.model_runner import DTYPES, resolve_attention_backend

    resolve_attention_backend("native", torch.device(config.device), DTYPES[config.dtype])


def check_model_files(config: EngineConfig) -> None:
    """Checks the model (and draft model) path without reading weights: a
    GGUF file, or a checkpoint directory whose ``config.json`` the loader
    accepts (:func:`~services.engine.torch_backend.hf_config.read_hf_config`)
    and whose safetensors files are there.

    Raises:
      FileNotFoundError, ValueError: see
        :func:`~services.common.checkpoint.check_model_path`, led by
        ``LLMESH_MODEL_PATH='...'`` when the model path came from there; the
        default model's package is not installed.
    """
    override = os.environ.get(MODEL_PATH_ENV)
    if config.model_path is None and override:
        try:
            _check_model_file(default_model_path())
        except (FileNotFoundError, ValueError) as error:
            raise type(error)(env_refusal(MODEL_PATH_ENV, override, error)) from None
    else:
        _check_model_file(config.model_path or default_model_path())
    if config.draft_model_path is not None:
        _check_model_file(config.draft_model_path)


def _check_model_file(path: Path) -> None:
    """One model path: there; a GGUF, or config.json + safetensors files
    whose architecture and fields the loader reads (JSON only)."""
    check_model_path(path)
    if path.is_dir():
        read_hf_config(path)


def speculative_config(config: EngineConfig) -> SpeculativeConfig:
    """The engine defaults of speculative decoding in ``config``.

    Raises:
      ValueError: ``eagle3`` or ``mtp`` (the tensorrt_llm backend's only); see
        :class:`SpeculativeConfig`.
    """
    method = config.resolved_speculative_method()
    if method in ("eagle3", "mtp"):
        raise ValueError(f"--speculative-method {method} is implemented by "
                         "the tensorrt_llm backend only; the torch backend offers suffix (its "
                         "default, auto), ngram, draft and none")
    return SpeculativeConfig(
        method=SpeculativeMethod.parse(method),
        num_speculative_tokens=config.num_speculative_tokens, ngram_min=config.ngram_min,
        ngram_full_len=config.ngram_full_len,
        ngram_max=config.ngram_max, disable_batch_size=config.speculative_disable_batch_size,
        suffix_num_speculative_tokens=config.suffix_num_speculative_tokens,
        cost_model=config.speculative_cost_model)


def suffix_options(config: EngineConfig) -> SuffixOptions:
    """The suffix decoding settings in ``config``.

    Raises:
      ValueError: see :class:`SuffixOptions`.
    """
    return SuffixOptions(max_match=config.suffix_max_match,
                         spec_factor=config.suffix_spec_factor,
                         min_token_prob=config.suffix_min_token_prob,
                         cache_tokens=config.suffix_cache_tokens,
                         scope=config.suffix_cache_scope)
