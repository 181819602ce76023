"""A disk cache of the tokenizers ``transformers`` converts from GGUF files.

``AutoTokenizer.from_pretrained(dir, gguf_file=name)`` rebuilds a fast
tokenizer from the GGUF's vocabulary and merges on every start: ~4 s for
SmolLM2's 49k tokens and ~14 s for Gemma 3's 262k on this 2-core machine
(three times that under load), on the critical path of every tokenizer
start, restart and scale-out. The converted tokenizer, saved once with
``save_pretrained`` (``tokenizer.json``, ``tokenizer_config.json`` with the
chat template, special-token maps), loads in well under a second and gives
the same ids, template and special tokens
(``tests/common/test_tokenizer_cache.py`` checks this against a fresh
conversion).

Key: the GGUF's resolved path, size and modification time, and the
``transformers`` and ``tokenizers`` versions (a conversion may change between
versions). Location: ``$LLMESH_TOKENIZER_CACHE``, else
``$XDG_CACHE_HOME/llmesh/tokenizers`` (``~/.cache`` without it), one folder per key, written to a temporary
folder and renamed into place, so a concurrent start never reads half a
save. A cache that cannot be read or written is skipped (the conversion runs
as without it); ``LLMESH_TOKENIZER_CACHE=off`` turns it off.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from services.common.cache_dir import cache_dir

log = structlog.get_logger(__name__)

CACHE_DIR_ENV = "LLMESH_TOKENIZER_CACHE"
#: Bumped when what is saved or how it is keyed changes.
FORMAT = "1"
#: Files ``save_pretrained`` must have written for an entry to count.
REQUIRED = ("tokenizer.json", "tokenizer_config.json")


def cache_root() -> Path | None:
    """The cache folder, or None when ``$LLMESH_TOKENIZER_CACHE`` is ``off``."""
    return cache_dir(CACHE_DIR_ENV, "tokenizers")


def cache_key(gguf_path: Path) -> str:
    """Hex SHA-256 of what decides the conversion's result (see the module doc)."""
    import tokenizers
    import transformers

    resolved = gguf_path.resolve()
    stat = resolved.stat()
    parts = (FORMAT, str(resolved), str(stat.st_size), str(stat.st_mtime_ns),
             transformers.__version__, tokenizers.__version__)
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def load_cached(gguf_path: Path, convert: Callable[[], Any],
                load_dir: Callable[[Path], Any]) -> Any:
    """The tokenizer of ``gguf_path``: from the cache when an entry exists,
    else ``convert()`` (and the result saved for the next start).

    Args:
      gguf_path: the GGUF file.
      convert: builds the tokenizer from the GGUF (seconds).
      load_dir: loads a tokenizer from a ``save_pretrained`` folder.

    Raises:
      whatever ``convert`` raises; cache trouble (unreadable, full disk) is
      logged and skipped, never raised.
    """
    root = cache_root()
    if root is None:
        return convert()
    entry = root / cache_key(gguf_path)
    if all((entry / name).is_file() for name in REQUIRED):
        try:
            return load_dir(entry)
        except Exception as error:  # noqa: BLE001 - a damaged entry (tokenizers raises
            # a bare Exception on bad JSON): drop it and convert again
            log.warning("tokenizer_cache_unreadable", entry=str(entry),
                        error=f"{type(error).__name__}: {error}")
            shutil.rmtree(entry, ignore_errors=True)
    tokenizer = convert()
    _save(tokenizer, entry)
    return tokenizer


def _save(tokenizer: Any, entry: Path) -> None:
    """``save_pretrained`` into a temporary folder beside ``entry``, then a
    rename; a failure leaves no entry."""
    staging: Path | None = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
        tokenizer.save_pretrained(str(staging))
        if not all((staging / name).is_file() for name in REQUIRED):
            raise OSError(f"save_pretrained wrote no {' or '.join(REQUIRED)}")
        if all((entry / name).is_file() for name in REQUIRED):
            return  # a concurrent start saved it first (the finally drops ours)
        shutil.rmtree(entry, ignore_errors=True)  # a damaged entry
        os.replace(staging, entry)
        staging = None
    except OSError as error:
        log.warning("tokenizer_cache_not_written", entry=str(entry), error=str(error))
    finally:
        if staging is not None:
            with contextlib.suppress(OSError):
                shutil.rmtree(staging)
