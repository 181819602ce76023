"""Token text of log-probability entries (``TokenLogprob.token``), filled in by
the router before they leave the mesh.

A token's text is the text of its bytes on their own
(:meth:`~services.common.detokenizer.TokenizersDecoder.token_bytes`). Bytes
that are not whole UTF-8 characters (half of an emoji, one byte of a CJK
character) are written in OpenAI's ``bytes:`` form, ``\\xNN`` per byte
(``bytes:\\xe6\\x97``), as ``llmesh.v1.TokenLogprob.token`` documents; the
client joins the bytes of consecutive tokens itself.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.common.detokenizer import TokenizersDecoder
from services.common.logprobs import PositionLogprobs, TokenLogprob


def render_token(raw: bytes) -> str:
    """``raw`` as text, or in the ``bytes:\\xNN`` form when it is not valid UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)


class TokenTexts:
    """Renders token ids to their :func:`render_token` text, memoised per id
    (at most the vocabulary). Not thread-safe: one event loop uses it."""

    def __init__(self, decoder: TokenizersDecoder) -> None:
        self._decoder = decoder
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        """The text of ``token_id`` (a valid id)."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = render_token(self._decoder.token_bytes(token_id))
        return text

    def fill(self, entries: Iterable[PositionLogprobs]) -> tuple[PositionLogprobs, ...]:
        """``entries`` with every token's text filled in, in order."""
        return tuple(PositionLogprobs(self._filled(entry.chosen),
                                      tuple(self._filled(t) for t in entry.top))
                     for entry in entries)

    def _filled(self, item: TokenLogprob) -> TokenLogprob:
        return TokenLogprob(item.token_id, item.logprob, item.rank, self.text(item.token_id))
