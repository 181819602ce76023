"""The batch-1 decode roofline of this machine: llmesh's torch engine and llama.cpp (not a test).

    python benchmarks/roofline.py [--threads N] [--size-gib 1] [--repeats 7]
        [--llmesh-tpot-ms MS] [--llama-tpot-ms MS] [--json PATH]

A decode step at batch 1 must read every weight it multiplies by once, so its
time is at least (weight bytes read) / (memory read bandwidth), and one stream
cannot decode faster than ``bandwidth / bytes`` tokens/s. This prints:

* the memory read bandwidth: the best of ``--repeats`` ``torch.sum`` passes
  over a ``--size-gib`` float32 tensor (far larger than the caches), with the
  engine's thread count (``--threads``; default: torch's in a fresh process,
  which the engine keeps: it never sets a thread count);
* llmesh: ``ModelRunner.decode_weight_bytes()`` of a runner loaded as the
  engine loads it (``ModelRunner.from_gguf`` with the engine's default
  ``EngineConfig``, ``LLMESH_ENGINE_*`` variables applied), and the roofline
  tokens/s it gives;
* llama.cpp: the GGUF's tensor data bytes (``gguf`` package; the weights stay
  quantized as stored, and the tied embedding is read whole by the output
  projection), and its roofline tokens/s;
* with ``--llmesh-tpot-ms`` / ``--llama-tpot-ms`` (a measured one-stream
  TPOT), the fraction of the roofline that decode reaches:
  ``(1000 / TPOT) / roofline``.

``--json PATH`` (``-`` for stdout) writes the numbers. The peer benchmark
(``benchmarks/peer_llamacpp.py``) runs this as a subprocess.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[1]),
                str(Path(__file__).resolve().parents[1] / "services" / "gen")]


def measure_read_bandwidth(threads: int, size_gib: float = 1.0, repeats: int = 7) -> dict[str, Any]:
    """Best-of-``repeats`` read bandwidth of a ``torch.sum`` over ``size_gib`` GiB (bytes/s)."""
    import torch

    torch.set_num_threads(threads)
    n = int(size_gib * (1 << 30)) // 4
    data = torch.ones(n, dtype=torch.float32)  # touched: every page is mapped
    data.sum()  # warm
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        total = data.sum()
        times.append(time.perf_counter() - began)
        assert float(total) > 0
    nbytes = n * 4
    del data
    return {"method": "torch.sum float32", "threads": threads, "bytes": nbytes,
            "repeats": repeats, "best_s": min(times), "median_s": sorted(times)[len(times) // 2],
            "bytes_per_s": nbytes / min(times)}


def engine_runner() -> Any:
    """The torch ModelRunner loaded as the engine loads it, with the engine's
    default config (flags' defaults, ``LLMESH_ENGINE_*`` environment applied).

    The config fields are passed to ``ModelRunner.from_gguf`` by parameter name
    (``max_positions`` from ``max_model_len``), so options the runner gains
    later (quantization ...) follow the engine's defaults too.
    """
    from services.common.model_files import default_model_path
    from services.engine.config import add_engine_arguments, engine_config_from_args
    from services.engine.torch_backend.model_runner import ModelRunner

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    config = engine_config_from_args(parser.parse_args([]))
    path = config.model_path or default_model_path()
    fields = {"max_positions": config.max_model_len}
    kwargs = {}
    for name in list(inspect.signature(ModelRunner.from_gguf).parameters)[1:]:
        if name in fields:
            kwargs[name] = fields[name]
        elif hasattr(config, name):
            kwargs[name] = getattr(config, name)
    return ModelRunner.from_gguf(path, **kwargs), config, path


def llmesh_weight_bytes() -> dict[str, Any]:
    """``decode_weight_bytes()`` of the engine's runner (``None`` with a reason
    if the runner has no such method)."""
    runner, config, path = engine_runner()
    info: dict[str, Any] = {"model_path": str(path), "device": config.device,
                            "dtype": config.dtype}
    for name in ("quantization", "quant", "weight_dtype"):  # whatever the config calls it
        if hasattr(config, name):
            info[name] = getattr(config, name)
    if not hasattr(runner, "decode_weight_bytes"):
        info.update(bytes=None, missing="ModelRunner.decode_weight_bytes() does not exist "
                                        "in this checkout")
        return info
    info["bytes"] = int(runner.decode_weight_bytes())
    return info


def gguf_tensor_bytes(path: str | Path) -> int:
    """Bytes of tensor data in a GGUF file (the weights as stored, quantized)."""
    from gguf import GGUFReader

    return int(sum(int(tensor.n_bytes) for tensor in GGUFReader(str(path)).tensors))


def roofline(bandwidth: float, weight_bytes: int | None, tpot_ms: float | None
             ) -> dict[str, Any]:
    """Roofline tokens/s and the fraction a measured TPOT reaches."""
    if not weight_bytes:
        return {"weight_bytes": weight_bytes, "roofline_tok_s": None, "tpot_ms": tpot_ms,
                "decode_tok_s": None if not tpot_ms else 1000.0 / tpot_ms, "fraction": None}
    ceiling = bandwidth / weight_bytes
    rate = 1000.0 / tpot_ms if tpot_ms else None
    return {"weight_bytes": weight_bytes, "roofline_tok_s": ceiling, "tpot_ms": tpot_ms,
            "decode_tok_s": rate, "fraction": None if rate is None else rate / ceiling}


def compute(threads: int | None = None, size_gib: float = 1.0, repeats: int = 7,
            llmesh_tpot_ms: float | None = None, llama_tpot_ms: float | None = None,
            gguf_path: str | Path | None = None) -> dict[str, Any]:
    import torch

    from services.common.model_files import default_model_path

    engine_threads = torch.get_num_threads()
    # The model first (its load uses the default threads), then the bandwidth.
    llmesh = llmesh_weight_bytes()
    gguf_path = Path(gguf_path or default_model_path())
    bandwidth = measure_read_bandwidth(threads or engine_threads, size_gib, repeats)
    bw = bandwidth["bytes_per_s"]
    return {
        "engine_threads": engine_threads,
        "bandwidth": bandwidth,
        "llmesh": {**llmesh, **roofline(bw, llmesh["bytes"], llmesh_tpot_ms)},
        "llama_cpp": {"model_path": str(gguf_path),
                      **roofline(bw, gguf_tensor_bytes(gguf_path), llama_tpot_ms)},
        "loadavg": list(os.getloadavg()),
    }


def format_report(result: dict[str, Any]) -> str:
    bw = result["bandwidth"]
    lines = [f"memory read bandwidth: {bw['bytes_per_s'] / 1e9:.1f} GB/s "
             f"({bw['method']}, {bw['bytes'] / (1 << 30):.2g} GiB, {bw['threads']} threads, "
             f"best of {bw['repeats']})",
             "| target | weight MB / step | roofline tok/s | one-stream tok/s | of roofline |",
             "|---|---:|---:|---:|---:|"]
    for name, key in (("llmesh (torch engine)", "llmesh"), ("llama.cpp", "llama_cpp")):
        r = result[key]
        mb = "n/a" if not r["weight_bytes"] else f"{r['weight_bytes'] / 1e6:.1f}"
        ceiling = "n/a" if r["roofline_tok_s"] is None else f"{r['roofline_tok_s']:.0f}"
        rate = "" if r["decode_tok_s"] is None else f"{r['decode_tok_s']:.1f}"
        frac = "" if r["fraction"] is None else f"{r['fraction'] * 100:.0f} %"
        lines.append(f"| {name} | {mb} | {ceiling} | {rate} | {frac} |")
    if result["llmesh"].get("missing"):
        lines.append(f"llmesh: {result['llmesh']['missing']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=None,
                        help="threads for the bandwidth pass (default: the engine's, "
                             "torch's default)")
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--llmesh-tpot-ms", type=float, default=None)
    parser.add_argument("--llama-tpot-ms", type=float, default=None)
    parser.add_argument("--gguf", default=None, help="llama.cpp's GGUF (default: the mesh's)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the numbers; - "
                        "for stdout (then the table goes to stderr)")
    args = parser.parse_args(argv)
    result = compute(args.threads, args.size_gib, args.repeats, args.llmesh_tpot_ms,
                     args.llama_tpot_ms, args.gguf)
    table_out = sys.stderr if args.json == "-" else sys.stdout
    print(format_report(result), file=table_out, flush=True)
    if args.json == "-":
        json.dump(result, sys.stdout, indent=2)
        print()
    elif args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
