"""Fuzz soak (not CI): many more cases of tests/e2e/fuzz_strategies.py (the
same strategies as tests/e2e/test_mesh_fuzz.py) against a mesh it starts, or
a running one (``--url`` with ``--run-dir``), with the same checks: no
INTERNAL / UNKNOWN / bad 5xx, every call ends within its deadline; and every
``--check-every`` cases (default 1,000) and at the end, that every process
of the mesh, Envoy included, still runs under the PID it had at the start
(nothing died or restarted), each service answers SERVING and Envoy's
``/ready`` 200. A problem is printed when it is seen, with the case count.

Usage::

    python -m benchmarks.fuzz_soak --cases 100000 [--seed N] [--check-every 1000]

Prints outcome counts and the first failures (with their cases); exit status
1 when any case or check failed.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import seed as seeded

from tests.e2e.fuzz_strategies import MESH_ENGINE_ARGS, Target, cases, check, run_case
from tests.e2e.hostile_checks import Watched, problems, watched, watched_from_run_dir

#: Cases between two checks of the mesh's processes (PIDs, health).
CHECK_EVERY = 1000


def fuzz(ingress: str, processes: list[Watched], *, count: int, seed: int,
         check_every: int = CHECK_EVERY) -> int:
    """Runs ``count`` cases, checking ``processes`` (:func:`problems`) every
    ``check_every`` cases and at the end; returns the number of failures
    (each printed when seen)."""
    target = Target(ingress)
    outcomes: collections.Counter[str] = collections.Counter()
    failures: list[str] = []
    started = time.monotonic()

    def check_processes(done: int) -> None:
        for problem in problems(processes):
            failures.append(f"after {done} cases: {problem}")
            print(f"failure {len(failures)}: {failures[-1]}", flush=True)

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
        if done % check_every == 0:
            check_processes(done)
            print(f"{done} cases, {time.monotonic() - started:.0f} s, "
                  f"{len(failures)} failures", flush=True)

    seeded(seed)(one)()
    target.close()
    check_processes(sum(outcomes.values()))
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
    parser.add_argument("--check-every", type=int, default=CHECK_EVERY,
                        help="cases between two checks of PIDs and health (default %(default)s)")
    args = parser.parse_args(argv)
    if args.check_every < 1:
        parser.error("--check-every must be >= 1")
    if args.url:
        if args.run_dir is None:
            parser.error("--url needs --run-dir (for the processes' PIDs and ports)")
        processes, _ = watched_from_run_dir(args.run_dir)
        if not any(p.name == "envoy" for p in processes):
            parser.error(f"no Envoy runs {args.run_dir / 'envoy.yaml'}")
        return 1 if fuzz(args.url, processes, count=args.cases, seed=args.seed,
                         check_every=args.check_every) else 0
    from services.cli.mesh import Mesh
    with Mesh(ingress_port=0, admin_port=0, engine_args=MESH_ENGINE_ARGS) as mesh:
        return 1 if fuzz(mesh.ingress_address, watched(mesh), count=args.cases,
                         seed=args.seed, check_every=args.check_every) else 0


if __name__ == "__main__":
    sys.exit(main())
