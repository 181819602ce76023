"""Host → device transfers of a step's small index tensors without a host sync.

On CUDA a copy from pageable host memory waits for the stream (the host stalls
until the GPU has drained its queue; ``torch.cuda.set_sync_debug_mode`` flags
it), so step inputs are staged in pinned memory and copied with
``non_blocking=True`` (PyTorch docs: "Tensor.pin_memory", "non_blocking";
the caching host allocator keeps a pinned block until the copy that reads it
has run). On the CPU it is plain ``torch.tensor``: no change, no cost.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.engine.host_memory import available_host_memory_bytes


def to_device(values: Sequence[int] | Sequence[float], device: torch.device,
              dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``values`` as a 1-D tensor on ``device``: ``torch.tensor`` on the CPU (and
    any device but CUDA); on CUDA staged in pinned host memory and copied with
    ``non_blocking=True``, so the host does not wait for the GPU (a copy from
    pageable memory synchronizes the stream: ``torch.cuda.set_sync_debug_mode``
    reports it). The caching host allocator keeps the pinned block until the
    copy has run (PyTorch docs, "pin_memory" / "non_blocking")."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def check_device(device: str) -> None:
    """Rejects a device this process cannot use, before anything loads.

    Raises:
      ValueError: an unparsable device string; ``cuda`` where PyTorch sees no
        CUDA device (a CPU-only build, or no GPU / driver), or a CUDA index
        beyond the devices present.
    """
    try:
        parsed = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"--device {device!r}: {err}") from None
    if parsed.type != "cuda":
        return
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        raise ValueError(f"--device {device}: PyTorch {torch.__version__} ({build}) sees no "
                         "CUDA device; use --device cpu or run on a machine with a GPU")
    count = torch.cuda.device_count()
    if parsed.index is not None and parsed.index >= count:
        raise ValueError(f"--device {device}: only {count} CUDA device(s) here "
                         f"(cuda:0..cuda:{count - 1})")


def check_kv_budget(budget_bytes: int, free_bytes: int, fraction: float) -> None:
    """On a GPU the KV cache is ``--kv-cache-bytes`` as on the CPU; this refuses
    a budget above ``fraction`` (``--gpu-memory-fraction``) of the device
    memory free after the weights loaded, so a start fails at once with the
    numbers instead of running out of memory while capturing graphs or
    serving (the rest holds activations and the graph pool).

    Raises:
      ValueError: the budget does not fit (the message says the largest that does).
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"--gpu-memory-fraction must be in (0, 1], got {fraction}")
    limit = int(free_bytes * fraction)
    if budget_bytes > limit:
        raise ValueError(f"--kv-cache-bytes {budget_bytes} exceeds {fraction:g} of the "
                         f"{free_bytes} bytes of GPU memory free after loading the model; "
                         f"use at most {limit} (or raise --gpu-memory-fraction)")


def check_host_kv_budget(budget_bytes: int) -> None:
    """On the CPU the KV cache is host memory, zero-filled at start: a budget
    above the host's available memory (``MemAvailable``) would push the host
    into swap or get the engine killed for memory while it starts; this
    refuses it first, with the numbers.

    Raises:
      ValueError: the budget does not fit (the message says what is available).
    """
    available = available_host_memory_bytes()
    if available is not None and budget_bytes > available:
        raise ValueError(f"--kv-cache-bytes {budget_bytes} exceeds the {available} bytes of "
                         f"memory available on this host (MemAvailable); use less")
