"""Reads a few scalar metadata values from a GGUF header, fast.

``gguf.GGUFReader`` parses every field and tensor (about 11 s for Gemma's
262k-token vocabulary here); the tokenizer only needs a handful of integers
(end-of-turn ids) that ``transformers`` does not keep. This reader walks the
key/value section once, skipping arrays without materialising them.

Format (GGUF v2/v3, little-endian): ``b"GGUF"``, uint32 version, uint64 tensor
count, uint64 key/value count, then per key: a string (uint64 length + UTF-8
bytes), a uint32 value type and the value. See
https://github.com/ggml-org/ggml/blob/master/docs/gguf.md.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterable
from pathlib import Path

_STRING, _ARRAY = 8, 9
# value type -> struct format of a fixed-size scalar
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
           10: "<Q", 11: "<q", 12: "<d"}


class GGUFFormatError(ValueError):
    """The file is not a GGUF v2/v3 little-endian file, or is truncated."""


def read_gguf_scalars(path: Path, keys: Iterable[str]) -> dict[str, int | float | bool | str]:
    """The values of ``keys`` that hold scalars or strings (absent keys are left out).

    Stops reading as soon as every wanted key was found. Arrays are skipped.

    Raises:
      GGUFFormatError: not a readable GGUF v2/v3 little-endian file.
      OSError: the file cannot be opened.
    """
    wanted = set(keys)
    found: dict[str, int | float | bool | str] = {}
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            if buf[:4] != b"GGUF":
                raise GGUFFormatError(f"{path} is not a GGUF file")
            (version,) = struct.unpack_from("<I", buf, 4)
            if version not in (2, 3):
                raise GGUFFormatError(f"{path}: unsupported GGUF version {version}")
            (count,) = struct.unpack_from("<Q", buf, 16)
            pos = 24
            for _ in range(count):
                if not wanted - found.keys():
                    break
                key, pos = _read_string(buf, pos)
                (vtype,) = struct.unpack_from("<I", buf, pos)
                pos += 4
                if key in wanted and vtype != _ARRAY:
                    found[key], pos = _read_value(buf, pos, vtype)
                else:
                    pos = _skip_value(buf, pos, vtype)
        except (struct.error, UnicodeDecodeError, KeyError) as err:
            raise GGUFFormatError(f"{path}: malformed GGUF header ({err})") from err
    return found


def _read_string(buf: mmap.mmap, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buf, pos)
    start = pos + 8
    return buf[start:start + length].decode("utf-8"), start + length


def _read_value(buf: mmap.mmap, pos: int, vtype: int) -> tuple[int | float | bool | str, int]:
    if vtype == _STRING:
        return _read_string(buf, pos)
    fmt = _SCALAR[vtype]
    return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)


def _skip_value(buf: mmap.mmap, pos: int, vtype: int) -> int:
    if vtype == _STRING:
        (length,) = struct.unpack_from("<Q", buf, pos)
        return pos + 8 + length
    if vtype != _ARRAY:
        return pos + struct.calcsize(_SCALAR[vtype])
    elem, n = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if elem == _STRING:
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(n):
            pos += 8 + unpack(buf, pos)[0]
        return pos
    if elem == _ARRAY:
        for _ in range(n):
            pos = _skip_value(buf, pos, _ARRAY)
        return pos
    return pos + n * struct.calcsize(_SCALAR[elem])
