"""Checks of the torch engine's CUDA path that need a GPU (``docs/engine.md#cuda``).

On a checkpoint directory (default: a tiny random Llama written here;
``--model-path DIR`` for another, e.g. ``python -m benchmarks.random_checkpoint
DIR --shape 8b``), on ``--device cuda`` in ``--dtype`` (default bfloat16):

1. ``graphs_match_eager``: each decode batch size replayed from a captured CUDA
   graph gives the eager step's next tokens (argmax) and logits within a
   tolerance (the graph pads rows to its captured size, so cuBLAS may pick
   other kernels: bit equality is not expected).
2. ``no_host_sync``: a decode step (graph replay and eager) and its greedy
   sampling run under ``torch.cuda.set_sync_debug_mode("error")``, which raises
   on any synchronizing CUDA call, up to the sampled ids' ``.tolist()``.
3. ``greedy_matches_transformers`` (tiny model only, fp32): the engine's greedy
   tokens through ``TorchBackend`` equal ``transformers``' ``generate`` on the GPU.
4. ``decode_step_ms``: eager vs graph decode step time per batch size
   (CUDA events, median of ``--iters``).

Prints one JSON object; ``checks`` gives each check's verdict, ``"ok"``,
``"failed"`` or ``"not run"`` (``greedy_matches_transformers`` with
``--model-path``): a check that did not run is never counted as passed. ``ok``
is true when every check that ran passed; exits 1 otherwise. Needs a CUDA
device.

    python -m benchmarks.cuda_check [--model-path DIR] [--dtype bfloat16] [--batch-sizes 1,8,32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.random_checkpoint import save_tiny_llama
from services.engine.torch_backend.model_runner import ModelRunner, StepInput
from services.engine.torch_backend.sampler import SamplingRow, sample

BLOCK = 16


def decode_inputs(runner: ModelRunner, batch: int, context: int) -> list[StepInput]:
    """``batch`` sequences with ``context`` tokens prefilled each (blocks laid out
    one sequence after another), ready for one decode step."""
    per_seq = -(-(context + 1) // BLOCK)
    inputs = []
    for i in range(batch):
        blocks = list(range(i * per_seq, (i + 1) * per_seq))
        prompt = [(7 * i + j) % runner.config.vocab_size for j in range(context)]
        runner.run_model(runner.prepare([StepInput(prompt, 0, blocks)]))
        inputs.append(StepInput([(11 * i) % runner.config.vocab_size], context, blocks))
    return inputs


def step_ms(runner: ModelRunner, inputs: list[StepInput], iters: int, graph: bool) -> float:
    """Median milliseconds of one decode step (the same step repeated)."""
    run = runner.run if graph else (lambda x: runner.run_model(runner.prepare(x)))
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run(inputs)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def check_graphs(runner: ModelRunner, sizes: list[int], context: int, iters: int,
                 tolerance: float) -> dict[str, Any]:
    out: dict[str, Any] = {"graphs_match_eager": {}, "no_host_sync": {}, "decode_step_ms": {}}
    for batch in sizes:
        inputs = decode_inputs(runner, batch, context)
        assert runner.graphs is not None and runner.graphs.select(inputs) is not None, batch
        eager = runner.run_model(runner.prepare(inputs)).float()
        replays = runner.graphs.replays
        graph = runner.run(inputs).float()
        assert runner.graphs.replays == replays + 1
        diff = (graph - eager).abs().max().item()
        scale = eager.abs().max().item()
        same = torch.equal(graph.argmax(-1), eager.argmax(-1))
        out["graphs_match_eager"][batch] = {"ok": same and diff <= tolerance * scale,
                                            "max_abs_diff": diff, "scale": scale,
                                            "argmax_equal": same}
        torch.cuda.synchronize()
        syncs = {}
        for name, step in (("graph", runner.run),
                           ("eager", lambda x: runner.run_model(runner.prepare(x)))):
            torch.cuda.set_sync_debug_mode("error")
            try:
                ids = sample(step(inputs), [SamplingRow()] * batch)
                syncs[name] = "ok"
            except RuntimeError as err:
                syncs[name] = f"synchronized: {err}"
                continue
            finally:
                torch.cuda.set_sync_debug_mode("default")
            ids.tolist()  # the one allowed transfer, outside the checked region
        out["no_host_sync"][batch] = syncs
        out["decode_step_ms"][batch] = {"eager": step_ms(runner, inputs, iters, graph=False),
                                        "graph": step_ms(runner, inputs, iters, graph=True)}
    return out


async def greedy_vs_transformers(path: Path, device: str, new_tokens: int = 16) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    from services.common.sampling import SamplingOptions
    from services.engine.config import EngineConfig
    from services.engine.torch_backend.backend import TorchBackend
    from services.engine.types import SequenceRequest

    prompt = (1, 504, 3094, 28, 1092, 6050, 30)
    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    with torch.inference_mode():
        expected = hf.generate(torch.tensor([prompt], device=device), do_sample=False,
                               max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                               attention_mask=torch.ones(1, len(prompt), device=device))
    expected_ids = expected[0, len(prompt):].tolist()
    backend = TorchBackend(EngineConfig(model_path=path, device=device, dtype="float32",
                                        kv_cache_bytes=64 << 20, speculative_method="none",
                                        max_num_seqs=8))
    await backend.start()
    tokens: list[int] = []
    try:
        request = SequenceRequest("cuda-check", prompt,
                                  SamplingOptions(max_tokens=new_tokens, ignore_eos=True))
        async for delta in backend.generate(request):
            tokens.extend(delta.token_ids)
    finally:
        await backend.shutdown()
    return {"ok": tokens == expected_ids, "ours": tokens, "transformers": expected_ids}


#: The pass/fail checks, in the order they run (``decode_step_ms`` is a measurement).
CHECKS = ("graphs_match_eager", "no_host_sync", "greedy_matches_transformers")


def check_verdicts(report: dict[str, Any]) -> dict[str, str]:
    """Each of ``CHECKS`` -> ``"ok"``, ``"failed"`` or ``"not run"`` (absent from
    ``report``, or run over no batch size). Per-batch-size results must all pass."""
    results = {
        "graphs_match_eager": [v["ok"] for v in report.get("graphs_match_eager", {}).values()],
        "no_host_sync": [s == "ok" for v in report.get("no_host_sync", {}).values()
                         for s in v.values()],
        "greedy_matches_transformers": [report["greedy_matches_transformers"]["ok"]]
        if "greedy_matches_transformers" in report else [],
    }
    return {name: "not run" if not results[name] else "ok" if all(results[name]) else "failed"
            for name in CHECKS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", type=Path, default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--batch-sizes", default="1,3,8,32")
    parser.add_argument("--context", type=int, default=200, help="tokens per sequence")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--tolerance", type=float, default=0.02,
                        help="largest |graph - eager| logit difference, relative to the max logit")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device"}))
        return 1
    tiny = args.model_path is None
    path = args.model_path or save_tiny_llama(Path(tempfile.mkdtemp()) / "tiny-llama")
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    runner = ModelRunner.from_path(path, args.device, args.dtype, attention_backend="auto")
    max_len = min(runner.config.context_length, 4096)
    per_seq = -(-(args.context + 1) // BLOCK)
    block_bytes = 2 * runner.config.num_layers * runner.config.num_kv_heads * BLOCK \
        * runner.config.head_dim * runner.model.embed_tokens.element_size()
    runner.allocate_kv_cache(max(sizes) * per_seq * block_bytes, BLOCK)
    runner.warm_up()
    stats = runner.capture_cuda_graphs(sizes, max_len)
    report: dict[str, Any] = {
        "model": str(path), "dtype": args.dtype, "attention_backend": runner.attention_backend,
        "device_name": torch.cuda.get_device_name(), "capture": stats.__dict__,
        **check_graphs(runner, sizes, args.context, args.iters, args.tolerance)}
    if tiny:
        report["greedy_matches_transformers"] = asyncio.run(
            greedy_vs_transformers(path, args.device))
    report["checks"] = check_verdicts(report)
    report["ok"] = "failed" not in report["checks"].values()
    print(json.dumps(report, indent=2, default=str))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
