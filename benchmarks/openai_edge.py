"""The OpenAI HTTP edge vs the gRPC path, through the same Envoy, in one run.

Starts ``llmesh up`` (the :class:`Mesh` launcher: one torch engine, the router's
OpenAI port routed by Envoy) unless ``--url`` names a running mesh, then runs
``llmesh bench`` in turn against ``--backend llmesh`` (gRPC ``Generate``
through Envoy), ``--backend openai`` (SSE ``/v1/completions`` through Envoy:
the same raw prompt, so the same engine work as ``llmesh``) and ``--backend
openai-chat`` (SSE ``/v1/chat/completions``: the prompt wrapped in one user
message, ~10 template tokens more) for ``--rounds`` rounds: random prompts of
the same length, a seed per backend and round (the OpenAI API cannot bypass
the response cache, so no run may meet another's prompts), greedy,
``ignore_eos``, one stream, the order rotated each round. Prints, per backend, the median over rounds of each run's
median TTFT and TPOT, the ratios to ``llmesh``, and the load average.

Usage: ``python benchmarks/openai_edge.py [--rounds 3] [--num-prompts 6]
[--input-len 128] [--output-len 32] [--workload random|chat] [--url HOST:PORT]``
Not a test: numbers depend on the machine (2 cores here, shared).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from services.cli.mesh import Mesh, child_env

REPO_ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ("llmesh", "openai", "openai-chat")


def bench(url: str, backend: str, args: argparse.Namespace, seed: int,
          out: Path) -> dict[str, Any]:
    """One ``llmesh bench`` run; its result JSON."""
    result = out / f"{backend}-{seed}.json"
    base = url if backend == "llmesh" else f"http://{url}"
    if args.workload == "chat":  # the same chat messages on every backend
        dataset = ["--dataset-name", "shared-prefix",
                   "--shared-prefix-num-prefixes", str(args.num_prompts),
                   "--shared-prefix-prefix-len", str(args.input_len),
                   "--shared-prefix-output-len", str(args.output_len)]
    else:
        dataset = ["--dataset-name", "random", "--random-input-len", str(args.input_len),
                   "--random-output-len", str(args.output_len)]
    command = [sys.executable, "-m", "services.bench", "--backend", backend,
               "--base-url", base, *dataset,
               "--num-prompts", str(args.num_prompts), "--max-concurrency", "1",
               "--num-warmups", "1", "--seed", str(seed), "--temperature", "0",
               "--ignore-eos", "--result-file", str(result), "--disable-tqdm"]
    with (out / f"{backend}-{seed}.log").open("w") as log:
        subprocess.run(command, cwd=REPO_ROOT, env=child_env(), stdout=log,
                       stderr=subprocess.STDOUT, check=True)
    return json.loads(result.read_text())


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip()


def measure(url: str, args: argparse.Namespace, out: Path) -> dict[str, dict[str, list[float]]]:
    figures: dict[str, dict[str, list[float]]] = {b: {"ttft": [], "tpot": []} for b in BACKENDS}
    for round_ in range(args.rounds):
        order = BACKENDS[round_ % 3:] + BACKENDS[:round_ % 3]
        for backend in order:
            # Its own prompts (same lengths): a greedy answer the previous backend
            # stored would come from the response cache (only gRPC can bypass it).
            seed = 1000 + 10 * round_ + BACKENDS.index(backend)
            result = bench(url, backend, args, seed=seed, out=out)
            figures[backend]["ttft"].append(result["median_ttft_ms"])
            figures[backend]["tpot"].append(result["median_tpot_ms"])
            print(f"round {round_} {backend:12s} TTFT p50 {result['median_ttft_ms']:8.2f} ms  "
                  f"TPOT p50 {result['median_tpot_ms']:7.2f} ms  load {loadavg()}", flush=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="ingress host:port of a running mesh (default: start one)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--workload", choices=("random", "chat"), default="random",
                        help="random: raw random prompts (openai-chat wraps each in a user "
                             "message: ~10 template tokens and another answer); chat: the "
                             "shared-prefix dataset's chat messages, the same engine work "
                             "on all three backends (the fair comparison for openai-chat)")
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="openai-edge-"))
    print(f"load before: {loadavg()}; logs in {out}", flush=True)
    if args.url:
        figures = measure(args.url, args, out)
    else:
        with Mesh(ingress_port=0, admin_port=0, run_dir=out / "mesh") as mesh:
            figures = measure(mesh.ingress_address, args, out)
    print(f"load after: {loadavg()}")
    print(f"{'backend':12s} {'TTFT p50 (ms)':>14s} {'TPOT p50 (ms)':>14s}  (median of "
          f"{args.rounds} runs' medians)")
    medians = {b: {k: statistics.median(v) for k, v in f.items()} for b, f in figures.items()}
    for backend, m in medians.items():
        print(f"{backend:12s} {m['ttft']:14.2f} {m['tpot']:14.2f}")
    grpc_m = medians["llmesh"]
    for backend in BACKENDS[1:]:
        http_m = medians[backend]
        print(f"{backend} / llmesh: TTFT {http_m['ttft'] / grpc_m['ttft']:.3f}, "
              f"TPOT {http_m['tpot'] / grpc_m['tpot']:.3f}")


if __name__ == "__main__":
    main()
