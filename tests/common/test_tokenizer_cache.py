"""The disk cache of GGUF-converted tokenizers (services/common/tokenizer_cache.py):
a cached tokenizer is the fresh conversion (ids, text, chat template, special
tokens) for both embedded models; the key follows the file; cache trouble
never fails a load."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from services.common.checkpoint import load_hf_tokenizer
from services.common.model_files import default_model_path
from services.tokenizer.model_parts import gemma3_270m_gguf_path
from services.common.tokenizer_cache import (
    CACHE_DIR_ENV,
    REQUIRED,
    cache_key,
    cache_root,
    load_cached,
)

pytestmark = pytest.mark.model

TEXTS = [
    "Hello, world!",
    "  leading spaces and trailing  ",
    "The capital of France is Paris.\n\nNext line\ttab",
    "Ünïcödé — 東京 🚀 ﷽ ",
    "<|im_start|>user\nforged<|im_end|> <start_of_turn> <bos> <eos>",
    "def f(x):\n    return x ** 2  # code\n",
    "1234567890 3.14159 -0.5e-3",
    "",
]
CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3 + 3?"}]


def assert_same(cached: Any, reference: Any) -> None:
    for text in TEXTS:
        for special in (True, False):
            ids = reference(text, add_special_tokens=special)["input_ids"]
            assert cached(text, add_special_tokens=special)["input_ids"] == ids, text
            assert cached.decode(ids) == reference.decode(ids)
            assert cached.decode(ids, skip_special_tokens=True) == \
                reference.decode(ids, skip_special_tokens=True)
    assert len(cached) == len(reference)
    assert cached.all_special_tokens == reference.all_special_tokens
    assert (cached.bos_token_id, cached.eos_token_id) == (reference.bos_token_id,
                                                          reference.eos_token_id)
    assert {i: t.content for i, t in cached.added_tokens_decoder.items()} == \
        {i: t.content for i, t in reference.added_tokens_decoder.items()}
    assert cached.chat_template == reference.chat_template
    if reference.chat_template is not None:
        for prompt in (True, False):
            assert cached.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=prompt) \
                == reference.apply_chat_template(CHAT, tokenize=False,
                                                 add_generation_prompt=prompt)


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_a_cached_tokenizer_is_the_fresh_conversion(model: str, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The conversion is saved where the machine's own cache would keep it when
    that has no entry yet (a fresh machine: the entry checked here then serves
    the rest of the suite, one conversion less, ~22 s for Gemma 3 on a 2-core
    CI machine), else in a folder of the test's own (a conversion all the same)."""
    path = default_model_path() if model == "smollm2" else gemma3_270m_gguf_path()
    root = cache_root()
    if root is None or (root / cache_key(path)).exists():
        root = tmp_path
        monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    converted = load_hf_tokenizer(path)  # converts and saves
    entry = root / cache_key(path)
    assert all((entry / name).is_file() for name in REQUIRED)
    assert not list(root.glob(f".{entry.name}.*"))  # no staging left
    cached = load_hf_tokenizer(path)  # reads the entry
    assert cached is not converted
    assert_same(cached, converted)


def tiny_tokenizer() -> Any:
    """A real fast tokenizer of five words (the cache's mechanics, cheaply)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "hi": 1, "there": 2, "cache": 3, "me": 4}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")


def load(path: Path, calls: list[str]) -> Any:
    from transformers import AutoTokenizer

    def convert() -> Any:
        calls.append("convert")
        return tiny_tokenizer()

    def load_dir(folder: Path) -> Any:
        calls.append("cached")
        return AutoTokenizer.from_pretrained(str(folder))

    return load_cached(path, convert, load_dir)


def test_the_key_follows_the_file_and_trouble_never_fails_a_load(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    link = tmp_path / "link.gguf"
    os.symlink(model, link)
    key = cache_key(model)
    assert cache_key(link) == key  # the resolved file
    root = tmp_path / "cache"
    monkeypatch.setenv(CACHE_DIR_ENV, str(root))
    calls: list[str] = []
    assert load(link, calls)("hi there")["input_ids"] == [1, 2]
    assert load(link, calls)("cache me")["input_ids"] == [3, 4]
    assert calls == ["convert", "cached"]
    os.utime(model, ns=(0, 10**18))  # a changed file: a new key, converted again
    assert cache_key(model) != key
    load(model, calls)
    assert calls[-1] == "convert" and len(list(root.iterdir())) == 2
    # Unwritable cache, cache off: converted every time, never an error.
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    for setting in (str(blocker / "cache"), "off"):
        monkeypatch.setenv(CACHE_DIR_ENV, setting)
        calls.clear()
        assert load(model, calls)("hi")["input_ids"] == [1]
        assert load(model, calls)("hi")["input_ids"] == [1]
        assert calls == ["convert", "convert"]
    # A damaged entry is dropped, converted again and rewritten.
    monkeypatch.setenv(CACHE_DIR_ENV, str(root))
    entry = root / cache_key(model)
    (entry / "tokenizer.json").write_text("{not json")
    calls.clear()
    assert load(model, calls)("me")["input_ids"] == [4]
    assert load(model, calls)("me")["input_ids"] == [4]
    assert calls == ["cached", "convert", "cached"]
