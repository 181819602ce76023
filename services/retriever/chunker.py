"""Cutting a document into chunks: token windows with overlap.

The rule (the same for every document and every collection):

1. Tokenize the text with the embedding model's tokenizer, without special
   tokens, keeping each token's character span.
2. Windows of ``chunk_tokens`` tokens, window ``i`` starting at token
   ``i × (chunk_tokens − overlap_tokens)``; the last window is the one that
   reaches the last token (a text of at most ``chunk_tokens`` tokens is one
   chunk).
3. A chunk's text is the document's text from the first character of its
   first token to the last character of its last token (original spelling,
   case and spacing kept); chunk ``i`` of document ``d`` is ``d#i``.

Sizes: :data:`DEFAULT_CHUNKING` (128 tokens, 32 shared) unless the collection
or ``--chunk-tokens/--overlap-tokens`` say otherwise; ``chunk_tokens`` at
most :data:`MAX_CHUNK_TOKENS` (all-MiniLM-L6-v2 reads 256 word pieces, two of
them [CLS] and [SEP]), ``overlap_tokens`` below ``chunk_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.retriever.embedder import Tokenizer

#: Most tokens per chunk: the model's 256 word pieces less [CLS] and [SEP].
MAX_CHUNK_TOKENS = 254


@dataclass(frozen=True)
class Chunking:
    """Chunk sizes in tokens of the embedding model's tokenizer."""

    chunk_tokens: int
    overlap_tokens: int

    def __post_init__(self) -> None:
        if not 1 <= self.chunk_tokens <= MAX_CHUNK_TOKENS:
            raise ValueError(f"chunk_tokens must be in [1, {MAX_CHUNK_TOKENS}], "
                             f"got {self.chunk_tokens}")
        if not 0 <= self.overlap_tokens < self.chunk_tokens:
            raise ValueError(f"overlap_tokens must be in [0, chunk_tokens), "
                             f"got {self.overlap_tokens} with chunk_tokens {self.chunk_tokens}")

    @property
    def stride(self) -> int:
        """Tokens between the starts of consecutive chunks."""
        return self.chunk_tokens - self.overlap_tokens


DEFAULT_CHUNKING = Chunking(chunk_tokens=128, overlap_tokens=32)


def chunk_text(text: str, tokenizer: Tokenizer, chunking: Chunking) -> list[str]:
    """The chunks of ``text`` by the module's rule; empty for a text with no token."""
    spans = tokenizer(text, add_special_tokens=False,
                      return_offsets_mapping=True)["offset_mapping"]
    if not spans:
        return []
    starts = list(range(0, max(len(spans) - chunking.overlap_tokens, 1), chunking.stride))
    chunks = []
    for start in starts:
        end = min(start + chunking.chunk_tokens, len(spans))
        chunks.append(text[spans[start][0]:spans[end - 1][1]])
        if end == len(spans):
            break
    return chunks
