"""Counts the long functions in ``services/`` (issue 32's measure of overfull code).

Usage: ``python tools/code_stats.py [--limit 60] [--top 10] [ROOT]``

Prints how many functions (and methods, nested ones included) span more than
``--limit`` lines (from the ``def`` line to the last line of the body,
docstring and comments included), then the longest ``--top`` of them as
``lines  path:line  qualified.name``. Generated code (``services/gen``) is
not counted, nor are the two kinds of function that are long by nature and
read as tables:

* argument-parser builders: functions that take or return an
  ``ArgumentParser``, or call ``add_argument`` 5 times or more;
* metric declarations: functions making 5 or more Prometheus metrics
  (``Counter``, ``Gauge``, ``Histogram``, ``Summary``, ``Info``, ``Enum``).

Exit status 0; the count is the first line of the output, for scripts. A
negative ``--limit``/``--top`` or a ROOT that is not a directory is refused
with argparse's usage error (exit status 2).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_METRIC_TYPES = frozenset({"Counter", "Gauge", "Histogram", "Summary", "Info", "Enum"})
#: Calls at or above which a function counts as a table (parser or metrics).
_TABLE_CALLS = 5
_EXCLUDED_DIRS = frozenset({"gen", "__pycache__"})


@dataclass(frozen=True)
class Function:
    """One function: its length in lines, file, first line and qualified name."""

    lines: int
    path: Path
    lineno: int
    name: str


def _called_name(call: ast.Call) -> str:
    func = call.func
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def _is_table(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """True for an argument-parser builder or a metric declaration."""
    signature = [a.annotation for a in node.args.args] + [node.returns]
    if any(n is not None and "ArgumentParser" in ast.unparse(n) for n in signature):
        return True
    names = [_called_name(n) for n in ast.walk(node) if isinstance(n, ast.Call)]
    return (names.count("add_argument") >= _TABLE_CALLS
            or sum(name in _METRIC_TYPES for name in names) >= _TABLE_CALLS)


def functions(path: Path) -> Iterator[Function]:
    """Every function and method in the Python file at ``path``, nested ones too."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))

    def visit(node: ast.AST, prefix: str) -> Iterator[Function]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = prefix + child.name
                if not _is_table(child):
                    end = child.end_lineno or child.lineno
                    yield Function(end - child.lineno + 1, path, child.lineno, name)
                yield from visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from visit(child, prefix + child.name + ".")

    yield from visit(tree, "")


def long_functions(root: Path, limit: int) -> list[Function]:
    """Functions in ``root``'s Python files over ``limit`` lines, longest first."""
    found = [
        function
        for path in sorted(root.rglob("*.py"))
        if not _EXCLUDED_DIRS.intersection(path.relative_to(root).parts)
        for function in functions(path)
        if function.lines > limit
    ]
    return sorted(found, key=lambda f: (-f.lines, str(f.path), f.lineno))


def _count(text: str) -> int:
    """argparse type: a whole number >= 0 (``--top -1`` would drop the last line)."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default="services", type=Path)
    parser.add_argument("--limit", type=_count, default=60, help="lines a function may span")
    parser.add_argument("--top", type=_count, default=10, help="longest functions to list")
    args = parser.parse_args(argv)
    if not args.root.is_dir():
        parser.error(f"root {str(args.root)!r} is not a directory")
    found = long_functions(args.root, args.limit)
    lines = [f"{len(found)} functions over {args.limit} lines in {args.root}/"]
    lines += [f"{f.lines:5d}  {f.path}:{f.lineno}  {f.name}" for f in found[:args.top]]
    try:
        print("\n".join(lines), flush=True)
    except BrokenPipeError:  # e.g. piped into `head -1`: the reader has what it wanted
        sys.stdout = None  # type: ignore[assignment]  # nothing left to flush at exit
    return 0


if __name__ == "__main__":
    sys.exit(main())
