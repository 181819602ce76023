"""Where one batch-1 decode step of the torch engine spends its time (not a test).

    python benchmarks/engine_profile.py [--quantization none|int8|int4] [--context 256]
                                        [--steps 50] [--prefill 512]

Loads SmolLM2 through ``ModelRunner.from_gguf`` (batch-invariant, the engine's
default), prefills ``--context`` tokens, then:

* times ``--steps`` decode steps of one sequence (``ModelRunner.run``, median and
  min ms; the step the engine loop calls, without sampling);
* profiles ``--profile-steps`` of them with ``torch.profiler`` and prints the
  self CPU time per op group (projections, attention, norms, element-wise ...),
  per step, and what is left of the wall time outside any op (Python and
  dispatch overhead);
* times a ``--prefill``-token prefill in one chunk (median of 3) and prints
  ``decode_weight_bytes()`` with the step's bandwidth roofline at ``--bandwidth``
  GB/s;
* prints the 1-minute load average before and after.
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]),
                str(Path(__file__).resolve().parents[1] / "services" / "gen")]

import torch  # noqa: E402

from torch.profiler import ProfilerActivity, profile  # noqa: E402

from services.common.model_files import default_model_path  # noqa: E402
from services.engine.torch_backend.model_runner import ModelRunner, StepInput  # noqa: E402

#: aten op name fragments → group, first match wins.
GROUPS = (
    ("projections", ("int4pack", "int8pack", "mkldnn_linear", "linear", "addmm", "aten::mm",
                     "to_mkldnn", "to_dense")),
    ("attention", ("bmm", "matmul", "softmax", "masked_fill", "index_select", "index_copy",
                   "cumsum", "index_put", "scaled_dot")),
    ("norms", ("rms_norm", "pow", "rsqrt", "mean")),
    ("embedding", ("embedding",)),
    ("casts/copies", ("aten::to", "_to_copy", "copy_", "clone", "contiguous", "cat", "pad",
                      "constant_pad", "zeros", "zero_", "fill_", "empty", "new_zeros", "stack")),
    ("element-wise", ("silu", "mul", "add", "neg", "sub", "div")),
    ("views", ("view", "reshape", "permute", "transpose", "slice", "select", "split", "chunk",
               "unsqueeze", "expand", "as_strided", "narrow", "_unsafe", "t", "alias",
               "detach", "unbind")),
)


def group_of(name: str) -> str:
    for group, needles in GROUPS:
        if any(needle in name for needle in needles):
            return group
    return "other"


def load_runner(quantization: str, attention_backend: str = "auto",
                dense_prefill: bool | None = None, quant_kernel: str = "auto") -> ModelRunner:
    kwargs: dict[str, object] = {}
    parameters = inspect.signature(ModelRunner.from_gguf).parameters
    if "quantization" in parameters:
        kwargs["quantization"] = quantization
    elif quantization != "none":
        raise SystemExit("this checkout's ModelRunner has no quantization")
    if "attention_backend" in parameters:  # older checkouts: their only attention
        kwargs["attention_backend"] = attention_backend
        kwargs["dense_prefill"] = dense_prefill
    if "quant_kernel" in parameters:
        kwargs["quant_kernel"] = quant_kernel
    runner = ModelRunner.from_gguf(default_model_path(), max_positions=4096, **kwargs)
    runner.allocate_kv_cache(256 << 20, 16)
    return runner


def main(args: argparse.Namespace) -> None:
    load_before = os.getloadavg()[0]
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    runner = load_runner(args.quantization, args.attention_backend, args.dense_prefill,
                         args.quant_kernel)
    roles = "prompt_len" in inspect.signature(StepInput).parameters
    blocks = list(range(-(-(max(args.context, args.prefill) + args.steps + args.profile_steps + 8) // 16)))
    prompt = torch.randint(100, 48000, (args.context,)).tolist()
    role = {"prompt_len": args.context} if roles else {}
    runner.run([StepInput(prompt, 0, blocks, **role)])
    position = args.context

    def step() -> None:
        nonlocal position
        runner.run([StepInput([1234], position, blocks, **role)])
        position += 1

    for _ in range(5):
        step()
    times = []
    for _ in range(args.steps):
        began = time.perf_counter()
        step()
        times.append((time.perf_counter() - began) * 1000)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        began = time.perf_counter()
        for _ in range(args.profile_steps):
            step()
        profiled_ms = (time.perf_counter() - began) * 1000 / args.profile_steps
    groups: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for event in prof.key_averages():
        group = group_of(event.key)
        groups[group] += event.self_cpu_time_total / 1000 / args.profile_steps
        calls[group] += event.count // args.profile_steps
    quant = getattr(runner, "quantization", "none")
    print(f"SmolLM2 {quant}, batch 1, context {args.context}, {torch.get_num_threads()} threads, "
          f"attention {getattr(runner, 'attention_backend', 'torch')}, dense prefill "
          f"{getattr(runner.model, 'has_prompt_projections', False)}, quant kernel "
          f"{getattr(runner.model, 'quant_kernel', None)}, "
          f"load average {load_before:.2f}")
    print(f"decode step (ModelRunner.run): median {statistics.median(times):.2f} ms, "
          f"min {min(times):.2f} ms over {args.steps} steps")
    print(f"\nprofiled ({args.profile_steps} steps, profiler on: {profiled_ms:.2f} ms/step)")
    print("| op group | ms/step | ops/step |")
    print("|---|---:|---:|")
    total = 0.0
    for group, ms in sorted(groups.items(), key=lambda item: -item[1]):
        total += ms
        print(f"| {group} | {ms:.2f} | {calls[group]} |")
    print(f"| outside ops (Python, dispatch) | {profiled_ms - total:.2f} | |")
    if args.top:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    pre = list(range(args.prefill))
    prefill_times = []
    for _ in range(3):
        began = time.perf_counter()
        runner.run([StepInput(pre, 0, blocks, **({"prompt_len": len(pre)} if roles else {}))])
        prefill_times.append(time.perf_counter() - began)
    print(f"\nprefill of {args.prefill} tokens in one chunk: median "
          f"{statistics.median(prefill_times) * 1000:.0f} ms (of 3)")
    if hasattr(runner, "decode_weight_bytes"):
        weight_bytes = runner.decode_weight_bytes()
        roofline_ms = weight_bytes / (args.bandwidth * 1e9) * 1000
        print(f"decode weight bytes {weight_bytes / 1e6:.1f} MB: roofline {roofline_ms:.2f} ms "
              f"at {args.bandwidth:g} GB/s; median step = "
              f"{roofline_ms / statistics.median(times) * 100:.0f} % of roofline")
    print(f"load average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quantization", default="none", choices=("none", "int8", "int4"))
    parser.add_argument("--attention-backend", default="auto", choices=("auto", "native", "torch"))
    parser.add_argument("--dense-prefill", action=argparse.BooleanOptionalAction, default=None,
                        help="default: the engine's (only with --quant-kernel torch)")
    parser.add_argument("--quant-kernel", default="auto", choices=("auto", "native", "torch"))
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--profile-steps", type=int, default=10)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--bandwidth", type=float, default=32.0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--top", type=int, default=0, help="also print the top N aten ops")
    main(parser.parse_args())
