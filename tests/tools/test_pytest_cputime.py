"""tools/pytest_cputime.py: a child process's CPU is counted to the test
file that started it, per phase, and the costliest files are printed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tools.pytest_cputime import tree_cpu_seconds

ROOT = Path(__file__).resolve().parents[2]
#: A child that burns this many CPU-seconds, then exits (reaped by its parent).
BURN = "import time\nend = time.process_time() + {s}\nwhile time.process_time() < end: pass\n"


def test_a_live_descendant_counts() -> None:
    def others() -> float:  # the tree's CPU less this process's own (the polling's)
        own = os.times()
        return tree_cpu_seconds() - own.user - own.system

    before = others()
    child = subprocess.Popen([sys.executable, "-c", BURN.format(s=0.6) + "input()"],
                             stdin=subprocess.PIPE)
    deadline = time.monotonic() + 30
    try:  # counted while it runs (it then waits for input), before any reaping
        while others() - before < 0.5:
            assert child.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        child.communicate(b"\n", timeout=30)


def test_each_file_gets_its_children_cpu(tmp_path: Path) -> None:
    (tmp_path / "test_busy.py").write_text(textwrap.dedent(f"""
        import subprocess, sys
        def test_burns():
            subprocess.run([sys.executable, "-c", {BURN.format(s=1.0)!r}], check=True)
        """))
    (tmp_path / "test_idle.py").write_text("def test_nothing():\n    pass\n")
    lines = tmp_path / "phases.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
         "tools.pytest_cputime", "--cpu-durations=5", f"--cpu-durations-file={lines}",
         "-o", "addopts=", "-o", f"pythonpath={ROOT}", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    phases = [json.loads(line) for line in lines.read_text().splitlines()]
    assert [(Path(p["id"].split("::")[0]).name, p["phase"]) for p in phases] == [
        (name, phase) for name in ("test_busy.py", "test_idle.py")
        for phase in ("setup", "call", "teardown")]
    call = {Path(p["id"].split("::")[0]).name: p["cpu_s"] for p in phases if p["phase"] == "call"}
    assert call["test_busy.py"] >= 0.9 and call["test_idle.py"] < 0.3, call
    summary = done.stdout.split("costliest 2 files by CPU", 1)[1].splitlines()
    assert "CPU-s" in summary[1] and "load average now" in summary[1]
    assert summary[2].endswith("test_busy.py") and summary[3].endswith("test_idle.py")
