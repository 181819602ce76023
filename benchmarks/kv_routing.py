"""Routing policies side by side: kv_aware vs round_robin vs least_load over 2 replicas.

Starts one mesh with ``--engines 2`` (each engine one CPU, ``--kv-cache-bytes``
small enough that one replica holds only part of the prefixes while two hold
all of them: the case where cache-aware routing multiplies the cluster's
cache), then for each policy in turn:

1. restarts both engines (fresh prefix caches: no policy inherits another's);
2. starts a router with ``--routing-policy P`` on the same engines and cache;
3. runs ``llmesh bench --dataset-name shared-prefix`` against it (the same
   prompts, arrivals and seed for every policy) and reads its JSON result.

Prints TTFT p50/p99, TPOT p50, output throughput and the prefix-hit tokens
of each policy in one table, with the load average; the target is
**kv_aware TTFT p50 <= 0.5x round_robin**.

Usage: ``python benchmarks/kv_routing.py [--num-prompts 96] [--num-prefixes 8]
[--prefix-len 768] [--kv-cache-bytes 256MiB] [--request-rate 2] [--policies ...]``
Not a test: numbers depend on the machine (2 cores here).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from services.cli.mesh import Mesh, child_env

POLICIES = ("kv_aware", "round_robin", "least_load")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=96)
    parser.add_argument("--num-prefixes", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=768, help="tokens per system prompt")
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--kv-cache-bytes", default="256MiB",
                        help="per engine (SmolLM2: 46 KB per token; 256MiB ~ 5,800 tokens)")
    parser.add_argument("--request-rate", default="2", help="requests/s (Poisson), or inf")
    parser.add_argument("--max-concurrency", default="8")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    return parser.parse_args()


def prefix_hit_tokens(metrics_address: str) -> float:
    """Sum of the router's ``llmesh:router_prefix_hit_tokens`` histogram."""
    text = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("llmesh:router_prefix_hit_tokens_sum"))


def run_bench(args: argparse.Namespace, address: str, result: Path) -> dict:
    host, port = address.rsplit(":", 1)
    command = [
        sys.executable, "-m", "services.bench", "--backend", "llmesh", "--host", host,
        "--port", port, "--dataset-name", "shared-prefix", "--num-prompts",
        str(args.num_prompts), "--shared-prefix-num-prefixes", str(args.num_prefixes),
        "--shared-prefix-prefix-len", str(args.prefix_len), "--shared-prefix-output-len",
        str(args.output_len), "--request-rate", args.request_rate, "--max-concurrency",
        args.max_concurrency, "--seed", "0", "--result-file", str(result)]
    subprocess.run(command, check=True, env=child_env(), stdout=subprocess.DEVNULL)
    data = json.loads(result.read_text())
    return data["runs"][0] if "runs" in data else data


def pick(run: dict, *names: str) -> float:
    for name in names:
        if name in run:
            return float(run[name])
    return float("nan")


def main() -> None:
    args = parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="kv-routing-"))
    engine_args = ["--kv-cache-bytes", args.kv_cache_bytes]
    rows = []
    with Mesh(ingress_port=0, admin_port=0, run_dir=run_dir, num_engines=2,
              engine_args=engine_args) as mesh:
        for policy in args.policies:
            for name in ("engine-0", "engine-1"):
                mesh.restart(name)
            router = mesh.add_router(f"router-{policy}", ["--routing-policy", policy])
            time.sleep(1.0)
            started = time.monotonic()
            run = run_bench(args, router.grpc_address, run_dir / f"{policy}.json")
            rows.append((policy, run, prefix_hit_tokens(router.metrics_address),
                         time.monotonic() - started, os.getloadavg()[0]))
    print(f"\n{args.num_prompts} prompts, {args.num_prefixes} prefixes x {args.prefix_len} "
          f"tokens, {args.output_len} output tokens, rate {args.request_rate}/s, "
          f"KV {args.kv_cache_bytes} per engine, 2 engines")
    print(f"{'policy':12} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} "
          f"{'out tok/s':>9} {'hit tok':>9} {'load':>5}")
    for policy, run, hits, _, load in rows:
        print(f"{policy:12} {pick(run, 'median_ttft_ms', 'p50_ttft_ms'):9.1f} "
              f"{pick(run, 'p99_ttft_ms'):9.1f} {pick(run, 'median_tpot_ms', 'p50_tpot_ms'):9.1f} "
              f"{pick(run, 'output_throughput'):9.1f} {hits:9.0f} {load:5.2f}")
    by_policy = {policy: run for policy, run, *_ in rows}
    if "kv_aware" in by_policy and "round_robin" in by_policy:
        ratio = (pick(by_policy["kv_aware"], "median_ttft_ms", "p50_ttft_ms")
                 / pick(by_policy["round_robin"], "median_ttft_ms", "p50_ttft_ms"))
        print(f"kv_aware / round_robin TTFT p50: {ratio:.2f} (target <= 0.5)")
    print(f"logs and results: {run_dir}")


if __name__ == "__main__":
    main()
