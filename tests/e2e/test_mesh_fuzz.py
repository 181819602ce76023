"""Fuzzing the mesh's public edges through Envoy (the suite's shared mesh):
random ``Generate`` requests and raw bodies, ``/v1/generate`` and
``/v1/chat/completions`` JSON (lone surrogates, wrong types, huge repeated
fields), ``GenerateStream`` scripts with random cancel timings. No call may
end INTERNAL / UNKNOWN or with an HTTP 5xx from a reset, every call ends
within its deadline, no service restarts (PIDs unchanged) and every one
stays SERVING (Envoy ready), checked every HEALTH_EVERY cases. The strategies are in tests/e2e/fuzz_strategies.py (also
used by benchmarks/fuzz_soak.py for 100,000 cases).

Cost: FUZZ_CASES cases, derandomized (the same cases every run), measured on
a 2-core machine: 33.6 s (16.8 ms a case) at load ~1.5, 140.6 s (70 ms a
case) at load ~3 with other jobs running (see the report in the test's
output).
"""

from __future__ import annotations

import collections
import time

import pytest
from hypothesis import HealthCheck, given, settings

from services.cli.mesh import Mesh
from tests.e2e.fuzz_strategies import CaseResult, Target, cases, check, run_case
from tests.e2e.hostile_checks import pids, problems, watched

pytestmark = pytest.mark.mesh

#: Cases per CI run (issue 18: ~2,000). Measured on a quiet 2-core machine:
#: ~2 ms a refused case, ~45 ms one that generates (1 in 7), ~6 ms of
#: Hypothesis per case, a stream script up to its 0.2 s pause;
#: benchmarks/fuzz_soak.py runs more.
FUZZ_CASES = 2000
#: Stream scripts whose cancel must have gone out after the first tokens
#: (the 0-200 ms pause after a start: ~1 case in 90 measured, ~20 a run).
MIN_CANCELS_AFTER_TOKENS = 10
#: Health of every service is checked every this many cases.
HEALTH_EVERY = 250


def test_no_fuzzed_request_crashes_hangs_or_restarts_a_service(mesh: Mesh) -> None:
    target = Target(mesh.ingress_address)
    before = pids(mesh)
    processes = watched(mesh)
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
            unhealthy.extend(f"after {len(results)} cases: {p}" for p in problems(processes))

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
    assert not problems(processes)
    assert pids(mesh) == before, "a service restarted"
    assert any(r.outcome == "OK" for r in results)  # some cases did generate
    after_tokens = sum(r.cancelled_after_tokens for r in results)
    print(f"stream cancels sent after the first tokens: {after_tokens}")
    assert after_tokens >= MIN_CANCELS_AFTER_TOKENS
