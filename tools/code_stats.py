"""Counts the long functions in ``services/`` (issue 32's measure of overfull code).

Usage: ``python tools/code_stats.py [--limit 60] [--top 10] [--merges] [--engine-path] [ROOT]``

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

With ``--merges`` it also lists the merge implementations and merge buffers
(the slow-reader buffers of a token stream), found by reading the code:

* a merge function is one whose name starts with ``merge`` or ``merged``
  (a leading ``_`` allowed), e.g. ``merge_deltas``;
* a merge buffer is a function or method that calls a merge function (or a
  ``merge`` / ``_merge`` it holds) and stores the result under a key
  (``pending[key] = merge(...)``): the place pending updates wait, merged.

With ``--engine-path`` it runs :mod:`tools.engine_path` (an in-process engine
over a tiny random model and a router over it, a few seconds): the forms a
token takes from the engine core to the client (the engine's up to the wire,
then the router's up to ``GenerateResponse``), and the asyncio tasks and
queues per open request.

Exit status 0; the count is the first line of the output, for scripts. A
negative ``--limit``/``--top`` or a ROOT that is not a directory is refused
with argparse's usage error (exit status 2).
"""

from __future__ import annotations

import argparse
import ast
import re
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
    """Every function and method in the Python file at ``path``, nested ones
    too, but the tables (argument-parser builders, metric declarations)."""
    return (function for function, node in _function_nodes(path) if not _is_table(node))


_MERGE_NAME = re.compile(r"^_?merge")


def _is_merge_call(call: ast.Call) -> bool:
    return bool(_MERGE_NAME.match(_called_name(call)))


def _python_files(root: Path) -> list[Path]:
    return [path for path in sorted(root.rglob("*.py"))
            if not _EXCLUDED_DIRS.intersection(path.relative_to(root).parts)]


def merges(root: Path) -> tuple[list[Function], list[Function]]:
    """The merge functions and the merge buffers in ``root``'s Python files
    (see the module docstring), each in file order."""
    functions_found: list[Function] = []
    buffers: list[Function] = []
    for path in _python_files(root):
        for function, node in _function_nodes(path):
            if _MERGE_NAME.match(node.name):
                functions_found.append(function)
            stores = [n for n in ast.walk(node) if isinstance(n, ast.Assign)
                      and any(isinstance(t, ast.Subscript) for t in n.targets)
                      and any(isinstance(c, ast.Call) and _is_merge_call(c)
                              for c in ast.walk(n.value))]
            if stores:
                buffers.append(function)
    return functions_found, buffers


_Def = ast.FunctionDef | ast.AsyncFunctionDef


def _function_nodes(path: Path) -> Iterator[tuple[Function, _Def]]:
    """Every function and method in the file at ``path`` with its node."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))

    def visit(node: ast.AST, prefix: str) -> Iterator[tuple[Function, _Def]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = prefix + child.name
                end = child.end_lineno or child.lineno
                yield Function(end - child.lineno + 1, path, child.lineno, name), child
                yield from visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from visit(child, prefix + child.name + ".")

    yield from visit(tree, "")


def long_functions(root: Path, limit: int) -> list[Function]:
    """Functions in ``root``'s Python files over ``limit`` lines, longest first."""
    found = [function for path in _python_files(root) for function in functions(path)
             if function.lines > limit]
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
    parser.add_argument("--merges", action="store_true",
                        help="also list merge functions and merge buffers")
    parser.add_argument("--engine-path", action="store_true",
                        help="also measure a token's forms, engine core to client, and the "
                             "tasks/queues per request in an in-process engine and router "
                             "(tools/engine_path.py)")
    args = parser.parse_args(argv)
    if not args.root.is_dir():
        parser.error(f"root {str(args.root)!r} is not a directory")
    found = long_functions(args.root, args.limit)
    lines = [f"{len(found)} functions over {args.limit} lines in {args.root}/"]
    lines += [f"{f.lines:5d}  {f.path}:{f.lineno}  {f.name}" for f in found[:args.top]]
    if args.merges:
        merge_functions, buffers = merges(args.root)
        for title, listed in (("merge functions", merge_functions),
                              ("merge buffers", buffers)):
            lines.append(f"{len(listed)} {title} in {args.root}/")
            lines += [f"       {f.path}:{f.lineno}  {f.name}" for f in listed]
    if args.engine_path:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from tools import engine_path

        lines += engine_path.report(engine_path.measure())
    try:
        print("\n".join(lines), flush=True)
    except BrokenPipeError:  # e.g. piped into `head -1`: the reader has what it wanted
        sys.stdout = None  # type: ignore[assignment]  # nothing left to flush at exit
    return 0


if __name__ == "__main__":
    sys.exit(main())
