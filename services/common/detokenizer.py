"""Incremental detokenization: token ids in, chunk by chunk; UTF-8-safe text deltas out.

Used by the tokenizer service (its ``Detokenize`` stream) and by the router,
which decodes in process with :class:`TokenizersDecoder`, built from the
definition the tokenizer service hands out (``GetTokenizer``): the same Rust
``tokenizers`` decode, so the same text, without a round trip per token.

Algorithm: the prefix/read-offset window of text-generation-inference's
``decode_token`` and vLLM's ``detokenize_incrementally`` (both Apache-2.0),
re-derived here:

* ``prefix_offset .. read_offset`` are ids whose text was already emitted;
  they are decoded again as context, because a token's text depends on its
  neighbours (SentencePiece's ``▁`` leading space and a leading-space strip,
  byte-fallback ``<0xE6>`` tokens that only make a character together,
  byte-level BPE tokens that hold half of an emoji's bytes);
* on new ids, ``new = decode(ids[prefix_offset:])`` and
  ``old = decode(ids[prefix_offset:read_offset])``; if ``new`` is longer and
  does not end in U+FFFD, ``new[len(old):]`` is final: emit it and slide the
  window (``prefix_offset = read_offset``, ``read_offset = len(ids)``);
* if ``new`` ends in U+FFFD the last character's bytes are still incomplete:
  emit the text up to the latest of the last 3 ids that ends a whole
  character (a chunk of several ids that ends mid-character keeps back only
  that character; an addition to the original algorithm, which keeps back
  the whole chunk), or nothing, and wait for more ids.

Each window starts at a character boundary (it is moved only when the text
ends in a whole character), so the deltas concatenate to
``decode(all_ids)`` for any split of the ids into chunks, and no U+FFFD ever
comes from a half-received character. Only ids already emitted before the
window are forgotten, so memory and per-step work stay constant however long
the sequence grows.

Invalid byte sequences (a model emitting garbage bytes) decode to U+FFFD in
``decode`` too; they are held at most ``max_held_tokens`` ids and then
emitted as they are, all but the last 3 ids (which may still hold an
incomplete character), so garbage cannot grow the window without bound. For such
input the deltas may differ from ``decode(all_ids)`` next to the bad bytes
(how many U+FFFD stand for them); valid text elsewhere is unaffected.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import Protocol

import tokenizers
import tokenizers.decoders

_REPLACEMENT = "\ufffd"
#: ``GetTokenizerResponse.format`` of a definition :class:`TokenizersDecoder` reads.
DEFINITION_FORMAT = "huggingface-tokenizers-json"
# A UTF-8 character has at most 4 bytes, so at most 3 trailing ids hold the
# bytes of an incomplete last character.
_MAX_PARTIAL_TOKENS = 3


class Decoder(Protocol):
    """Anything that turns ids into text (e.g. :class:`services.tokenizer.tokenizer.Tokenizer`)."""

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``token_ids``; incomplete or invalid UTF-8 bytes as U+FFFD."""
        ...


def first_out_of_range(token_ids: Sequence[int], vocab_size: int) -> int | None:
    """The first id not in ``[0, vocab_size)``, or None (one min/max pass when all are)."""
    if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab_size):
        return next(i for i in token_ids if not 0 <= i < vocab_size)
    return None


class TokenizersDecoder:
    """A :class:`Decoder` from a Hugging Face ``tokenizers`` JSON definition
    (the tokenizer service's ``GetTokenizer``); decodes exactly as that
    service's tokenizer does, since it is the same definition and library.

    Thread safety: decode only reads; several threads may call it.
    """

    def __init__(self, definition: str, vocab_size: int) -> None:
        """Args:
          definition: the JSON serialization (``tokenizers.Tokenizer.to_str``).
          vocab_size: ids ``0 <= id < vocab_size`` are valid.

        Raises:
          ValueError: the definition does not parse, or ``vocab_size`` < 1.
        """
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        try:
            self._tokenizer = tokenizers.Tokenizer.from_str(definition)
        except Exception as exc:  # the Rust side raises a plain Exception
            raise ValueError(f"not a tokenizers definition: {exc}") from exc
        self.vocab_size = vocab_size

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``token_ids`` (valid ids only: see :meth:`check_token_ids`)."""
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for on its own (valid ids only), which
        need not be whole UTF-8 characters: for a byte-level BPE vocabulary
        (GPT-2's, Radford et al. 2019: each byte written as one printable
        character) its piece mapped back to bytes; for a SentencePiece
        byte-fallback piece ``<0xNN>`` that byte; otherwise its decoded text in
        UTF-8 (special tokens included)."""
        piece = self._tokenizer.id_to_token(token_id)
        if piece is not None:
            if isinstance(self._tokenizer.decoder, tokenizers.decoders.ByteLevel):
                table = _byte_level_table()
                if all(char in table for char in piece):
                    return bytes(table[char] for char in piece)
            elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                with contextlib.suppress(ValueError):
                    return bytes([int(piece[3:5], 16)])
        return self._tokenizer.decode([token_id], skip_special_tokens=False).encode()

    def check_token_ids(self, token_ids: Sequence[int]) -> None:
        """Raises ValueError unless every id is in ``[0, vocab_size)`` (``tokenizers``
        would drop an unknown id silently)."""
        bad = first_out_of_range(token_ids, self.vocab_size)
        if bad is not None:
            raise ValueError(f"token id {bad} is out of range [0, {self.vocab_size})")


@functools.cache
def _byte_level_table() -> dict[str, int]:
    """Byte-level BPE's alphabet: the character standing for each byte (GPT-2's
    ``bytes_to_unicode``, re-derived: printable Latin-1 bytes stand for
    themselves, the other 68 take the code points from U+0100 on, in byte
    order), as character -> byte."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    table = {chr(byte): byte for byte in printable}
    shifted = (byte for byte in range(256) if byte not in printable)
    table.update({chr(0x100 + n): byte for n, byte in enumerate(shifted)})
    return table


class IncrementalDetokenizer:
    """Text deltas of one token sequence, fed in chunks of any size.

    ``"".join(d.add(chunk) for chunk in chunks) + d.flush()`` equals
    ``decoder.decode(all_ids, skip_special_tokens)`` for valid UTF-8 output,
    whatever the chunking (see the module docstring for the algorithm and
    its source). One instance per sequence; not thread-safe.
    """

    def __init__(
        self,
        decoder: Decoder,
        skip_special_tokens: bool = False,
        max_held_tokens: int = 16,
    ) -> None:
        """Args:
          decoder: decodes ids (the model's tokenizer).
          skip_special_tokens: leave special tokens (EOS, chat markers) out of the text.
          max_held_tokens: most ids held back while the text ends in U+FFFD
            before it is taken as a genuinely invalid byte sequence and
            emitted (a UTF-8 character needs at most 4 byte tokens).
        """
        self._decoder = decoder
        self._skip = skip_special_tokens
        self._max_held = max_held_tokens
        # ids[prefix_offset:] of the sequence; self._read = read_offset - prefix_offset.
        self._ids: list[int] = []
        self._read = 0
        self._prefix_text: str | None = ""

    @property
    def skip_special_tokens(self) -> bool:
        """Whether special tokens are left out of the text."""
        return self._skip

    @property
    def num_held_tokens(self) -> int:
        """Ids received whose text has not been emitted yet."""
        return len(self._ids) - self._read

    def add(self, token_ids: Sequence[int]) -> str:
        """Feeds the next ids; returns the text they made final (may be "").

        Ids must be valid for the decoder (check them first: out-of-range ids
        make the decoder raise).
        """
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        return self._advance(final=False)

    def add_with_ends(self, token_ids: Sequence[int], *,
                      flush: bool = False) -> tuple[str, list[int]]:
        """Feeds the ids one at a time and says which id made which text final.

        Returns:
          ``(text, ends)``: ``text`` as :meth:`add` (then :meth:`flush`, when
          ``flush``) would return it; ``ends[i]`` is how many leading code
          points of ``text`` were final once ``token_ids[i]`` had been added
          (non-decreasing; ``ends[-1] == len(text)``: text released by the
          flush counts for the last id). The caller uses it to find the id
          that completed a stop string inside a chunk of several ids.

        Costs one decode per id instead of one per chunk, so callers ask for
        it only when they need it (requests with stop strings).
        """
        parts: list[str] = []
        ends: list[int] = []
        length = 0
        for token_id in token_ids:
            piece = self.add((token_id,))
            parts.append(piece)
            length += len(piece)
            ends.append(length)
        if flush:
            rest = self.flush()
            parts.append(rest)
            if ends:
                ends[-1] += len(rest)
        return "".join(parts), ends

    def flush(self) -> str:
        """Ends the sequence: returns all text still held back (incomplete
        bytes as U+FFFD) and resets, so the next :meth:`add` starts a new sequence."""
        text = self._advance(final=True) if self._read < len(self._ids) else ""
        self._ids.clear()
        self._read = 0
        self._prefix_text = ""
        return text

    def _advance(self, final: bool) -> str:
        decode = self._decoder.decode
        if self._prefix_text is None:
            self._prefix_text = decode(self._ids[: self._read], self._skip)
        prefix_text = self._prefix_text
        new_text = decode(self._ids, self._skip)
        if final:
            return self._emit(new_text[len(prefix_text):], len(self._ids))
        if len(new_text) <= len(prefix_text):
            return ""  # e.g. only skipped special tokens so far
        if not new_text.endswith(_REPLACEMENT):
            return self._emit(new_text[len(prefix_text):], len(self._ids))
        # The last character's bytes are incomplete. Its bytes lie in the last
        # _MAX_PARTIAL_TOKENS ids at most: emit up to the latest id that ends a
        # whole character, so a chunk ending mid-character holds back only that.
        last = len(self._ids)
        for end in range(last - 1, max(self._read, last - _MAX_PARTIAL_TOKENS - 1), -1):
            text = decode(self._ids[:end], self._skip)
            if len(text) > len(prefix_text) and not text.endswith(_REPLACEMENT):
                return self._emit(text[len(prefix_text):], end)
        if self.num_held_tokens > self._max_held:
            # Invalid bytes: emit them, but keep the last ids back, which may
            # still hold an incomplete character (a long chunk whose look-back
            # met invalid bytes must not turn a valid last character into U+FFFD).
            keep = last - _MAX_PARTIAL_TOKENS
            text = decode(self._ids[:keep], self._skip) if keep > self._read else ""
            if len(text) > len(prefix_text):
                return self._emit(text[len(prefix_text):], keep)
            return self._emit(new_text[len(prefix_text):], last)
        return ""

    def _emit(self, delta: str, read_end: int) -> str:
        """Slides the window: ids before the read offset leave, ``read_end`` is the new read offset."""
        del self._ids[: self._read]
        self._read = read_end - self._read
        self._prefix_text = None
        return delta
