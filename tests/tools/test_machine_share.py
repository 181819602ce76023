"""tests/machine_share.py: under pytest-xdist a ``whole_machine`` test runs
alone, and the other workers' next tests cannot starve it."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from tests.machine_share import machine_share


def test_a_whole_machine_test_waits_for_the_running_one_and_goes_before_later_ones(
        tmp_path: Path) -> None:
    """A runs (a share); B asks for the whole machine, C for a share after it:
    B enters only when A has left, and C only when B has (each ``with`` opens
    the lock files anew, as the workers' processes do)."""
    log: list[str] = []
    a_in, a_may_leave = threading.Event(), threading.Event()

    def test(name: str, whole: bool, hold: threading.Event | None = None) -> None:
        with machine_share(tmp_path, whole):
            log.append(f"{name} in")
            if name == "A":
                a_in.set()
            if hold is not None:
                hold.wait(10)
            time.sleep(0.05)
            log.append(f"{name} out")

    a = threading.Thread(target=test, args=("A", False, a_may_leave))
    a.start()
    assert a_in.wait(10)
    b = threading.Thread(target=test, args=("B", True))
    b.start()
    time.sleep(0.2)  # B waits for A, holding the turnstile
    c = threading.Thread(target=test, args=("C", False))
    c.start()
    time.sleep(0.2)  # C waits behind B
    assert log == ["A in"]
    a_may_leave.set()
    for thread in (a, b, c):
        thread.join(10)
    assert log == ["A in", "A out", "B in", "B out", "C in", "C out"]


def test_shares_run_side_by_side(tmp_path: Path) -> None:
    with machine_share(tmp_path, False), machine_share(tmp_path, False):
        pass  # a second share while the first is held: no wait
