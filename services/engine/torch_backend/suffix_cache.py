"""Suffix matching over token buffers: the data structures of suffix decoding.

SuffixDecoding (Oliaro et al., "SuffixDecoding: Extreme Speculative Decoding
for Emerging AI Applications", arXiv:2411.04975; Snowflake's Arctic Inference)
keeps suffix trees over earlier outputs and over the current request, finds the
deepest node matching the sequence's last tokens, and speculates the most
frequent continuation below it, each token scored by the share of occurrences
that continued that way. A suffix tree's node for a pattern ``P`` is the set of
occurrences of ``P``; the counts below it are those occurrences' next tokens.
This module answers the same query from flat token buffers, without the tree:

* :func:`longest_match`: of candidate occurrences of the last token (or
  bigram), those where the longest suffix of the context is found, and its
  length: the deepest node (vectorised, one numpy comparison per matched
  token);
* :func:`best_path`: from those occurrences, the most frequent continuation,
  token by token, with the empirical probability of each prefix (product of
  ``count(child) / count(node)``), cut where it falls below ``min_prob``: the
  speculation tree's best path;
* :class:`SuffixCache`: the cross-request buffer of recent outputs, a ring of
  ``max_tokens`` token ids (the oldest overwritten first) with an index from
  each bigram (per scope: a tenant's outputs are only matched for its own
  requests) to the ring positions where it ends.

Memory (:meth:`SuffixCache.nbytes`): ``4 * max_tokens`` bytes of ring, 8 bytes
per indexed position (stale ones are dropped once they outnumber the live
ones, so at most ``2 * max_tokens`` positions), and ~``KEY_BYTES`` per distinct
(scope, bigram). ``tests/engine/test_suffix_cache.py`` checks the estimate and
the bound against tracemalloc over 10,000 outputs.

Threading: no locks; the engine thread owns every instance.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import numpy as np

#: Marks the end of each output in a :class:`SuffixCache` ring: never a token
#: id, so no match or continuation crosses from one output into the next.
SENTINEL = -1
#: Bits of a token id in an index key (vocabularies up to 2**21 = 2,097,152).
_TOKEN_BITS = 21
_TOKEN_MASK = (1 << _TOKEN_BITS) - 1
#: Bytes per distinct index key besides its positions: the ``array`` object,
#: the key's int and its dict slot (measured on CPython 3.11, x86-64).
KEY_BYTES = sys.getsizeof(array("q")) + 32 + 56


@dataclass(frozen=True)
class Continuation:
    """The best continuation of a context and how sure it is.

    Attributes:
      tokens: the proposed token ids, in order.
      probs: ``probs[j]``: the empirical probability that ``tokens[:j + 1]``
        follows (non-increasing, each above the cut-off).
      match_len: length of the context suffix it was matched on.
    """

    tokens: tuple[int, ...]
    probs: tuple[float, ...]
    match_len: int

    @property
    def score(self) -> float:
        """Expected accepted tokens if the probabilities are right (their sum)."""
        return float(sum(self.probs))


NO_CONTINUATION = Continuation((), (), 0)


def longest_match(buffer: np.ndarray, ends: np.ndarray, context: np.ndarray, *,
                  matched: int, max_match: int, low: int, size: int | None = None
                  ) -> tuple[int, np.ndarray]:
    """The candidates of ``ends`` that match the longest suffix of ``context``.

    Args:
      buffer: token ids (int32); with ``size`` a ring of that many slots,
        addressed ``position % size``.
      ends: absolute positions where ``context``'s last ``matched`` tokens
        are already known to occur, ending there (ascending).
      context: the sequence's tokens so far (at least ``matched``).
      matched: how many of ``context``'s last tokens every candidate matches.
      max_match: longest suffix compared.
      low: the oldest position that still holds its token.
      size: ring size, None for a plain buffer.

    Returns:
      (match length, the candidates matching that many tokens); (0, empty)
      when ``ends`` is empty.
    """
    if ends.size == 0:
        return 0, ends
    alive = ends
    length = matched
    limit = min(max_match, context.shape[0])
    while length < limit:
        positions = alive - length
        inside = positions >= low
        slots = positions if size is None else positions % size
        found = inside & (buffer[np.where(inside, slots, 0)] == context[-1 - length])
        if not found.any():
            break
        alive = alive[found]
        length += 1
    return length, alive


def best_path(buffer: np.ndarray, ends: np.ndarray, *, high: int, depth: int,
              min_prob: float, size: int | None = None) -> tuple[tuple[int, ...],
                                                                tuple[float, ...]]:
    """The most frequent continuation after the occurrences ending at ``ends``.

    At each step the occurrences still on the path vote with their next token
    (an occurrence whose data ends, at ``high`` or a :data:`SENTINEL`, votes
    for nothing but still counts in the share); the winner's share multiplies
    the path's probability. Stops after ``depth`` tokens or before the
    probability falls below ``min_prob``.

    Returns:
      (tokens, cumulative probabilities), both of the same length (maybe 0).
    """
    tokens: list[int] = []
    probs: list[float] = []
    alive = ends
    prob = 1.0
    for step in range(1, depth + 1):
        positions = alive + step
        known = positions < high
        slots = positions if size is None else positions % size
        votes = np.where(known, buffer[np.where(known, slots, 0)], SENTINEL)
        first = votes[0]
        if (votes == first).all():  # one continuation (the common case)
            if first == SENTINEL:
                break
            token, count = int(first), votes.shape[0]
        else:
            values, counts = np.unique(votes[votes != SENTINEL], return_counts=True)
            if values.size == 0:
                break
            best = int(counts.argmax())
            token, count = int(values[best]), int(counts[best])
        prob *= count / votes.shape[0]
        if prob < min_prob:
            break
        tokens.append(token)
        probs.append(prob)
        alive = alive[votes == token]
    return tuple(tokens), tuple(probs)


class SuffixCache:
    """Recent outputs for suffix decoding across requests (module doc).

    Args:
      max_tokens: ring size in tokens (each output takes its length + 1);
        at least 2.
      max_candidates: most recent occurrences of a bigram examined per lookup.
    """

    def __init__(self, max_tokens: int, max_candidates: int = 256) -> None:
        if max_tokens < 2:
            raise ValueError(f"max_tokens must be at least 2, got {max_tokens}")
        if max_candidates < 1:
            raise ValueError(f"max_candidates must be at least 1, got {max_candidates}")
        self.max_tokens = max_tokens
        self.max_candidates = max_candidates
        self._ring = np.full(max_tokens, SENTINEL, dtype=np.int32)
        self._written = 0  # absolute positions written so far
        self._index: dict[int, array] = {}
        self._positions = 0  # entries in the index, stale ones included
        self._scopes: dict[str, int] = {"": 0}
        #: Outputs inserted so far.
        self.num_inserted = 0

    @property
    def num_tokens(self) -> int:
        """Ring slots in use (tokens and end markers)."""
        return min(self._written, self.max_tokens)

    @property
    def num_keys(self) -> int:
        """Distinct (scope, bigram) keys in the index."""
        return len(self._index)

    def nbytes(self) -> int:
        """Estimated bytes held: ring, indexed positions and keys (module doc)."""
        return self._ring.nbytes + 8 * self._positions + KEY_BYTES * len(self._index)

    def _low(self) -> int:
        return max(self._written - self.max_tokens, 0)

    def _scope_id(self, scope: str) -> int:
        found = self._scopes.get(scope)
        if found is None:
            found = self._scopes[scope] = len(self._scopes)
        return found

    def _keys(self, scope_id: int, tokens: np.ndarray) -> np.ndarray:
        """Index keys of the bigrams of ``tokens`` (int64 ``tokens`` of >= 2)."""
        return ((scope_id << (2 * _TOKEN_BITS)) | ((tokens[:-1] & _TOKEN_MASK) << _TOKEN_BITS)
                | (tokens[1:] & _TOKEN_MASK))

    def insert(self, tokens: SequenceOf[int], scope: str = "") -> None:
        """Adds one output (its token ids, each in ``[0, 2**21)``) under ``scope``.

        An output longer than the ring keeps its last ``max_tokens - 1`` tokens;
        one of fewer than 2 tokens has no bigram and is not kept. O(len)
        numpy plus one dict append per token.
        """
        arr = np.asarray(tokens, dtype=np.int64)[-(self.max_tokens - 1):]
        if arr.shape[0] < 2:
            return
        start = self._written
        length = arr.shape[0]
        slots = np.arange(start, start + length + 1) % self.max_tokens
        self._ring[slots[:-1]] = arr
        self._ring[slots[-1]] = SENTINEL
        self._written += length + 1
        index = self._index
        for key, position in zip(self._keys(self._scope_id(scope), arr).tolist(),
                                 range(start + 1, start + length)):
            found = index.get(key)
            if found is None:
                found = index[key] = array("q")
            found.append(position)
        self._positions += length - 1
        self.num_inserted += 1
        if self._positions > 2 * self.max_tokens:
            self._compact()

    def _compact(self) -> None:
        """Drops indexed positions the ring has overwritten, and empty keys."""
        low = self._low()
        kept: dict[int, array] = {}
        total = 0
        for key, positions in self._index.items():
            view = np.frombuffer(positions, dtype=np.int64)
            first = int(np.searchsorted(view, low))
            if first == view.shape[0]:
                continue
            if first:
                positions = array("q", view[first:].tobytes())
            kept[key] = positions
            total += len(positions)
        self._index = kept
        self._positions = total

    @property
    def ring(self) -> np.ndarray:
        """The ring of token ids (read only; slot ``position % max_tokens``)."""
        return self._ring

    @property
    def written(self) -> int:
        """Absolute positions written so far (positions below it hold data)."""
        return self._written

    def match(self, context: np.ndarray, scope: str = "", *,
              max_match: int) -> tuple[int, np.ndarray]:
        """The deepest match of ``context`` (int64 token ids, the sequence so
        far) among this scope's outputs: (its length, the absolute ring
        positions where it ends); (0, empty) without one. Matched on the last
        bigram (its ``max_candidates`` most recent occurrences), then on as
        many earlier tokens as agree, up to ``max_match``."""
        none = (0, np.empty(0, dtype=np.int64))
        scope_id = self._scopes.get(scope)
        if scope_id is None or context.shape[0] < 2:
            return none
        positions = self._index.get(int(self._keys(scope_id, context[-2:])[0]))
        if positions is None:
            return none
        view = np.frombuffer(positions, dtype=np.int64)
        # a copy: a live view of the array would stop later appends to it
        ends = view[max(int(np.searchsorted(view, self._low())),
                        view.shape[0] - self.max_candidates):].copy()
        del view
        return longest_match(self._ring, ends, context, matched=2, max_match=max_match,
                             low=self._low(), size=self.max_tokens)

    def continuation(self, context: np.ndarray, scope: str = "", *, depth: int,
                     max_match: int, min_prob: float) -> Continuation:
        """The best continuation of ``context`` among this scope's outputs:
        :meth:`match`, then :func:`best_path` of at most ``depth`` tokens."""
        if depth <= 0:
            return NO_CONTINUATION
        length, ends = self.match(context, scope, max_match=max_match)
        if length == 0:
            return NO_CONTINUATION
        tokens, probs = best_path(self._ring, ends, high=self._written, depth=depth,
                                  min_prob=min_prob, size=self.max_tokens)
        return Continuation(tokens, probs, length)


def request_continuation(tokens: np.ndarray, *, depth: int, max_match: int,
                         min_prob: float, window: int) -> Continuation:
    """The best continuation of a sequence from its own earlier tokens (the
    per-request suffix tree's query): occurrences of its last token in its
    last ``window`` tokens (not the last position itself), the longest
    suffix match among them, then :func:`best_path`. ``tokens``: int32/int64."""
    length = tokens.shape[0]
    if length < 2 or depth <= 0:
        return NO_CONTINUATION
    start = max(length - window, 0)
    ends = np.flatnonzero(tokens[start:-1] == tokens[-1]) + start
    match, ends = longest_match(tokens, ends, tokens, matched=1, max_match=max_match,
                                low=start)
    if match == 0:
        return NO_CONTINUATION
    found, probs = best_path(tokens, ends, high=length, depth=depth, min_prob=min_prob)
    return Continuation(found, probs, match)
