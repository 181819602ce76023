"""The suffix decoding proposer (SuffixDecoding, Oliaro et al., arXiv:2411.04975).

For each sequence it looks up two sources and keeps the better one, as the
paper does (the one whose proposal has the higher score, the expected number
of accepted tokens under its empirical probabilities):

* the sequence's own tokens (prompt and output so far, its last ``window``):
  :func:`~services.engine.torch_backend.suffix_cache.request_continuation`,
  the per-request suffix tree's query;
* the engine's :class:`~services.engine.torch_backend.suffix_cache.SuffixCache`
  of recent outputs (every finished sequence's output goes in, whatever method
  it ran with), within the sequence's scope: with ``scope="tenant"`` (the
  default) its request's cache scope only (``SequenceRequest.cache_scope``:
  tenant or cache group, and ``cache_salt``; :mod:`services.common.cache_scope`),
  with ``scope="global"`` the whole engine.

Adaptive length (the paper's ``MAX_SPEC = alpha * p``): a match of ``p``
tokens proposes at most ``ceil(spec_factor * p)``; the path stops where its
empirical probability falls below ``min_token_prob``. Proposals carry those
probabilities (:class:`~services.engine.torch_backend.speculative.Proposal`),
which the speculator's cost rule uses to cut them further.

Each sequence keeps an int64 mirror of its tokens, appended to as they are
verified (no list-to-array copy per step); it is freed by :meth:`retain`.
Threading: the engine thread only.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence as SequenceOf

import numpy as np

from services.engine.torch_backend.sequence import Sequence
from services.engine.torch_backend.spec_options import SuffixOptions
from services.engine.torch_backend.speculative import Proposal
from services.engine.torch_backend.suffix_cache import (
    NO_CONTINUATION,
    Continuation,
    SuffixCache,
    request_continuation,
)

class _Mirror:
    """A sequence's tokens as a growing int64 array."""

    __slots__ = ("array", "size")

    def __init__(self) -> None:
        self.array = np.empty(256, dtype=np.int64)
        self.size = 0

    def sync(self, token_ids: SequenceOf[int]) -> np.ndarray:
        """Appends the tokens of ``token_ids`` past the mirrored ones; returns the view."""
        total = len(token_ids)
        if total > self.array.shape[0]:
            grown = np.empty(max(total, 2 * self.array.shape[0]), dtype=np.int64)
            grown[:self.size] = self.array[:self.size]
            self.array = grown
        if total > self.size:
            self.array[self.size:total] = token_ids[self.size:total]
            self.size = total
        return self.array[:self.size]


class SuffixProposer:
    """Proposes from the sequence's own tokens and the cross-request cache."""

    def __init__(self, options: SuffixOptions = SuffixOptions()) -> None:
        self.options = options
        self.cache = (SuffixCache(options.cache_tokens) if options.cache_tokens else None)
        self._mirrors: dict[int, _Mirror] = {}

    def clear(self) -> None:
        """Forgets every earlier output (a fresh cache; benchmarks compare
        methods from the same cold start)."""
        if self.cache is not None:
            self.cache = SuffixCache(self.options.cache_tokens)

    def _scope(self, seq: Sequence) -> str:
        return seq.request.cache_scope if self.options.scope == "tenant" else ""

    def continuation(self, seq: Sequence, k: int) -> Continuation:
        """The better of the two sources' continuations of ``seq``, at most
        ``k`` tokens, cut to the adaptive length."""
        mirror = self._mirrors.get(seq.arrival)
        if mirror is None:
            mirror = self._mirrors[seq.arrival] = _Mirror()
        tokens = mirror.sync(seq.token_ids)
        opts = self.options
        best = request_continuation(tokens, depth=k, max_match=opts.max_match,
                                    min_prob=opts.min_token_prob, window=opts.window)
        if self.cache is not None:
            shared = self.cache.continuation(tokens, self._scope(seq), depth=k,
                                             max_match=opts.max_match,
                                             min_prob=opts.min_token_prob)
            if shared.score > best.score:
                best = shared
        if not best.tokens:
            return NO_CONTINUATION
        limit = max(1, math.ceil(opts.spec_factor * best.match_len))
        if len(best.tokens) <= limit:
            return best
        return Continuation(best.tokens[:limit], best.probs[:limit], best.match_len)

    def propose(self, requests: SequenceOf[tuple[Sequence, int]]) -> list[list[int]]:
        out: list[list[int]] = []
        for seq, k in requests:
            found = self.continuation(seq, k)
            out.append(Proposal(found.tokens, found.probs))
        return out

    def finished(self, seqs: SequenceOf[Sequence]) -> None:
        """Adds the outputs of ``seqs`` (finished sequences) to the cache."""
        if self.cache is None:
            return
        for seq in seqs:
            if seq.num_generated_tokens >= 2:
                self.cache.insert(seq.token_ids[seq.num_prompt_tokens:], self._scope(seq))

    def retain(self, keys: Collection[int]) -> None:
        for key in [key for key in self._mirrors if key not in keys]:
            del self._mirrors[key]
