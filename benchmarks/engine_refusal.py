"""How long a refused engine start takes: ``python -m services.engine`` with a
bad flag or a broken ``--model-path``, wall and CPU seconds (user + sys of the
child) to its one-line error, one start at a time.

Example (this tree against another checkout, interleaved)::

    flock -x /tmp/llmesh-cpu.lock python benchmarks/engine_refusal.py \\
        --repo . --repo /tmp/old-checkout --rounds 5

Prints, per repository and case, the median and p90 of wall and CPU seconds,
and the load averages before and after. Not a test: see docs/bench.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

#: Case → engine arguments (each refused before a port is bound).
CASES: dict[str, list[str]] = {
    "no such model path": ["--model-path", "/nonexistent/model.gguf"],
    "bad flag value": ["--num-speculative-tokens", "17"],
    "contradicting flags": ["--quantization", "int4", "--dtype", "bfloat16"],
}


def refuse_once(repo: Path, argv: list[str]) -> tuple[float, float]:
    """Wall and CPU seconds of one refused start from ``repo``.

    Raises:
      RuntimeError: the engine did not exit with code 2.
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), str(repo / "services/gen")])}
    before = os.times()
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "services.engine", "--port", "0", *argv],
                          cwd=repo, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - began
    after = os.times()
    if done.returncode != 2:
        raise RuntimeError(f"{repo} {argv}: exit {done.returncode}: {done.stderr[-500:]}")
    cpu = (after.children_user - before.children_user) + (after.children_system
                                                          - before.children_system)
    return wall, cpu


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``values``, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, action="append",
                        help="checkout to start the engine from (repeatable; default: this one)")
    parser.add_argument("--rounds", type=int, default=5, help="starts per repository and case")
    args = parser.parse_args(argv)
    repos = [repo.resolve() for repo in (args.repo or [Path(__file__).resolve().parents[1]])]
    print(f"load average before: {os.getloadavg()}")
    samples: dict[tuple[Path, str], list[tuple[float, float]]] = {}
    for _ in range(args.rounds):  # interleaved: each round runs every repository and case
        for case, case_argv in CASES.items():
            for repo in repos:
                samples.setdefault((repo, case), []).append(refuse_once(repo, case_argv))
    print(f"{'repository':<32} {'case':<22} {'wall p50':>9} {'wall p90':>9} "
          f"{'cpu p50':>8} {'cpu p90':>8}")
    for (repo, case), runs in samples.items():
        walls, cpus = [w for w, _ in runs], [c for _, c in runs]
        print(f"{str(repo)[-32:]:<32} {case:<22} {statistics.median(walls):9.3f} "
              f"{percentile(walls, 0.9):9.3f} {statistics.median(cpus):8.3f} "
              f"{percentile(cpus, 0.9):8.3f}")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
