"""A pytest plugin: wall and CPU time per test file, CPU counted over the
whole process tree (the pytest process, the services and meshes it started,
their children), so that a suite's cost can be read on a machine that others
load too (wall time there measures the neighbours; CPU time much less so,
though threads that spin while waiting for a core still add some).

Use: ``python -m pytest -p tools.pytest_cputime --cpu-durations=30 ...`` prints
the 30 costliest files by CPU after the run (setup and teardown included:
a module's mesh counts where it starts, a session fixture's start in the first
file that asks for it); ``--cpu-durations-file=PATH`` also appends one JSON
line per test phase (``{"id", "phase", "wall_s", "cpu_s"}``) to PATH.

CPU of a phase: the change in user+sys seconds of this process, of its reaped
children (``os.times``) and of every live descendant with its own reaped
children (``/proc/<pid>/stat``, Linux), from the phase's start to its end.
A descendant that exits and is reaped by a process outside the tree is lost.
"""

from __future__ import annotations

import collections
import json
import os
import time
from pathlib import Path
from typing import IO, Any

import pytest

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def _proc_stat(pid: str) -> tuple[int, float] | None:
    """(parent pid, user+sys+children's user+sys seconds) of ``pid``; None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
    ticks = sum(int(fields[i]) for i in (11, 12, 13, 14))  # utime stime cutime cstime
    return int(fields[1]), ticks * _TICK_S


def tree_cpu_seconds(root: int | None = None) -> float:
    """User+sys seconds of process ``root`` (default: this one), its reaped
    children and its live descendants with theirs."""
    root = os.getpid() if root is None else root
    stats = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (stat := _proc_stat(entry.name)) is not None:
            stats[int(entry.name)] = stat
    children: dict[int, list[int]] = collections.defaultdict(list)
    for pid, (ppid, _) in stats.items():
        children[ppid].append(pid)
    if root == os.getpid():
        own = os.times()
        total = own.user + own.system + own.children_user + own.children_system
    else:
        total = stats[root][1] if root in stats else 0.0
    stack = list(children[root])
    while stack:
        pid = stack.pop()
        total += stats[pid][1]
        stack.extend(children[pid])
    return total


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("cputime", "CPU time per test file (tools/pytest_cputime.py)")
    group.addoption("--cpu-durations", type=int, default=0, metavar="N",
                    help="print the N costliest test files by process-tree CPU seconds")
    group.addoption("--cpu-durations-file", default=None, metavar="PATH",
                    help="append one JSON line per test phase (wall_s, cpu_s) to PATH")


class CpuTimes:
    """Wall and CPU seconds per test phase, summed per file."""

    def __init__(self, lines: IO[str] | None) -> None:
        self._lines = lines
        self.by_file: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])

    def _phase(self, item: pytest.Item, phase: str) -> Any:
        wall, cpu = time.monotonic(), tree_cpu_seconds()
        yield
        wall, cpu = time.monotonic() - wall, tree_cpu_seconds() - cpu
        totals = self.by_file[item.nodeid.split("::", 1)[0]]
        totals[0] += wall
        totals[1] += cpu
        if self._lines is not None:
            self._lines.write(json.dumps({"id": item.nodeid, "phase": phase,
                                          "wall_s": round(wall, 3), "cpu_s": round(cpu, 3)})
                              + "\n")
            self._lines.flush()

    def close(self) -> None:
        if self._lines is not None:
            self._lines.close()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Any:
        yield from self._phase(item, "setup")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Any:
        yield from self._phase(item, "call")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Any:
        yield from self._phase(item, "teardown")


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("cpu_durations_file")
    if config.getoption("cpu_durations") or path:
        lines = open(path, "a", encoding="utf-8") if path else None  # noqa: SIM115
        config.pluginmanager.register(CpuTimes(lines), "cputime")


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    times: CpuTimes | None = config.pluginmanager.get_plugin("cputime")
    count = config.getoption("cpu_durations")
    if times is None or not count:
        return
    rows = sorted(times.by_file.items(), key=lambda kv: -kv[1][1])
    cpu = sum(c for _, c in times.by_file.values())
    wall = sum(w for w, _ in times.by_file.values())
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    terminalreporter.write_sep("=", f"costliest {min(count, len(rows))} files by CPU")
    terminalreporter.write_line(f"all files: {cpu:.1f} CPU-s, {wall:.1f} s wall "
                                f"(load average now {load})")
    for name, (file_wall, file_cpu) in rows[:count]:
        terminalreporter.write_line(f"{file_cpu:8.1f} CPU-s {file_wall:8.1f} s wall  {name}")


def pytest_unconfigure(config: pytest.Config) -> None:
    times: CpuTimes | None = config.pluginmanager.get_plugin("cputime")
    if times is not None:
        times.close()
