"""The router's start to SERVING, with prompt ids made in the router (the
default: its tokenizer loads in the background) and without
(``--no-tokenize-in-router``), interleaved.

One mesh (``llmesh up`` on free ports, SmolLM2) is started once; then its
router is restarted ``--rounds`` times per setting, the settings alternating
(on, off, off, on, …: the order flips every round) on the same engine and
tokenizer (``Mesh.restart_router``). Per start: seconds from the router
process's creation (``/proc``, via psutil) to gRPC health SERVING (what a
supervisor, Envoy's health check or a drain test waits for), and with the
default also to ``llmesh:router_tokenizer_in_process`` = 1 (prompt ids in
process from then on). Prints the median over the rounds with the
interquartile range and the load average before and after.

Usage: ``flock -x /tmp/llmesh-cpu.lock python benchmarks/router_start.py
[--rounds 5]``. Not a test: numbers depend on the machine (2 cores here).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mesh_latency import _stat  # noqa: E402
from services.cli.mesh import Mesh  # noqa: E402

SETTINGS = {"on (default)": [], "off (--no-tokenize-in-router)": ["--no-tokenize-in-router"]}


def _start(mesh: Mesh, router_args: list[str]) -> tuple[float, float | None]:
    """Restarts the router; (creation → SERVING, creation → prompt ids in
    process or None with the flag off), seconds."""
    mesh.restart_router(router_args)
    serving_at = time.time()
    created = psutil.Process(mesh.router.pid).create_time()
    if "--no-tokenize-in-router" in router_args:
        return serving_at - created, None
    mesh.wait_prompts_in_router()
    return serving_at - created, time.time() - created


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="starts per setting (default: 5)")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()}", flush=True)
    serving: dict[str, list[float]] = {name: [] for name in SETTINGS}
    in_process: list[float] = []
    with Mesh(ingress_port=0, admin_port=0, drain_seconds=1.0,
              run_dir=tempfile.mkdtemp(prefix="llmesh-router-start-")) as mesh:
        for round_ in range(args.rounds):
            order = list(SETTINGS) if round_ % 2 == 0 else list(reversed(SETTINGS))
            for name in order:
                to_serving, to_local = _start(mesh, SETTINGS[name])
                serving[name].append(to_serving)
                if to_local is not None:
                    in_process.append(to_local)
                print(f"round {round_ + 1} {name}: SERVING {to_serving:.2f} s"
                      + (f", prompt ids in process {to_local:.2f} s" if to_local else ""),
                      flush=True)
    print("router process created → ..., median [p25-p75] of the rounds:")
    for name, values in serving.items():
        med, q1, q3 = _stat(values)
        print(f"  {name:<32} SERVING {med:.2f} s [{q1:.2f}-{q3:.2f}]")
    med, q1, q3 = _stat(in_process)
    print(f"  {'on (default)':<32} prompt ids in process {med:.2f} s [{q1:.2f}-{q3:.2f}]")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
