"""IncrementalDetokenizer against the real tokenizers, without gRPC.

Property: for any text and any split of its ids into chunks, the deltas
(+ flush) concatenate to ``transformers``' ``decode(ids)`` and no delta holds
U+FFFD, for byte-level BPE (SmolLM2) and SentencePiece with byte fallback (Gemma).

(SmolLM2's vocabulary lacks the byte tokens 0x04 0x06 0x13 0x14 0x16 0x1D
0xC0 0xC1 0xF1 0xF2 0xF5-0xFF: its encoder drops those bytes, so text with
such control characters or planes 4-11 characters does not round-trip and
decodes with U+FFFD. The property then still holds against ``decode(ids)``.)
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.common.detokenizer import IncrementalDetokenizer
from services.tokenizer.tokenizer import Tokenizer
from tests.tokenizer.tokenizer_helpers import HARD_FRAGMENTS, HARD_TEXT, split

pytestmark = pytest.mark.model

TOKENIZERS = ["smollm", "gemma"]

# Any Unicode except surrogates (not encodable) and U+FFFD itself.
_CHARS = st.characters(blacklist_categories=("Cs",), blacklist_characters="\ufffd")
TEXTS = st.lists(st.sampled_from(HARD_FRAGMENTS) | st.text(_CHARS, max_size=6),
                 min_size=1, max_size=12).map("".join)
HARD_TEXTS = st.lists(st.sampled_from(HARD_FRAGMENTS), min_size=1, max_size=16).map("".join)

_SETTINGS = settings(max_examples=60, deadline=None, database=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture])


def _stream(tok: Tokenizer, chunks: list[list[int]], skip: bool = False) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    return [detok.add(chunk) for chunk in chunks] + [detok.flush()]


def _draw_chunks(data: st.DataObject, ids: list[int]) -> list[list[int]]:
    if data.draw(st.booleans(), label="one id per chunk"):
        return [[i] for i in ids]
    cuts = data.draw(st.lists(st.integers(1, max(1, len(ids) - 1)), max_size=len(ids)),
                     label="cuts")
    return split(ids, cuts)


@pytest.mark.parametrize("name", TOKENIZERS)
@_SETTINGS
@given(text=HARD_TEXTS, data=st.data())
def test_hard_text_round_trips_whatever_the_chunking(
        name: str, text: str, data: st.DataObject, request: pytest.FixtureRequest) -> None:
    tok: Tokenizer = request.getfixturevalue(name)
    ids = tok.encode(text, add_special_tokens=True)
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    deltas = _stream(tok, _draw_chunks(data, ids), skip)
    assert "".join(deltas) == tok.hf_tokenizer.decode(ids, skip_special_tokens=skip)
    assert not any("\ufffd" in d for d in deltas)
    if skip:  # both tokenizers round-trip these texts exactly
        assert "".join(deltas) == text


@pytest.mark.parametrize("name", TOKENIZERS)
@_SETTINGS
@given(text=TEXTS, data=st.data())
def test_any_text_any_chunking_concatenates_to_decode(
        name: str, text: str, data: st.DataObject, request: pytest.FixtureRequest) -> None:
    tok: Tokenizer = request.getfixturevalue(name)
    ids = tok.encode(text, add_special_tokens=True)
    assert ids == tok.hf_tokenizer.encode(text, add_special_tokens=True)
    deltas = _stream(tok, _draw_chunks(data, ids))
    full = tok.hf_tokenizer.decode(ids)
    assert "".join(deltas) == full
    if "\ufffd" not in full:  # no U+FFFD from a half-received character
        assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_hard_text_one_id_at_a_time(name: str, request: pytest.FixtureRequest) -> None:
    tok: Tokenizer = request.getfixturevalue(name)
    ids = tok.encode(HARD_TEXT)
    deltas = _stream(tok, [[i] for i in ids])
    assert "".join(deltas) == HARD_TEXT == tok.hf_tokenizer.decode(ids)
    assert not any("\ufffd" in d for d in deltas)
    # Multi-byte characters split over several ids are held back, then come whole.
    assert "" in deltas[:-1]
    assert "🇯🇵" in "".join(deltas)


def test_smollm_emoji_bytes_are_held_until_complete(smollm: Tokenizer) -> None:
    # "😀" is 4 UTF-8 bytes: byte-level BPE spreads them over three ids.
    ids = smollm.encode("😀")
    assert smollm.hf_tokenizer.convert_ids_to_tokens(ids) == ["ðŁ", "ĺ", "Ģ"]
    detok = IncrementalDetokenizer(smollm)
    assert detok.add(ids[:1]) == ""
    assert detok.add(ids[1:2]) == ""
    assert detok.num_held_tokens == 2
    assert detok.add(ids[2:]) == "😀"
    assert detok.num_held_tokens == 0
    assert detok.flush() == ""


def test_gemma_byte_fallback_is_held_until_complete(gemma: Tokenizer) -> None:
    # "𝔘" is not in Gemma's vocabulary: four <0x..> byte-fallback tokens.
    ids = gemma.encode("a𝔘")
    pieces = gemma.hf_tokenizer.convert_ids_to_tokens(ids)
    assert pieces == ["a", "<0xF0>", "<0x9D>", "<0x94>", "<0x98>"]
    detok = IncrementalDetokenizer(gemma)
    assert [detok.add([i]) for i in ids] == ["a", "", "", "", "𝔘"]


def test_leading_space_markers(smollm: Tokenizer, gemma: Tokenizer) -> None:
    for tok, pieces, deltas in (
        (smollm, ["one", "Ġtwo", "Ġ", "Ġthree"], ["one", " two", " ", " three"]),
        (gemma, ["one", "▁two", "▁▁", "three"], ["one", " two", "  ", "three"]),
    ):
        ids = tok.encode("one two  three")
        assert tok.hf_tokenizer.convert_ids_to_tokens(ids) == pieces
        detok = IncrementalDetokenizer(tok)
        assert [detok.add([i]) for i in ids] == deltas


def test_a_chunk_ending_mid_character_holds_back_only_that_character(smollm: Tokenizer) -> None:
    ids = smollm.encode("ab 😀")
    assert smollm.hf_tokenizer.convert_ids_to_tokens(ids) == ["ab", "ĠðŁĺ", "Ģ"]
    detok = IncrementalDetokenizer(smollm)
    assert detok.add(ids[:2]) == "ab"
    assert detok.num_held_tokens == 1
    assert detok.add(ids[2:]) == " 😀"


def test_a_long_chunk_with_invalid_bytes_keeps_its_incomplete_last_character(
        smollm: Tokenizer) -> None:
    """Found by hypothesis: SmolLM2 encodes U+40000 U+0080 as three orphan
    continuation bytes (its lead byte is lost), then C2 80. A chunk of more
    than ``max_held_tokens`` ids ending in the C2 is taken for garbage (its
    look-back meets only U+FFFD), and used to be emitted whole, the C2 as
    U+FFFD; now its last 3 ids stay back and the C2 completes to U+0080, as a
    one-shot decode has it."""
    ids = smollm.encode("\U00040000\x80")
    assert smollm.hf_tokenizer.convert_ids_to_tokens(ids) == ["Ģ", "Ģ", "Ģ", "Â", "Ģ"]
    assert smollm.decode(ids) == "\ufffd" * 3 + "\x80"
    for warm_up in ([], smollm.encode("word " * 20)):  # short, and longer than max_held
        detok = IncrementalDetokenizer(smollm)
        first = detok.add(warm_up + ids[:-1])
        rest = detok.add(ids[-1:]) + detok.flush()
        assert first + rest == smollm.decode(warm_up + ids)
        assert first.startswith(smollm.decode(warm_up)) and rest.endswith("\x80")


def test_skip_special_tokens(smollm: Tokenizer) -> None:
    ids = [*smollm.encode("Hi there"), smollm.info.eos_token_ids[0]]
    assert "".join(_stream(smollm, [[i] for i in ids], skip=True)) == "Hi there"
    assert "".join(_stream(smollm, [[i] for i in ids], skip=False)) == "Hi there<|im_end|>"


def test_flush_returns_held_bytes_and_starts_a_new_sequence(smollm: Tokenizer) -> None:
    first = smollm.encode("😀")[0]
    detok = IncrementalDetokenizer(smollm)
    assert detok.add([first]) == ""
    assert detok.flush() == "\ufffd"  # an incomplete character at the end is invalid text
    assert detok.add(smollm.encode("new")) == "new"
    assert detok.flush() == ""


def test_garbage_bytes_are_emitted_and_never_grow_the_window(
        smollm: Tokenizer, gemma: Tokenizer) -> None:
    rng = random.Random(7)
    for tok in (smollm, gemma):
        # Ids that each hold part of a character: shuffled, they are invalid UTF-8.
        byte_ids = sorted({i for i in tok.encode("𝔘𐍈😀日本語€") if tok.decode([i]) == "\ufffd"})
        assert len(byte_ids) >= 4
        detok = IncrementalDetokenizer(tok, max_held_tokens=16)
        out = []
        for _ in range(300):
            out.append(detok.add([rng.choice(byte_ids)]))
            assert detok.num_held_tokens <= 17
        out.append(detok.flush())
        assert sum(1 for d in out if d) > 10  # emitted along the way, not all at the end
        assert "\ufffd" in "".join(out)


@pytest.mark.parametrize("name", TOKENIZERS)
@_SETTINGS
@given(text=HARD_TEXTS, data=st.data())
def test_token_text_ends_say_which_id_made_which_text_final(
        name: str, text: str, data: st.DataObject, request: pytest.FixtureRequest) -> None:
    """``add_with_ends`` returns what ``add`` (+ ``flush``) returns, and for each
    id the length of the text that one-id-at-a-time streaming had made final
    by then: what the router needs to cut ids at the id completing a stop."""
    tok: Tokenizer = request.getfixturevalue(name)
    ids = tok.encode(text, add_special_tokens=True)
    chunks = _draw_chunks(data, ids)
    plain = _stream(tok, chunks)
    one_by_one = IncrementalDetokenizer(tok)
    final_after = []  # code points final after each id, counted from the start
    total = 0
    for token in ids:
        total += len(one_by_one.add([token]))
        final_after.append(total)
    detok = IncrementalDetokenizer(tok)
    texts, offset = [], 0
    for n, chunk in enumerate(chunks):
        chunk_text, ends = detok.add_with_ends(chunk, flush=n == len(chunks) - 1)
        texts.append(chunk_text)
        assert len(ends) == len(chunk)
        assert ends == sorted(ends) and (not ends or ends[-1] == len(chunk_text))
        start = sum(len(c) for c in chunks[:n])
        for i, end in enumerate(ends[:-1] if n == len(chunks) - 1 else ends):
            assert offset + end == final_after[start + i]
        offset += len(chunk_text)
    assert "".join(texts) == "".join(plain)


def test_token_text_ends_hold_a_split_character_until_its_last_byte(smollm: Tokenizer) -> None:
    ids = smollm.encode("a😀")
    assert len(ids) >= 3  # the emoji's bytes span several ids
    text, ends = IncrementalDetokenizer(smollm).add_with_ends(ids)
    assert text == "a😀"
    assert ends == [1] * (len(ids) - 1) + [2]
