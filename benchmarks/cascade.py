"""The cascade against each model alone, on one labelled prompt set, one run (not a test).

    python benchmarks/cascade.py [--thresholds -0.3 -0.6 -1.0] [--window 8]
                                 [--limit N] [--max-tokens 16] [--json OUT]

Starts one mesh with two models (SmolLM2-135M-Instruct Q4_1 as ``small``,
Gemma 3 270M base Q4_K_M as ``large``, each with one engine) and one router
per cascade threshold (``--cascade small,large --cascade-min-mean-logprob
T``; the mesh's router serves the first), then sends every prompt of
``benchmarks/data/cascade_prompts.jsonl`` (``Question: Q\\nAnswer:``, greedy,
``max_tokens`` 8, ``bypass_cache``) to each policy in turn: small only,
large only, then the cascade at each threshold, prompt by prompt (the
policies interleaved, so the machine's drift hits all alike), one request at
a time, straight to the routers' gRPC ports.

Per policy it prints TTFT p50/p99 and TPOT p50 (client side, streamed),
compute per answer (engine-seconds: the growth of both engines'
``llmesh:engine_step_duration_seconds_sum`` across the request, the small
model's discarded windows included), the escalation rate, exact match (an
accepted answer in the output's first non-empty line, case-insensitive) and
agreement with the large model's greedy answer (the same first line), with
the load averages before and after. ``--json`` writes every answer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "services" / "gen")]

import grpc  # noqa: E402

from llmesh.v1 import common_pb2, generation_pb2, generation_pb2_grpc  # noqa: E402
from services.cli.mesh import Mesh, ModelSpec  # noqa: E402
from services.common.model_files import default_model_path  # noqa: E402
from services.tokenizer.model_parts import gemma3_270m_gguf_path  # noqa: E402

PROMPTS = ROOT / "benchmarks" / "data" / "cascade_prompts.jsonl"
STEP_SUM = "llmesh:engine_step_duration_seconds_sum"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def engine_seconds(addresses: list[str]) -> float:
    """The engines' summed step time so far (seconds)."""
    total = 0.0
    for address in addresses:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as page:
            for line in page.read().decode().splitlines():
                if line.startswith(STEP_SUM):
                    total += float(line.rsplit(" ", 1)[1])
    return total


def ask(stub: generation_pb2_grpc.GenerationServiceStub, model: str, question: str,
        max_tokens: int) -> dict[str, object]:
    """One streamed greedy request: text, TTFT, TPOT and the answer's path."""
    request = generation_pb2.GenerateRequest(
        model=model, prompt=f"Question: {question}\nAnswer:", bypass_cache=True,
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens))
    sent = time.perf_counter()
    first = last = None
    text, tokens, final = [], 0, None
    for response in stub.Generate(request, timeout=120):
        if response.token_ids:
            last = time.perf_counter()
            first = first or last
            tokens += len(response.token_ids)
        text.append(response.text)
        if response.finish_reason:
            final = response
    assert final is not None
    return dict(text="".join(text), tokens=tokens,
                ttft=None if first is None else first - sent,
                tpot=None if tokens < 2 or first is None or last is None
                else (last - first) / (tokens - 1),
                model=final.model, escalated=final.cascade.escalated,
                reason=final.cascade.reason,
                mean_logprob=(final.cascade.mean_logprob
                              if final.cascade.HasField("mean_logprob") else None))


def first_line(text: str) -> str:
    """The first non-empty line, lower case."""
    return next((line.strip().lower() for line in text.splitlines() if line.strip()), "")


def summarize(name: str, rows: list[dict[str, object]]) -> str:
    ttfts = [float(r["ttft"]) for r in rows if r["ttft"] is not None]
    tpots = [float(r["tpot"]) for r in rows if r["tpot"] is not None]
    n = len(rows)
    return (f"| {name} | {percentile(ttfts, 0.5) * 1e3:.0f} "
            f"| {percentile(ttfts, 0.99) * 1e3:.0f} "
            f"| {statistics.median(tpots) * 1e3:.1f} "
            f"| {statistics.mean(float(r['engine_s']) for r in rows):.3f} "
            f"| {sum(1 for r in rows if r['escalated']) / n:.0%} "
            f"| {sum(1 for r in rows if r['exact']) / n:.0%} "
            f"| {sum(1 for r in rows if r['agrees']) / n:.0%} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--thresholds", type=float, nargs="+", default=[-0.5, -0.9, -1.3])
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--limit", type=int, default=0, help="first N prompts only")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    prompts = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    prompts = prompts[:args.limit] if args.limit else prompts
    before = os.getloadavg()

    def cascade_args(threshold: float) -> list[str]:
        return ["--cascade", "small,large", "--cascade-window", str(args.window),
                "--cascade-min-mean-logprob", str(threshold)]

    with tempfile.TemporaryDirectory() as run_dir, Mesh(
            ingress_port=0, admin_port=0, run_dir=Path(run_dir),
            models=[ModelSpec("small", str(default_model_path())),
                    ModelSpec("large", str(gemma3_270m_gguf_path()))],
            engine_args=["--max-model-len", "512", "--kv-cache-bytes", str(64 << 20)],
            router_args=cascade_args(args.thresholds[0])) as mesh:
        routers = {f"cascade@{args.thresholds[0]:g}": mesh.services["router"].grpc_address}
        for i, threshold in enumerate(args.thresholds[1:]):
            routers[f"cascade@{threshold:g}"] = mesh.add_router(
                f"router-t{i}", cascade_args(threshold)).grpc_address
        engines = [mesh.services["engine-0"].metrics_address,
                   mesh.services["engine-large-0"].metrics_address]
        policies = [("small only", "small", routers[next(iter(routers))]),
                    ("large only", "large", routers[next(iter(routers))]),
                    *((name, "auto", address) for name, address in routers.items())]
        channels = {a: grpc.insecure_channel(a) for a in set(routers.values())}
        stubs = {a: generation_pb2_grpc.GenerationServiceStub(c) for a, c in channels.items()}
        results: dict[str, list[dict[str, object]]] = {name: [] for name, *_ in policies}
        for _, model, address in policies:  # warm every path once
            ask(stubs[address], model, "What is 1 plus 1?", 4)
        for prompt in prompts:
            large_answer = None
            for name, model, address in policies:
                spent = engine_seconds(engines)
                row = ask(stubs[address], model, prompt["question"], args.max_tokens)
                row["engine_s"] = engine_seconds(engines) - spent
                line = first_line(str(row["text"]))
                row["exact"] = any(a.lower() in line for a in prompt["answers"])
                if name == "large only":
                    large_answer = line
                row["agrees"] = line == large_answer
                row.update(id=prompt["id"], difficulty=prompt["difficulty"])
                results[name].append(row)
        for channel in channels.values():
            channel.close()
    after = os.getloadavg()
    print(f"{len(prompts)} prompts, window k={args.window}, max_tokens={args.max_tokens}; "
          f"load average before {before[0]:.2f} {before[1]:.2f} {before[2]:.2f}, "
          f"after {after[0]:.2f} {after[1]:.2f} {after[2]:.2f}")
    print("| policy | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | engine-s / answer | "
          "escalated | exact match | agrees with large |")
    print("|---|---|---|---|---|---|---|---|")
    for name, rows in results.items():
        print(summarize(name, rows))
    for name, rows in results.items():
        for label in ("easy", "hard"):
            part = [r for r in rows if r["difficulty"] == label]
            print(f"  {name} {label}: escalated {sum(1 for r in part if r['escalated'])}/"
                  f"{len(part)}, exact {sum(1 for r in part if r['exact'])}/{len(part)}")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
