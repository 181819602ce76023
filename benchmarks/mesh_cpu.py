"""CPU the mesh's non-engine processes spend per output token, at a given concurrency.

Starts the mesh here (``llmesh up``'s launcher, free ports), runs
``llmesh bench`` (random prompts, EOS ignored) through Envoy's ingress at
``--concurrency`` streams, and reads each process's user + system CPU time from
``/proc/PID/stat`` before and after. Prints CPU seconds per 1,000 output tokens
for router, tokenizer, cache, Envoy and engine, and the bench's own summary line.

Usage: ``python benchmarks/mesh_cpu.py [--concurrency 16] [--num-prompts 64]
[--input-len 128] [--output-len 64]``. Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from services.cli.mesh import Mesh

_TICKS = os.sysconf("SC_CLK_TCK")
#: The processes whose CPU is the mesh's own cost per token (issue 13's sum).
MESH_OVERHEAD = ("router", "tokenizer", "envoy")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` (its threads included) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    with Mesh(ingress_port=0, admin_port=0,
              run_dir=tempfile.mkdtemp(prefix="llmesh-cpu-")) as mesh:
        host, port = mesh.ingress_address.rsplit(":", 1)
        bench = [sys.executable, "-m", "services.cli.main", "bench", "--host", host,
                 "--port", port, "--dataset-name", "random",
                 "--random-input-len", str(args.input_len),
                 "--random-output-len", str(args.output_len), "--ignore-eos",
                 "--max-concurrency", str(args.concurrency), "--num-warmups", "0"]
        pids = mesh.pids()
        # Warm every path first; the measured run then holds exactly its requests.
        subprocess.run([*bench, "--num-prompts", "4"], check=True, capture_output=True)
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        done = subprocess.run([*bench, "--num-prompts", str(args.num_prompts)], check=True,
                              capture_output=True, text=True)
        after = {name: cpu_seconds(pid) for name, pid in pids.items()}
    tokens = args.num_prompts * args.output_len
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    print(f"c{args.concurrency}: {args.num_prompts} requests x {args.output_len} output tokens "
          f"= {tokens} tokens; load {load}")
    overhead = 0.0
    for name in sorted(pids):
        per_1k = (after[name] - before[name]) / tokens * 1e3
        if name in MESH_OVERHEAD:
            overhead += per_1k
        print(f"  {name:<10} {per_1k:6.3f} CPU-s per 1,000 output tokens")
    print(f"  router + tokenizer + envoy: {overhead:.3f}")
    summary = [line for line in done.stdout.splitlines() if "throughput" in line.lower()]
    print("\n".join(summary[:6]))


if __name__ == "__main__":
    main()
