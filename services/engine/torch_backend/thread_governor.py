"""The step's compute threads sized to the cores the engine really gets.

An OpenMP team whose threads outnumber the free cores falls off a cliff: a
thread that reaches a barrier spins there while a teammate waits for the core
another process holds, and every parallel region of the step (hundreds) waits
out a scheduler time slice. On 2 cores with one busy process beside it the
mesh decoded 30-55x slower instead of ~2x (issue 31); the engine alone, in
process, 4-5x slower (measured 2026-12-06, docs/bench.md). The governor watches
the kernel's accounting (:mod:`~services.engine.torch_backend.cpu_accounting`)
in windows of :data:`WINDOW_S` of the engine's own steps and sets the thread
count (``torch.set_num_threads``, which the native kernels' OpenMP team
follows) between 1 and a ceiling:

* **ceiling**: ``--num-threads`` (else torch's default, one per CPU), lowered
  to the cgroup's CPU quota rounded down (1.5 CPUs: 1 thread), read at start
  and at every window (a pod's quota may be resized).
* **down** (a contention event): for :data:`DOWN_WINDOWS` windows in a row the
  process's threads waited on a run queue more than :data:`WAIT_FRACTION` of
  the window per compute thread, or the cgroup throttled it more than
  :data:`THROTTLE_FRACTION` of the window, or for one window more than
  :data:`SEVERE_WAIT_FRACTION`: one thread fewer.
* **idle**: windows cover the engine's busy time only: after a gap of more
  than :data:`IDLE_GAP_S` between steps the window restarts in the next step,
  and the streaks below carry over (a client process started between two
  requests took the idle cores and kept a loop of short requests at one
  thread after a busy neighbour left; QA, issue 31).
* **inside a step**: the engine core calls :meth:`ThreadGovernor.observe_layer`
  before each layer of the forward. A step after idle that is still running
  :data:`STEP_WINDOW_START_S` after its first layer starts the window there,
  and a window closes at the first layer (or step end) :data:`WINDOW_S` after
  it began: at the cliff one step lasts seconds (a 32-token prefill took 2.9 s
  beside a busy process, and was in no window when windows started and
  closed at step ends only: the thread went after two such steps, ~4 s),
  so the decision now comes inside the first slow step, whose remaining
  layers run on the new count. A fast step reads nothing inside.
* **up**: for ``up_windows`` windows in a row the CPUs this process could have
  used (its own CPU time plus the machine's idle time, per second of window)
  reached one more than its threads (less :data:`UP_SLACK`), without
  contention: one thread more. ``up_windows`` starts at :data:`UP_WINDOWS`
  and doubles (to :data:`MAX_UP_WINDOWS`) each time a step up is undone within
  :data:`REVERT_WINDOWS` windows, and returns to :data:`UP_WINDOWS` once a
  step up has held that long (hysteresis: no flapping around a noisy
  neighbour).
* **up across idle** (:meth:`ThreadController.idle_room`): a window never
  closes under sparse traffic (one short request at a time: each step
  follows a gap, and the window restarts there), so after one transient
  contention event (the mesh's own first requests after start: a 0.49
  run-queue wait in one window, 2026-12-07) an engine serving such traffic
  stayed at one thread for good: TTFT ~20 ms instead of ~14 on this VM. So
  the span from the last window's start to the end of the first step after a
  gap (at least :data:`WINDOW_S` long) counts as one roomy window when the
  CPUs this process could have used reached one more than its threads and
  its own threads did not wait; a span without room changes nothing (a
  client starting in the gap neither counts nor breaks the streak), and a
  span never counts as contention.

:class:`ThreadController` is the decision (pure, fed :class:`CPUSample`);
:class:`ThreadGovernor` reads the sources, applies the decision on the engine
thread and logs each change once. Threading: the engine thread only.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from services.engine.torch_backend.cpu_accounting import (
    PROC,
    CgroupCPU,
    find_cgroup_cpu,
    idle_cpu_s,
    thread_times,
)
from services.engine.types import StepStats

log = structlog.get_logger()

#: Seconds of wall time per window (measured after the step that ends it).
WINDOW_S = 0.2
#: Run-queue wait per compute thread, as a fraction of the window, that marks
#: contention. Two spinning threads and one busy process on two cores wait
#: about a third each (measured 0.45-0.74 per thread); the mesh's own
#: processes beside the engine on a quiet 2-core machine measured 0.18.
WAIT_FRACTION = 0.25
#: Run-queue wait per compute thread that drops a thread after one window: a
#: step at the cliff lasts about a window (measured 0.51-0.53 there).
SEVERE_WAIT_FRACTION = 0.4
#: cgroup throttled time, as a fraction of the window, that marks contention.
THROTTLE_FRACTION = 0.05
#: Contended windows in a row before a thread is dropped.
DOWN_WINDOWS = 2
#: Spare-CPU windows in a row before a thread is added (at first).
UP_WINDOWS = 5
#: The most windows a step up may wait for (after repeated reversals).
MAX_UP_WINDOWS = 80
#: A step down within this many windows of a step up undoes it.
REVERT_WINDOWS = 25
#: CPUs short of a whole one that still count as room for one more thread.
UP_SLACK = 0.25
#: Seconds without a step after which the engine counts as having been idle:
#: the window restarts at the next step, so that what other processes did
#: while the engine had nothing to run (a client starting between requests)
#: is neither contention nor a lack of room.
IDLE_GAP_S = 0.05
#: Seconds into a step after idle at which a window starts inside it (a step
#: that runs this long may be at the cliff; a quiet decode step is ~7 ms).
STEP_WINDOW_START_S = 0.05


@dataclass(frozen=True)
class CPUSample:
    """One window of the kernel's accounting (differences over the window).

    Attributes:
      wall_s: the window's wall time (> 0).
      run_s: CPU seconds this process's threads ran.
      wait_s: seconds this process's threads were runnable without a core.
      idle_s: CPU seconds the machine's CPUs were idle.
      throttled_s: seconds the cgroup's quota held this process back.
      quota_cpus: the cgroup's CPU quota in CPUs (None: none).
    """

    wall_s: float
    run_s: float = 0.0
    wait_s: float = 0.0
    idle_s: float = 0.0
    throttled_s: float = 0.0
    quota_cpus: float | None = None


def quota_threads(quota_cpus: float | None, ceiling: int) -> int:
    """Threads allowed under a CPU quota: ``floor(quota)``, at least 1, at most
    ``ceiling`` (no quota: ``ceiling``)."""
    if quota_cpus is None:
        return ceiling
    return max(1, min(ceiling, math.floor(quota_cpus + 1e-9)))


class ThreadController:
    """The thread-count decision (module doc); no I/O.

    Args:
      ceiling: the most threads (``--num-threads`` or torch's default), >= 1.
      quota_cpus: the cgroup's quota at start (None: none).
    """

    def __init__(self, ceiling: int, quota_cpus: float | None = None) -> None:
        self.ceiling = max(1, ceiling)
        self.threads = quota_threads(quota_cpus, self.ceiling)
        self.contention_events = 0
        self.reason = "quota" if self.threads < self.ceiling else "start"
        self._contended = 0
        self._roomy = 0
        self._up_windows = UP_WINDOWS
        self._since_up: int | None = None

    def update(self, sample: CPUSample) -> int:
        """Takes one window; returns the thread count from now on."""
        limit = quota_threads(sample.quota_cpus, self.ceiling)
        wait = sample.wait_s / (sample.wall_s * self.threads)
        contended = wait > WAIT_FRACTION or sample.throttled_s / sample.wall_s > THROTTLE_FRACTION
        severe = wait > SEVERE_WAIT_FRACTION
        available = (sample.run_s + sample.idle_s) / sample.wall_s
        self._contended = self._contended + 1 if contended else 0
        roomy = not contended and available >= self.threads + 1 - UP_SLACK
        self._roomy = self._roomy + 1 if roomy else 0
        if self._since_up is not None:
            self._since_up += 1
            if self._since_up >= REVERT_WINDOWS:  # the last step up held
                self._up_windows, self._since_up = UP_WINDOWS, None
        if self.threads > limit:
            self._set(limit, "quota")
        elif (self._contended >= DOWN_WINDOWS or severe) and self.threads > 1:
            self.contention_events += 1
            if self._since_up is not None:  # undoes a recent step up: wait longer next time
                self._up_windows = min(self._up_windows * 2, MAX_UP_WINDOWS)
                self._since_up = None
            self._set(self.threads - 1, "contention")
        elif self._roomy >= self._up_windows and self.threads < limit:
            self._set(self.threads + 1, "cores_free")
            self._since_up = 0
        return self.threads

    def idle_room(self, sample: CPUSample) -> int:
        """Takes a span that covers an idle gap (module doc, "up across idle"):
        one roomy window toward a step up when it had room for one more
        thread, nothing otherwise; returns the thread count from now on."""
        limit = quota_threads(sample.quota_cpus, self.ceiling)
        available = (sample.run_s + sample.idle_s) / sample.wall_s
        waited = sample.wait_s / (sample.wall_s * self.threads) > WAIT_FRACTION
        if self.threads >= limit or waited or available < self.threads + 1 - UP_SLACK:
            return self.threads
        self._roomy += 1
        if self._roomy >= self._up_windows:
            self._set(self.threads + 1, "cores_free")
            self._since_up = 0
        return self.threads

    def _set(self, threads: int, reason: str) -> None:
        self.threads, self.reason = threads, reason
        self._contended = self._roomy = 0


class ThreadGovernor:
    """Applies :class:`ThreadController` on the engine thread (module doc).

    The cgroup is found at start and again whenever the process's membership
    (``/proc/self/cgroup``) changes.

    Args:
      ceiling: the most threads (``--num-threads``, else torch's default).
      set_threads: applies a thread count on the engine thread.
      clock: monotonic seconds.
      proc_self: ``/proc/<pid>`` of the process whose threads are watched
        (this one; tests watch a child).
    """

    def __init__(self, ceiling: int,
                 set_threads: Callable[[int], None] = torch.set_num_threads,
                 clock: Callable[[], float] = time.monotonic,
                 proc_self: Path = PROC / "self") -> None:
        self._set_threads = set_threads
        self._clock = clock
        self._proc_self = proc_self
        self._membership = ""
        self._cgroup: CgroupCPU | None = None
        self._find_cgroup()
        quota = self._cgroup.quota_cpus() if self._cgroup is not None else None
        self.controller = ThreadController(ceiling, quota)
        self.throttled_s = 0.0
        self._window_start = clock()
        self._last = self._read()
        self._events_reported = 0
        self._throttled_reported = 0.0
        self._last_step_at: float | None = None  # the previous step's end
        self._step_at: float | None = None  # the current step's first layer
        self._opened_in_step = False  # the window started inside the current step
        set_threads(self.controller.threads)
        log.info("engine_threads", threads=self.controller.threads, ceiling=ceiling,
                 quota_cpus=quota, reason=self.controller.reason,
                 cgroup=str(self._cgroup.directory) if self._cgroup is not None else None)

    def _find_cgroup(self) -> bool:
        """Finds the process's cgroup CPU controller again if its membership
        changed (moved to another cgroup); True when it did."""
        try:
            membership = (self._proc_self / "cgroup").read_text()
        except OSError:
            membership = ""
        if membership == self._membership and self._membership:
            return False
        self._membership = membership
        self._cgroup = find_cgroup_cpu(self._proc_self)
        return True

    def _read(self) -> tuple[float, float, float, float]:
        times = thread_times(self._proc_self)
        throttled = self._cgroup.throttling().throttled_s if self._cgroup is not None else 0.0
        return times.run_s, times.wait_s, idle_cpu_s(), throttled

    def observe_layer(self) -> None:
        """Before each layer of a step's forward (module doc, "inside a step"):
        starts a window in a slow step after idle, closes one that has lasted
        :data:`WINDOW_S` and applies the decision to the layers that follow."""
        now = self._clock()
        if self._step_at is None:  # the step's first layer
            self._step_at = now
            self._opened_in_step = False
        if self._after_idle(self._step_at):
            if not self._opened_in_step and now - self._step_at >= STEP_WINDOW_START_S:
                self._window_start, self._last = now, self._read()  # the window starts here
                self._opened_in_step = True
            if not self._opened_in_step:
                return
        if now - self._window_start >= WINDOW_S:
            self._window(now)

    def observe(self, stats: StepStats) -> StepStats:
        """After each step: closes a window when :data:`WINDOW_S` has passed and
        applies the decision; returns ``stats`` with the thread count and the
        throttling and contention events since the last call."""
        now = self._clock()
        began = self._step_at if self._step_at is not None else now - stats.duration_s
        if self._after_idle(began) and not (self._step_at is not None and self._opened_in_step):
            self._restart_after_idle(now)
        elif now - self._window_start >= WINDOW_S:
            self._window(now)
        self._last_step_at, self._step_at = now, None
        controller = self.controller
        events = controller.contention_events - self._events_reported
        throttled = self.throttled_s - self._throttled_reported
        self._events_reported = controller.contention_events
        self._throttled_reported = self.throttled_s
        return dataclasses.replace(stats, num_threads=controller.threads,
                                   cpu_throttled_s=throttled, contention_events=events)

    def _after_idle(self, step_began: float) -> bool:
        """Whether the engine idled (over :data:`IDLE_GAP_S`) before the step
        that began at ``step_began``."""
        return self._last_step_at is not None and step_began - self._last_step_at > IDLE_GAP_S

    def _restart_after_idle(self, now: float) -> None:
        """At the end of the first step after a gap: the span since the last
        window's start goes to :meth:`ThreadController.idle_room` (when it
        lasted :data:`WINDOW_S`), and the next window starts here."""
        current = self._read()
        wall = now - self._window_start
        if wall >= WINDOW_S:
            run, wait, idle, _ = (c - p for c, p in zip(current, self._last))
            quota = self._cgroup.quota_cpus() if self._cgroup is not None else None
            sample = CPUSample(wall, run, wait, idle, 0.0, quota)
            before = self.controller.threads
            self._apply(before, self.controller.idle_room(sample), sample, quota)
        self._window_start, self._last = now, current

    def _window(self, now: float) -> None:
        moved = self._find_cgroup()
        quota = self._cgroup.quota_cpus() if self._cgroup is not None else None
        current = self._read()
        run, wait, idle, throttled = (c - p for c, p in zip(current, self._last))
        if moved:  # another cgroup's counters: no difference to take this time
            throttled = 0.0
            log.info("engine_cgroup", quota_cpus=quota,
                     cgroup=str(self._cgroup.directory) if self._cgroup is not None else None)
        sample = CPUSample(now - self._window_start, run, wait, idle, max(throttled, 0.0), quota)
        self._window_start, self._last = now, current
        self.throttled_s += sample.throttled_s
        before = self.controller.threads
        self._apply(before, self.controller.update(sample), sample, quota)

    def _apply(self, before: int, after: int, sample: CPUSample, quota: float | None) -> None:
        """Applies ``after``, the count the controller decided from ``sample``
        (``before``: its count until then), and logs a change once."""
        if after != before:
            self._set_threads(after)
            log.info("engine_threads", threads=after, previous=before,
                     reason=self.controller.reason,
                     run_queue_wait_per_thread=round(sample.wait_s / (sample.wall_s * before), 3),
                     available_cpus=round((sample.run_s + sample.idle_s) / sample.wall_s, 2),
                     throttled=round(sample.throttled_s / sample.wall_s, 3), quota_cpus=quota)
