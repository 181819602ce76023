"""tools/code_stats.py: counts long functions, leaving out parser builders and
metric declarations."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tools.code_stats import long_functions, main, merges


def _body(lines: int) -> str:
    return "".join(f"    x{i} = {i}\n" for i in range(lines))


def test_counts_long_functions_and_methods_but_not_tables(tmp_path: Path) -> None:
    pkg = tmp_path / "svc"
    (pkg / "gen").mkdir(parents=True)
    (pkg / "a.py").write_text(
        "def short():\n" + _body(3)
        + "def long_one():\n" + _body(70)
        + "class K:\n    async def method(self):\n"
        + textwrap.indent(_body(61), "    ")
        + "def parser(p: 'argparse.ArgumentParser'):\n" + _body(80)
        + "def metrics():\n" + "".join(f"    m{i} = Counter('c{i}', '')\n" for i in range(5))
        + _body(70))
    (pkg / "gen" / "b_pb2.py").write_text("def generated():\n" + _body(100))
    found = long_functions(pkg, 60)
    assert [(f.name, f.lines) for f in found] == [("long_one", 71), ("K.method", 62)]
    assert found[0].path == pkg / "a.py" and found[0].lineno == 5


@pytest.mark.parametrize("argv", [["--top", "-1"], ["--limit", "-5"], ["no/such/root"]])
def test_refuses_negative_counts_and_missing_root(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_lists_merge_functions_and_the_buffers_that_merge_under_a_key(tmp_path: Path) -> None:
    pkg = tmp_path / "svc"
    pkg.mkdir()
    (pkg / "a.py").write_text(textwrap.dedent("""\
        def merge_updates(a, b):
            return a + b

        def _merged_per_choice(first, queue):
            merged = {0: first}
            while queue:
                merged[1] = merge_updates(merged[0], queue.pop())
            return merged

        class Mailbox:
            def put(self, key, update):
                self._pending[key] = self._merge(self._pending[key], update)

            def take(self, key):
                return self._pending.pop(key)

        def reader(x):
            return merge_updates(x, x)  # merges, stores nothing: no buffer
        """))
    found, buffers = merges(pkg)
    assert [f.name for f in found] == ["merge_updates", "_merged_per_choice"]
    assert [f.name for f in buffers] == ["_merged_per_choice", "Mailbox.put"]
