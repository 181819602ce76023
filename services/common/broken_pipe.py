"""Ending quietly when stdout's reader has gone (``llmesh generate ... | head -1``).

Unix tools die of SIGPIPE there, silently; Python ignores SIGPIPE and raises
:class:`BrokenPipeError` at the next write instead, and again at the
interpreter's last flush of stdout. A command's entry point catches the first
one, cancels what it was doing, and returns :func:`leave_quietly`'s code.
(The recipe of Python's ``signal`` docs, "Note on SIGPIPE".)
"""

from __future__ import annotations

import os
import sys

#: What a shell reports for a tool that SIGPIPE ended (128 + 13).
EXIT_CODE = 128 + 13


def leave_quietly() -> int:
    """Points stdout's file descriptor at ``/dev/null``, so that nothing written
    later (or flushed at exit) fails, and returns :data:`EXIT_CODE`. A stdout
    without a descriptor (captured in tests) is left as it is. Never raises."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # io.UnsupportedOperation is both
        pass
    return EXIT_CODE
