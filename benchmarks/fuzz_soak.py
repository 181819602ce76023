"""Fuzz soak (not CI): many more cases of tests/e2e/fuzz_strategies.py (the
same strategies as tests/e2e/test_mesh_fuzz.py) against a mesh it starts, or
a running one (``--url`` with ``--run-dir``), with the same checks: no
INTERNAL / UNKNOWN / bad 5xx, every call ends within its deadline, no
service restarts (PIDs unchanged), every service SERVING at the end.

Usage::

    python -m benchmarks.fuzz_soak --cases 100000 [--seed N]

Prints outcome counts and the first failures (with their cases); exit status
1 when any case failed.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import seed as seeded

from benchmarks.soak import services_from_run_dir
from tests.e2e.fuzz_strategies import Target, cases, check, run_case
from tests.e2e.hostile_checks import serving


def fuzz(ingress: str, services: dict[str, tuple[int, str]], *, count: int,
         seed: int) -> int:
    """Runs ``count`` cases; returns the number of failures (printed)."""
    target = Target(ingress)
    outcomes: collections.Counter[str] = collections.Counter()
    failures: list[str] = []
    started = time.monotonic()

    @settings(max_examples=count, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def one(case: tuple[str, object]) -> None:
        result = run_case(target, case)
        outcomes[f"{result.kind}:{result.outcome}"] += 1
        why = check(result)
        if why is not None:
            failures.append(f"{why}\n  case: {repr(case)[:600]}")
            print(f"failure {len(failures)}: {failures[-1]}", flush=True)
        done = sum(outcomes.values())
        if done % 1000 == 0:
            print(f"{done} cases, {time.monotonic() - started:.0f} s, "
                  f"{len(failures)} failures", flush=True)

    seeded(seed)(one)()
    target.close()
    for name, (pid, address) in services.items():
        if not Path(f"/proc/{pid}").exists():
            failures.append(f"{name} (pid {pid}) is gone: it restarted or died")
        elif not serving(address):
            failures.append(f"{name} is not SERVING")
    print(dict(sorted(outcomes.items())))
    print(f"{sum(outcomes.values())} cases in {time.monotonic() - started:.0f} s; "
          f"{len(failures)} failures")
    for failure in failures[:30]:
        print(failure)
    return len(failures)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--url", help="ingress host:port of a running mesh (with --run-dir)")
    parser.add_argument("--run-dir", type=Path, help="the running mesh's run directory")
    args = parser.parse_args(argv)
    if args.url:
        if args.run_dir is None:
            parser.error("--url needs --run-dir (for the services' PIDs and ports)")
        found, _ = services_from_run_dir(args.run_dir)
        services = {s.name: (s.pid, s.address) for s in found}
        return 1 if fuzz(args.url, services, count=args.cases, seed=args.seed) else 0
    from services.cli.mesh import Mesh
    with Mesh(ingress_port=0, admin_port=0,
              engine_args=["--max-model-len", "512"]) as mesh:
        services = {n: (s.pid, s.grpc_address) for n, s in mesh.services.items()}
        return 1 if fuzz(mesh.ingress_address, services, count=args.cases,
                         seed=args.seed) else 0


if __name__ == "__main__":
    sys.exit(main())
