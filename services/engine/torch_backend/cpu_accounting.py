"""What the kernel says about the engine's CPUs: its cgroup's CPU quota and
throttling, its threads' run-queue delay, and the machine's idle time. Read by
the thread governor (:mod:`~services.engine.torch_backend.thread_governor`).

Sources (Linux only; elsewhere every reader returns its "unknown" value):

* **cgroup CPU controller** of this process, found from ``/proc/self/cgroup``
  and ``/proc/self/mountinfo``. cgroup v2: ``cpu.max`` (``"$MAX $PERIOD"``,
  ``max`` = no quota) and ``cpu.stat`` (``nr_periods``, ``nr_throttled``,
  ``throttled_usec``). cgroup v1: ``cpu.cfs_quota_us`` (-1 = no quota) over
  ``cpu.cfs_period_us`` and ``cpu.stat`` (``nr_periods``, ``nr_throttled``,
  ``throttled_time`` in ns). See the kernel's
  Documentation/admin-guide/cgroup-v2.rst and scheduler/sched-bwc.rst.
* **schedstat** of each thread, ``/proc/self/task/<tid>/schedstat``: "time
  spent on the cpu, time spent waiting on a runqueue, timeslices run" (ns, ns,
  count; Documentation/scheduler/sched-stats.rst). Waiting on a run queue is
  being runnable without a core: the direct sign that another process holds
  the cores this process's threads want.
* **/proc/stat**'s first ``cpu`` line: idle + iowait time of all CPUs in
  clock ticks (``SC_CLK_TCK``), i.e. how many cores nobody used.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


@dataclass(frozen=True)
class Throttling:
    """A cgroup's CFS bandwidth counters (cumulative since the cgroup was made).

    Attributes:
      periods: enforcement periods that had runnable tasks.
      throttled_periods: of those, periods in which the quota ran out.
      throttled_s: seconds the cgroup's tasks were held back by the quota.
    """

    periods: int = 0
    throttled_periods: int = 0
    throttled_s: float = 0.0


@dataclass(frozen=True)
class CgroupCPU:
    """The CPU controller directory of one cgroup.

    Attributes:
      directory: the cgroup's directory (``/sys/fs/cgroup/...``).
      version: 1 (``cpu`` controller hierarchy) or 2 (unified).
    """

    directory: Path
    version: int

    def quota_cpus(self) -> float | None:
        """The CPU quota in CPUs (quota / period, e.g. 1.5); None: no quota or
        unreadable."""
        try:
            if self.version == 2:
                quota, _, period = (self.directory / "cpu.max").read_text().strip().partition(" ")
            else:
                quota = (self.directory / "cpu.cfs_quota_us").read_text().strip()
                period = (self.directory / "cpu.cfs_period_us").read_text().strip()
            if quota == "max" or int(quota) < 0 or int(period or 100_000) <= 0:
                return None
            return int(quota) / int(period or 100_000)
        except (OSError, ValueError):
            return None

    def throttling(self) -> Throttling:
        """The throttling counters (all 0 where unreadable)."""
        try:
            fields = dict(line.split(maxsplit=1)
                          for line in (self.directory / "cpu.stat").read_text().splitlines()
                          if " " in line)
            if self.version == 2:
                throttled_s = int(fields.get("throttled_usec", 0)) / 1e6
            else:
                throttled_s = int(fields.get("throttled_time", 0)) / 1e9
            return Throttling(int(fields.get("nr_periods", 0)),
                              int(fields.get("nr_throttled", 0)), throttled_s)
        except (OSError, ValueError):
            return Throttling()


def find_cgroup_cpu(proc_self: Path = PROC / "self") -> CgroupCPU | None:
    """This process's cgroup CPU controller: the v1 ``cpu`` hierarchy where one
    is mounted, else the v2 unified one where it has ``cpu.max``; None when
    neither is found (no cgroups, not Linux, the controller not enabled).

    Args:
      proc_self: ``/proc/<pid>`` of the process (its ``cgroup`` and ``mountinfo``).
    """
    try:
        memberships = (proc_self / "cgroup").read_text().splitlines()
        mounts = (proc_self / "mountinfo").read_text().splitlines()
    except OSError:
        return None
    v1_path = v2_path = None
    for line in memberships:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            v2_path = path
        elif "cpu" in controllers.split(","):
            v1_path = path
    for fields in (mount.split() for mount in mounts):
        if "-" not in fields:
            continue
        separator = fields.index("-")
        root, mount_point = fields[3], Path(fields[4])
        fstype, options = fields[separator + 1], fields[separator + 3].split(",")
        if fstype == "cgroup" and "cpu" in options and v1_path is not None:
            return CgroupCPU(_inside(mount_point, root, v1_path), 1)
        if fstype == "cgroup2" and v2_path is not None and v1_path is None:
            directory = _inside(mount_point, root, v2_path)
            if (directory / "cpu.max").exists():
                return CgroupCPU(directory, 2)
    return None


def _inside(mount_point: Path, mount_root: str, cgroup_path: str) -> Path:
    """The directory of ``cgroup_path`` under a mount of ``mount_root`` (a
    container sees its own cgroup as the mount's root)."""
    relative = os.path.relpath(cgroup_path, mount_root) if mount_root != "/" else cgroup_path
    relative = relative.lstrip("/")
    return mount_point if relative in ("", ".") else mount_point / relative


@dataclass(frozen=True)
class ThreadTimes:
    """The summed schedstat of a process's threads (cumulative).

    Attributes:
      run_s: seconds its threads ran on a CPU.
      wait_s: seconds its threads were runnable but waited on a run queue.
    """

    run_s: float = 0.0
    wait_s: float = 0.0


def thread_times(proc_self: Path = PROC / "self") -> ThreadTimes:
    """The summed schedstat of every thread of the process (threads that end
    between the listing and the read are skipped; zeros where there is no
    schedstat). Plain ``os`` calls: a few microseconds a thread."""
    run_ns = wait_ns = 0
    task_dir = f"{proc_self}/task"
    try:
        tasks = os.listdir(task_dir)
    except OSError:
        return ThreadTimes()
    for task in tasks:
        try:
            fd = os.open(f"{task_dir}/{task}/schedstat", os.O_RDONLY)
            try:
                run, wait, _ = os.read(fd, 128).split()
            finally:
                os.close(fd)
        except (OSError, ValueError):
            continue
        run_ns += int(run)
        wait_ns += int(wait)
    return ThreadTimes(run_ns / 1e9, wait_ns / 1e9)


def idle_cpu_s(proc: Path = PROC) -> float:
    """Seconds all CPUs of the machine spent idle (idle + iowait), cumulative;
    0 where ``/proc/stat`` is unreadable."""
    try:
        with open(proc / "stat") as stat:
            fields = stat.readline().split()
        return (int(fields[4]) + int(fields[5])) * _TICK_S
    except (OSError, ValueError, IndexError):
        return 0.0
