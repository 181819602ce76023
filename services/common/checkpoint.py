"""A model copy as a GGUF file or a Hugging Face checkpoint directory: what the
engine's loader and the tokenizer service both need to tell them apart and to
read their tokenizer and EOS ids.

A checkpoint directory is what ``save_pretrained`` writes: ``config.json``,
safetensors weights, and (for the tokenizer) ``tokenizer.json`` +
``tokenizer_config.json`` (with its ``chat_template``, or a separate
``chat_template.jinja``), optionally ``generation_config.json``. One such
directory serves the tokenizer, the torch engine and TensorRT-LLM.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
#: One of these holds a checkpoint directory's tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
#: The weights: one file, or shards listed by the index's ``weight_map``.
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
GGUF_MAGIC = b"GGUF"


def is_checkpoint_dir(path: str | Path) -> bool:
    """Whether ``path`` is a directory with a ``config.json`` (a GGUF is a file)."""
    path = Path(path)
    return path.is_dir() and (path / CONFIG_FILE).is_file()


def read_json_object(file: Path) -> dict[str, Any]:
    """The JSON object in ``file``.

    Raises:
      FileNotFoundError: no such file.
      ValueError: invalid JSON, or not an object (the message names the file).
    """
    if not file.is_file():
        raise FileNotFoundError(f"no {file.name} in {file.parent}")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{file}: invalid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object")
    return data


def checkpoint_eos_ids(path: str | Path) -> tuple[int, ...]:
    """EOS ids of the checkpoint directory ``path``: ``eos_token_id`` (an int or
    a list) of ``config.json``, then those ``generation_config.json`` adds
    (Llama 3 Instruct lists ``<|eot_id|>`` there only). Empty when neither has one.

    Raises:
      FileNotFoundError: no ``config.json``.
      ValueError: a file is not a JSON object.
    """
    path = Path(path)
    sources = [read_json_object(path / CONFIG_FILE)]
    if (path / GENERATION_CONFIG_FILE).is_file():
        sources.append(read_json_object(path / GENERATION_CONFIG_FILE))
    ids: list[int] = []
    for source in sources:
        value = source.get("eos_token_id")
        for item in value if isinstance(value, list) else [value]:
            if item is not None and int(item) not in ids:
                ids.append(int(item))
    return tuple(ids)


def check_model_path(path: str | Path) -> None:
    """Checks cheaply (no weights read) that ``path`` is a GGUF file (its magic)
    or a checkpoint directory (:func:`check_checkpoint_dir`), so a service can
    refuse it in one line before binding a port.

    Raises:
      FileNotFoundError: nothing at ``path``; see :func:`check_checkpoint_dir`.
      ValueError: a file that is not a GGUF; see :func:`check_checkpoint_dir`.
    """
    path = Path(path)
    if path.is_dir():
        check_checkpoint_dir(path)
    elif not path.is_file():
        raise FileNotFoundError(f"no GGUF file or checkpoint directory at {path}")
    else:
        with path.open("rb") as file:
            if file.read(len(GGUF_MAGIC)) != GGUF_MAGIC:
                raise ValueError(f"{path}: not a GGUF file (a Hugging Face checkpoint is "
                                 "passed as its directory)")


#: Sizes of GGUF's fixed-size metadata value types (the GGUF spec's
#: ``gguf_metadata_value_type``: uint8 .. float64; 8 is string, 9 array).
GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
GGUF_STRING, GGUF_ARRAY = 8, 9


def gguf_architecture(path: str | Path) -> str:
    """``general.architecture`` of the GGUF at ``path`` (``llama``, ``gemma3``...),
    read from the metadata at the head of the file. ``gguf.GGUFReader`` would
    also index every tensor (2.8 s for SmolLM2, 12 s for Gemma 3 270M on this
    machine); this reads key-value pairs until it finds the key (the first
    one in files written by llama.cpp's converter). Layout: the GGUF spec,
    https://github.com/ggml-org/ggml/blob/master/docs/gguf.md.

    Raises:
      FileNotFoundError: no file at ``path``.
      ValueError: not a GGUF file, or no ``general.architecture`` string.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    with path.open("rb") as file:
        def read(size: int) -> bytes:
            data = file.read(size)
            if len(data) != size:
                raise ValueError(f"{path}: truncated GGUF metadata")
            return data

        def number(fmt: str) -> int:
            return struct.unpack(fmt, read(struct.calcsize(fmt)))[0]

        def string() -> bytes:
            return read(number("<Q"))

        def skip(kind: int) -> None:
            if kind in GGUF_SCALAR_BYTES:
                file.seek(GGUF_SCALAR_BYTES[kind], 1)
            elif kind == GGUF_STRING:
                file.seek(number("<Q"), 1)
            elif kind == GGUF_ARRAY:
                item, count = number("<I"), number("<Q")
                if item in GGUF_SCALAR_BYTES:
                    file.seek(GGUF_SCALAR_BYTES[item] * count, 1)
                else:
                    for _ in range(count):
                        skip(item)
            else:
                raise ValueError(f"{path}: unknown GGUF metadata type {kind}")

        if read(len(GGUF_MAGIC)) != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        number("<I")  # version
        number("<Q")  # tensor count
        for _ in range(number("<Q")):
            key, kind = string(), number("<I")
            if key == b"general.architecture" and kind == GGUF_STRING:
                return string().decode("utf-8")
            skip(kind)
    raise ValueError(f"{path} has no general.architecture")


def check_checkpoint_dir(path: str | Path, weights: bool = True) -> dict[str, Any]:
    """The ``config.json`` object of the checkpoint directory ``path``, after
    cheap checks: it parses; with ``weights``, the safetensors files are there
    (:func:`check_weight_files`). The architecture is the loader's to check
    (:func:`check_architecture`).

    Raises:
      FileNotFoundError: no directory, no ``config.json``, no weights, a missing shard.
      ValueError: invalid JSON, a malformed index.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint directory at {path}")
    if not (path / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in {path} (a Hugging Face checkpoint "
                                "directory has one; a GGUF is passed as its file)")
    config = read_json_object(path / CONFIG_FILE)
    if weights:
        check_weight_files(path)
    return config


def check_architecture(config: Mapping[str, Any], file: Path, supported: Sequence[str],
                       hint: str = "") -> None:
    """Raises ValueError naming ``file`` when the config's ``architectures`` name
    none of ``supported`` (``hint`` is appended in parentheses)."""
    architectures = config.get("architectures") or []
    if not any(a in supported for a in architectures):
        raise ValueError(f"{file}: architectures {architectures} are not supported; this "
                         f"loader reads {list(supported)}" + (f" ({hint})" if hint else ""))


def check_weight_files(path: Path) -> dict[str, Path] | None:
    """Tensor name → shard of the checkpoint directory ``path`` when it has a
    ``model.safetensors.index.json`` (every shard it names checked present);
    None when the weights are one ``model.safetensors``. Reads no weights.

    Raises:
      FileNotFoundError: neither file, or a shard named by the index is missing.
      ValueError: an index that is not JSON or has no ``weight_map`` object.
    """
    single, index = path / WEIGHTS_FILE, path / WEIGHTS_INDEX_FILE
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no 'weight_map' object")
        files = {name: path / str(file) for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not file.is_file():
                raise FileNotFoundError(f"{index} names the shard {file.name}, which is missing")
        return files
    if single.is_file():
        return None
    raise FileNotFoundError(f"{path}: no {WEIGHTS_FILE} and no {WEIGHTS_INDEX_FILE} (only "
                            "safetensors checkpoints are read; re-save with "
                            "safe_serialization=True)")


def check_tokenizer_path(path: str | Path) -> None:
    """Checks cheaply that ``path`` is a GGUF file or a directory holding a
    tokenizer (``tokenizer.json`` or ``tokenizer.model``) whose JSON config
    files, where present, parse.

    Raises:
      FileNotFoundError: nothing at ``path``; a directory without tokenizer files.
      ValueError: not a GGUF file; a config file that is not a JSON object.
    """
    path = Path(path)
    if not path.is_dir():
        check_model_path(path)
        return
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(f"{path}: no {' or '.join(TOKENIZER_FILES)} (the tokenizer of "
                                "a Hugging Face checkpoint directory)")
    for name in (CONFIG_FILE, GENERATION_CONFIG_FILE, TOKENIZER_CONFIG_FILE):
        if (path / name).is_file():
            read_json_object(path / name)


def load_hf_tokenizer(path: str | Path) -> Any:
    """The ``transformers`` tokenizer of a GGUF file
    (``AutoTokenizer.from_pretrained(dir, gguf_file=name)``, converted once and
    then read from :mod:`services.common.tokenizer_cache`) or of a checkpoint
    directory (``AutoTokenizer.from_pretrained(dir)``). Seconds: blocking.

    Raises:
      FileNotFoundError: ``path`` is neither a file nor a directory.
      ValueError / OSError: ``transformers`` cannot read a tokenizer from it
        (e.g. a directory without ``tokenizer.json``).
    """
    from transformers import AutoTokenizer  # heavy import, only where needed

    path = Path(path)
    if path.is_dir():
        return AutoTokenizer.from_pretrained(str(path))
    if path.is_file():
        from services.common.tokenizer_cache import load_cached

        return load_cached(
            path, lambda: AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name),
            lambda folder: AutoTokenizer.from_pretrained(str(folder)))
    raise FileNotFoundError(f"no GGUF file or checkpoint directory at {path}")
