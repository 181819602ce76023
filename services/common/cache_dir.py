"""Where llmesh keeps what it computes once per machine (converted tokenizers,
the engine's start-up probe verdicts)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(env_var: str, name: str) -> Path | None:
    """``$<env_var>`` if set, else ``$XDG_CACHE_HOME/llmesh/<name>``
    (``~/.cache`` without ``XDG_CACHE_HOME``); None when ``$<env_var>`` is ``off``."""
    configured = os.environ.get(env_var)
    if configured == "off":
        return None
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "llmesh" / name
