"""kv_aware against round_robin on a hot prefix and on capacity-bound shared prefixes, one run.

Issue 30, bug 2: routing is judged against round robin where one prefix is
hot and where caches are capacity-bound (docs/architecture.md, "Routing
across replicas"). One mesh with ``--engines 2`` (each engine one CPU thread,
``--kv-cache-bytes 167772160``); for each workload, the two policies in turn
(the order alternating from one workload to the next), each on freshly
restarted engines (empty prefix caches, nothing measured) behind a router of
its own:

``hot-8``, ``hot-16``
  8 / 16 concurrent streams (``--max-concurrency``) on **one** ~400-token
  system prompt with short questions, 64 tokens out, staggered: requests
  arrive at 4 / 8 per second (Poisson), more than the two replicas finish, so
  the streams start over ~2 s and then each sends its next request when a
  slot frees. One request with that prompt goes first, alone and not
  measured: the prefix is hot on one replica when the streams arrive, as with
  a system prompt already in use. (Without the stagger and the priming, the
  first burst spreads by queued prefill under any cost and hides the
  question: the old cost, 8 prefill tokens a running sequence, spread too.)
  Targets: kv_aware output throughput >= 0.9x round robin's, TTFT p50 no worse.
``shared``
  The issue's capacity-bound workload: 8 shuffled prefixes of 768 tokens,
  16 tokens out, 64 prompts, 4 clients, seed 5. Targets: kv_aware TTFT p50
  <= 0.5x round robin's, TTFT p99 and output throughput no worse.

Prints, per workload and policy, TTFT p50/p99, TPOT p50, ITL p50, output
throughput and the requests each replica took, then kv_aware / round_robin
ratios, with the load average at each run's start and end. Run it alone on
the machine (nothing else starting meshes or tests): it measures CPU time.

Usage (from the repository root, so the mesh runs this checkout):
``python -m benchmarks.routing_hot_prefix [--workloads hot-8 hot-16 shared]``
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
from dataclasses import dataclass
from pathlib import Path

from benchmarks.kv_routing import pick
from services.cli.mesh import Mesh, child_env

POLICIES = ("kv_aware", "round_robin")
KV_CACHE_BYTES = "167772160"
SEED = 5


@dataclass(frozen=True)
class Workload:
    """One ``llmesh bench --dataset-name shared-prefix`` load."""

    num_prefixes: int
    prefix_len: int
    output_len: int
    num_prompts: int
    clients: int
    prime: bool
    request_rate: str = "inf"

    def bench_args(self, num_prompts: int, clients: int, rate: str) -> list[str]:
        return ["--dataset-name", "shared-prefix", "--shared-prefix-num-prefixes",
                str(self.num_prefixes), "--shared-prefix-prefix-len", str(self.prefix_len),
                "--shared-prefix-output-len", str(self.output_len), "--num-prompts",
                str(num_prompts), "--max-concurrency", str(clients), "--request-rate", rate,
                "--seed", str(SEED)]


WORKLOADS = {
    "hot-8": Workload(1, 400, 64, 64, 8, prime=True, request_rate="4"),
    "hot-16": Workload(1, 400, 64, 96, 16, prime=True, request_rate="8"),
    "shared": Workload(8, 768, 16, 64, 4, prime=False),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    return parser.parse_args()


def bench(address: str, args: list[str], result: Path) -> dict:
    """One ``llmesh bench`` run against the router at ``address``; its JSON result."""
    host, port = address.rsplit(":", 1)
    command = [sys.executable, "-m", "services.bench", "--backend", "llmesh", "--host", host,
               "--port", port, *args, "--result-file", str(result)]
    done = subprocess.run(command, env=child_env(), stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"llmesh bench failed ({done.returncode}): {done.stderr[-2000:]}")
    data = json.loads(result.read_text())
    return data["runs"][0] if "runs" in data else data


def routed_per_replica(metrics_address: str) -> list[int]:
    """Requests the router sent to each replica (``llmesh:router_routed_requests``)."""
    text = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5).read().decode()
    return sorted((int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
                   if line.startswith("llmesh:router_routed_requests_total{")), reverse=True)


def run_one(mesh: Mesh, run_dir: Path, name: str, work: Workload, policy: str) -> dict:
    for engine in ("engine-0", "engine-1"):
        mesh.restart(engine)
    router = mesh.add_router(f"router-{name}-{policy}", ["--routing-policy", policy])
    try:
        time.sleep(1.0)  # load streams open
        if work.prime:
            bench(router.grpc_address, work.bench_args(1, 1, "inf"),
                  run_dir / f"{name}-{policy}-prime.json")
            time.sleep(0.5)  # the prefix's KV events reach the index
        run = bench(router.grpc_address,
                    work.bench_args(work.num_prompts, work.clients, work.request_rate),
                    run_dir / f"{name}-{policy}.json")
        run["routed"] = routed_per_replica(router.metrics_address)
    finally:
        mesh.remove_router(router.name)
    return run


ROW = "{:8} {:12} {:>9} {:>9} {:>9} {:>9} {:>10} {:>10} {:>11}"


def print_table(results: dict[str, dict[str, dict]]) -> None:
    print(ROW.format("workload", "policy", "TTFT p50", "TTFT p99", "TPOT p50", "ITL p50",
                     "out tok/s", "routed", "load"))
    for name, by_policy in results.items():
        for policy, run in by_policy.items():
            load = f"{run['loadavg_start'][0]:.2f}-{run['loadavg_end'][0]:.2f}"
            print(ROW.format(name, policy, *(f"{pick(run, key):.1f}" for key in (
                "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "median_itl_ms",
                "output_throughput")), "/".join(map(str, run["routed"])), load))
    print("\nkv_aware / round_robin:")
    for name, by_policy in results.items():
        if set(POLICIES) <= set(by_policy):
            kv, rr = by_policy["kv_aware"], by_policy["round_robin"]
            ratios = {key: pick(kv, key) / pick(rr, key) for key in (
                "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "output_throughput")}
            print(f"  {name:8} TTFT p50 {ratios['median_ttft_ms']:.2f}x, "
                  f"p99 {ratios['p99_ttft_ms']:.2f}x, TPOT p50 {ratios['median_tpot_ms']:.2f}x, "
                  f"throughput {ratios['output_throughput']:.2f}x")


def main() -> None:
    args = parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="routing-hot-prefix-"))
    print(f"started {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, load {os.getloadavg()}, "
          f"{os.cpu_count()} CPUs", flush=True)
    results: dict[str, dict[str, dict]] = {}
    with Mesh(ingress_port=0, admin_port=0, run_dir=run_dir, num_engines=2,
              engine_args=["--kv-cache-bytes", KV_CACHE_BYTES]) as mesh:
        for index, name in enumerate(args.workloads):
            order = POLICIES if index % 2 == 0 else POLICIES[::-1]
            results[name] = {}
            for policy in order:
                results[name][policy] = run_one(mesh, run_dir, name, WORKLOADS[name], policy)
                print(f"{name} {policy} done, load {os.getloadavg()}", flush=True)
    print()
    print_table({name: {p: by[p] for p in POLICIES if p in by} for name, by in results.items()})
    print(f"ended {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; results: {run_dir}")


if __name__ == "__main__":
    main()
