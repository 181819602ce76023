"""Fuzzing the mesh's public edges through Envoy (the suite's shared mesh):
random ``Generate`` requests and raw bodies, ``/v1/generate`` and
``/v1/chat/completions`` JSON (lone surrogates, wrong types, huge repeated
fields), ``GenerateStream`` scripts with random cancel timings. No call may
end INTERNAL / UNKNOWN or with an HTTP 5xx from a reset, every call ends
within its deadline, no service restarts (PIDs unchanged) and every one
stays SERVING. The strategies are in tests/e2e/fuzz_strategies.py (also
used by benchmarks/fuzz_soak.py for 100,000 cases).

Cost: FUZZ_CASES cases, derandomized (the same cases every run), in about
FUZZ_CASES x 35 ms on a 2-core machine (see the report in the test's output).
"""

from __future__ import annotations

import collections
import time

import pytest
from hypothesis import HealthCheck, given, settings

from services.cli.mesh import Mesh
from tests.e2e.fuzz_strategies import CaseResult, Target, cases, check, run_case
from tests.e2e.hostile_checks import not_serving, pids

pytestmark = pytest.mark.mesh

#: Cases per CI run: 2,000 (or 1,500: 68 s at load 3.3) did not fit the 60 s budget on 2 CPUs once 1 case in 7
#: really generates (~30 ms a refused case, ~60 ms a generating one, measured
#: at load ~3: 45 ms); benchmarks/fuzz_soak.py runs more.
FUZZ_CASES = 1200
#: Health of every service is checked every this many cases.
HEALTH_EVERY = 250


def test_no_fuzzed_request_crashes_hangs_or_restarts_a_service(mesh: Mesh) -> None:
    target = Target(mesh.ingress_address)
    before = pids(mesh)
    results: list[CaseResult] = []
    failures: list[str] = []
    unhealthy: list[str] = []

    @settings(max_examples=FUZZ_CASES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def one(case: tuple[str, object]) -> None:
        result = run_case(target, case)
        results.append(result)
        why = check(result)
        if why is not None and len(failures) < 20:
            failures.append(f"{why}\n  case: {repr(case)[:400]}")
        if len(results) % HEALTH_EVERY == 0:
            unhealthy.extend(not_serving(mesh))

    started = time.monotonic()
    try:
        one()
    finally:
        target.close()
    elapsed = time.monotonic() - started
    outcomes = collections.Counter(f"{r.kind}:{r.outcome}" for r in results)
    print(f"{len(results)} cases in {elapsed:.1f} s ({elapsed / len(results) * 1e3:.1f} ms "
          f"a case); slowest {max(r.seconds for r in results):.2f} s")
    print(dict(sorted(outcomes.items())))
    assert not failures, "\n".join(failures)
    assert not unhealthy, unhealthy
    assert not not_serving(mesh)
    assert pids(mesh) == before, "a service restarted"
    assert any(r.outcome == "OK" for r in results)  # some cases did generate
