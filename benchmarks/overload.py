"""Overload: Poisson arrivals at a multiple of the mesh's sustainable rate, admission on vs off.

In one run, on this machine:

1. starts the mesh (``llmesh up``'s launcher, free ports, one engine with
   ``--max-num-seqs R``; the router with ``--max-running-per-replica R
   --max-queued-requests Q``) and measures its **sustainable rate**: the
   request throughput of ``llmesh bench`` with R closed-loop clients;
2. sets the **TTFT SLO** (``--ttft-slo-ms``, else the median end-to-end
   latency of that closed-loop run: a request that waits one round of
   service meets it);
3. offers Poisson arrivals at ``--load-factor`` × the sustainable rate for
   ``--duration`` seconds to that mesh (admission on), then to the same mesh
   started with ``--no-admission`` (admission off: every request goes to the
   engine, whose own waiting queue is the only limit);
4. prints one table: completed and refused requests, admitted requests' TTFT
   p50/p99 against the SLO, TPOT, refusal latency p50/p99, and goodput
   (requests within the TTFT SLO per second), with the load average.

Usage: ``python benchmarks/overload.py [--duration 60] [--load-factor 3]
[--max-running 8] [--queue 8] [--input-len 128] [--output-len 32]
[--ttft-slo-ms MS] [--result-dir DIR]``. Not a test: the numbers are the
machine's. Run it on a quiet machine (a mesh beside it halves its numbers).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from services.cli.mesh import Mesh


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def bench(mesh: Mesh, args: argparse.Namespace, result: Path, *extra: str) -> dict[str, Any]:
    """Runs ``llmesh bench`` against ``mesh``; returns its JSON result."""
    host, port = mesh.ingress_address.rsplit(":", 1)
    command = [sys.executable, "-m", "services.cli.main", "bench", "--host", host, "--port", port,
               "--dataset-name", "random", "--random-input-len", str(args.input_len),
               "--random-output-len", str(args.output_len), "--ignore-eos", "--disable-tqdm",
               "--metric-percentiles", "50,99", "--result-file", str(result), *extra]
    subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(result.read_text())


def start_mesh(args: argparse.Namespace, run_dir: Path, *, admission: bool) -> Mesh:
    router = ["--max-running-per-replica", str(args.max_running),
              "--max-queued-requests", str(args.queue)]
    if not admission:
        router.append("--no-admission")
    return Mesh(ingress_port=0, admin_port=0, run_dir=run_dir,
                engine_args=["--max-num-seqs", str(args.max_running)],
                router_args=router).start()


def overload_run(mesh: Mesh, args: argparse.Namespace, out: Path, rate: float,
                 slo_ms: float) -> dict[str, Any]:
    return bench(mesh, args, out, "--request-rate", f"{rate:.3f}",
                 "--duration", str(args.duration), "--num-prompts", str(int(rate * args.duration * 2) + 10),
                 "--goodput", f"ttft:{slo_ms:.0f}", "--request-timeout", str(args.request_timeout),
                 "--seed", "1")


def row(mode: str, result: dict[str, Any], slo_ms: float) -> str:
    def ms(key: str) -> str:
        value = result.get(key)
        return "-" if value is None else f"{value:.0f}" if value >= 10 else f"{value:.1f}"

    sent = result["completed"] + result["failed"]
    other = result["failed"] - result["refused"]
    p99 = result.get("p99_ttft_ms")
    within = "-" if p99 is None else f"{p99 / slo_ms:.2f}×"
    return (f"| {mode} | {sent} | {result['completed']} | {result['refused']} | {other} | "
            f"{ms('median_ttft_ms')} | {ms('p99_ttft_ms')} ({within} SLO) | "
            f"{ms('median_tpot_ms')} | {ms('median_refusal_ms')} | {ms('p99_refusal_ms')} | "
            f"{result['request_throughput']:.2f} | {result['request_goodput']:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--load-factor", type=float, default=3.0)
    parser.add_argument("--max-running", type=int, default=8)
    parser.add_argument("--queue", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--ttft-slo-ms", type=float, default=None)
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--result-dir", type=Path, default=None)
    args = parser.parse_args()
    out = args.result_dir or Path(tempfile.mkdtemp(prefix="llmesh-overload-"))
    out.mkdir(parents=True, exist_ok=True)

    with start_mesh(args, out / "mesh-on", admission=True) as mesh:
        bench(mesh, args, out / "warmup.json", "--max-concurrency", str(args.max_running),
              "--num-prompts", str(args.max_running))
        closed = bench(mesh, args, out / "sustainable.json", "--max-concurrency",
                       str(args.max_running), "--num-prompts", str(4 * args.max_running))
        sustainable = closed["request_throughput"]
        slo_ms = args.ttft_slo_ms or closed["median_e2el_ms"]
        rate = args.load_factor * sustainable
        print(f"sustainable {sustainable:.2f} req/s ({args.max_running} closed-loop clients, "
              f"TTFT p50 {closed['median_ttft_ms']:.0f} ms, e2e p50 "
              f"{closed['median_e2el_ms']:.0f} ms); offering {rate:.2f} req/s Poisson for "
              f"{args.duration:g} s; TTFT SLO {slo_ms:.0f} ms; load {load_average()}",
              flush=True)
        on = overload_run(mesh, args, out / "admission-on.json", rate, slo_ms)
        load_on = load_average()
    with start_mesh(args, out / "mesh-off", admission=False) as mesh:
        bench(mesh, args, out / "warmup-off.json", "--max-concurrency", str(args.max_running),
              "--num-prompts", str(args.max_running))
        off = overload_run(mesh, args, out / "admission-off.json", rate, slo_ms)
        load_off = load_average()

    print(f"\n{args.input_len} prompt + {args.output_len} output tokens, {args.max_running} "
          f"running, router queue {args.queue}; offered {rate:.2f} req/s = "
          f"{args.load_factor:g} × {sustainable:.2f}; TTFT SLO {slo_ms:.0f} ms\n")
    print("| admission | sent | completed | refused | other failures | TTFT p50 ms | "
          "TTFT p99 ms | TPOT p50 ms | refusal p50 ms | refusal p99 ms | req/s | "
          "goodput req/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    print(row("on", on, slo_ms))
    print(row("off", off, slo_ms))
    print(f"\nload after each run: on {load_on}, off {load_off}; errors: on "
          f"{on['errors_by_status']}, off {off['errors_by_status']}; results in {out}")


if __name__ == "__main__":
    main()
