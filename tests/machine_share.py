"""The machine shared between the workers of a pytest-xdist run (see
tests/conftest.py's ``pytest_runtest_protocol``)."""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def machine_share(folder: Path, whole: bool) -> Iterator[None]:
    """The machine shared between pytest-xdist workers: ``whole`` waits until
    no other test runs and keeps the others out until it ends; otherwise a
    share beside the others. Two file locks in ``folder`` (the run's temp
    folder, above every worker's): the share (``flock`` shared or exclusive)
    and a turnstile taken on the way in, which a test waiting for the whole
    machine holds while it waits, so that the other workers' next tests cannot
    starve it."""
    with open(folder / "machine.turnstile", "a") as turnstile, \
            open(folder / "machine.share", "a") as share:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(share, fcntl.LOCK_EX if whole else fcntl.LOCK_SH)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(share, fcntl.LOCK_UN)
