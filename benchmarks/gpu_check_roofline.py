"""The batch-1 decode roofline of the GPU check: weight bytes / copy bandwidth.

A decode step at batch 1 reads every weight it multiplies by once, so its time
is at least ``weight bytes / memory bandwidth``. The bandwidth is measured as
a device-to-device copy through PyTorch (``dst.copy_(src)`` of a buffer far
larger than the caches), counting the bytes read and the bytes written, as
vendors and KINDS.md quote it (about 4.3 TB/s on an H200). On CPU (the dry
run) the same copy runs in host memory.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

#: Largest measured/roofline TPOT ratio the check accepts at batch 1 (issue 17).
TARGET_RATIO = 1.5


def measure_copy_bandwidth(device: str, size_bytes: int, repeats: int = 10,
                           warmups: int = 3) -> dict[str, Any]:
    """Copy bandwidth of ``device`` in bytes/s (read + written), best of ``repeats``.

    Args:
      device: ``cuda``, ``cuda:N`` or ``cpu``.
      size_bytes: size of the source buffer (the destination is as large).
      repeats: timed copies; ``warmups`` untimed ones come first.

    Raises:
      ValueError: ``size_bytes`` < 1 MiB or ``repeats`` < 1.
    """
    import torch

    if size_bytes < (1 << 20) or repeats < 1:
        raise ValueError("size_bytes must be >= 1 MiB and repeats >= 1")
    numel = size_bytes // 4
    src = torch.ones(numel, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    cuda = src.device.type == "cuda"
    for _ in range(warmups):
        dst.copy_(src)
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - began)
    moved = 2 * numel * 4
    del src, dst
    if cuda:
        torch.cuda.empty_cache()
    return {"method": "torch copy_ (bytes read + written)", "device": device,
            "buffer_bytes": numel * 4, "repeats": repeats, "best_s": min(times),
            "median_s": statistics.median(times), "bytes_per_s": moved / min(times),
            "median_bytes_per_s": moved / statistics.median(times)}


def roofline(weight_bytes: int, bandwidth_bytes_per_s: float, measured_tpot_ms: float | None,
             target_ratio: float = TARGET_RATIO) -> dict[str, Any]:
    """The batch-1 roofline TPOT and how a measured TPOT compares.

    Args:
      weight_bytes: bytes one decode step reads (``decode_weight_bytes``).
      bandwidth_bytes_per_s: measured memory bandwidth.
      measured_tpot_ms: median TPOT of one stream (ms), or None when not measured.
      target_ratio: the largest accepted measured / roofline ratio.

    Returns:
      ``roofline_tpot_ms`` (= weight_bytes / bandwidth, in ms),
      ``roofline_tok_s``, ``measured_tpot_ms``, ``ratio`` (measured /
      roofline; None without a measurement), ``target_ratio`` and ``pass``
      (ratio <= target; None without a measurement).

    Raises:
      ValueError: ``weight_bytes`` or ``bandwidth_bytes_per_s`` is not positive.
    """
    if weight_bytes <= 0 or not bandwidth_bytes_per_s > 0:
        raise ValueError("weight_bytes and bandwidth_bytes_per_s must be positive")
    roofline_s = weight_bytes / bandwidth_bytes_per_s
    ratio = None if measured_tpot_ms is None else measured_tpot_ms / (roofline_s * 1e3)
    return {"weight_bytes": weight_bytes, "bandwidth_bytes_per_s": bandwidth_bytes_per_s,
            "roofline_tpot_ms": roofline_s * 1e3, "roofline_tok_s": 1.0 / roofline_s,
            "measured_tpot_ms": measured_tpot_ms, "ratio": ratio,
            "target_ratio": target_ratio,
            "pass": None if ratio is None else ratio <= target_ratio}
