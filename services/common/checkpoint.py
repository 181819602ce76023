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
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"


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


def load_hf_tokenizer(path: str | Path) -> Any:
    """The ``transformers`` tokenizer of a GGUF file
    (``AutoTokenizer.from_pretrained(dir, gguf_file=name)``) or of a checkpoint
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
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    raise FileNotFoundError(f"no GGUF file or checkpoint directory at {path}")
