"""Speculative decoding: proposers behind one interface, and when to propose.

After each step the engine core asks :class:`Speculator` for the next step's
proposals of every sequence that just produced a token (vLLM v1 proposes from
the just-updated sequences). The scheduler counts them as lookahead tokens,
the model scores them with the sequence's last token in one forward, and
:mod:`~services.engine.torch_backend.rejection_sampler` keeps the accepted
ones. Proposers:

* :class:`NgramProposer`, prompt lookup (Saxena, "Prompt Lookup Decoding",
  2023; vLLM's ``ngram``): find the latest earlier occurrence of the last
  ``n`` tokens (``n`` from ``ngram_max`` down to ``ngram_min``) in the prompt
  and output so far, propose up to ``k`` tokens that followed it; a match
  shorter than ``ngram_full_len`` proposes one token only (a weak match is
  rarely right for long, and every extra row scored costs ~10 % of a step:
  docs/engine.md). No model; numpy over a
  bounded window of the last tokens.
* :class:`~services.engine.torch_backend.draft_proposer.DraftProposer`, a
  smaller model sharing the tokenizer, run ``k`` greedy steps.

Speculation is skipped for a step when more than ``disable_batch_size``
sequences run (vLLM's ``disable_by_batch_size``): in a large batch the step is
compute-bound and scoring ``k`` extra tokens per sequence costs more than the
accepted tokens save.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence as SequenceOf
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from services.common.sampling import MAX_SPECULATIVE_TOKENS, SpeculativeMethod, SpeculativeOptions
from services.engine.torch_backend.sequence import Sequence


@dataclass(frozen=True)
class SpeculativeConfig:
    """Engine defaults of speculative decoding.

    Attributes:
      method: proposer for requests that do not choose one (NONE: off).
      num_speculative_tokens: most proposals per sequence and step, by default.
      ngram_min, ngram_max: n-gram lengths tried, longest first (vLLM's
        ``prompt_lookup_min`` / ``prompt_lookup_max``).
      ngram_full_len: a match of at least this many tokens proposes up to ``k``
        tokens, a shorter one 1 (measured on the spec_decode benchmark: 1.45x
        against 1.38x for n-gram 2..4 with k for every match).
      ngram_window: the n-gram search looks at this many last tokens.
      disable_batch_size: no proposals in a step while more sequences run
        (None: never disabled).
    """

    method: SpeculativeMethod = SpeculativeMethod.NGRAM
    num_speculative_tokens: int = 3
    ngram_min: int = 1
    ngram_max: int = 4
    ngram_full_len: int = 3
    ngram_window: int = 4096
    disable_batch_size: int | None = 2

    def __post_init__(self) -> None:
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min} and "
                             f"{self.ngram_max}")
        if self.ngram_full_len < 1:
            raise ValueError(f"ngram_full_len must be at least 1, got {self.ngram_full_len}")


class Proposer(Protocol):
    """Proposes lookahead tokens for sequences."""

    def propose(self, requests: SequenceOf[tuple[Sequence, int]]) -> list[list[int]]:
        """Up to ``k`` proposals per ``(sequence, k)``, given its ``token_ids``
        (all verified). Mutates only the proposer's own state."""
        ...

    def retain(self, keys: Collection[int]) -> None:
        """Forgets (frees) the state of every sequence whose ``arrival`` (its
        key: a request id may come back while its old sequence runs) is not
        in ``keys``."""
        ...


def propose_ngram(tokens: SequenceOf[int] | np.ndarray, k: int, ngram_min: int,
                  ngram_max: int, full_len: int = 1) -> list[int]:
    """Prompt lookup: the up to ``k`` tokens after the latest earlier occurrence
    of the longest suffix of ``tokens`` of length ``ngram_max`` down to
    ``ngram_min`` (only 1 token when that suffix is shorter than ``full_len``);
    empty when none occurs.

    Cost: one vectorised pass to find earlier positions of the last token, then
    ``O(n * candidates)`` per length ``n``.
    """
    arr = np.asarray(tokens, dtype=np.int64)
    length = arr.shape[0]
    if k <= 0 or length < ngram_min + 1:
        return []
    # ends[i]: an earlier position holding the last token (end of a candidate n-gram)
    ends = np.flatnonzero(arr[:-1] == arr[-1])
    if ends.size == 0:
        return []
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        candidates = ends[ends >= n - 1]
        if candidates.size == 0:
            continue
        match = np.ones(candidates.shape[0], dtype=bool)
        for back in range(1, n):
            match &= arr[candidates - back] == arr[length - 1 - back]
        if match.any():
            end = int(candidates[match][-1])
            return arr[end + 1:end + 1 + (k if n >= full_len else 1)].tolist()
    return []


class NgramProposer:
    """N-gram prompt lookup over the last ``window`` tokens of each sequence."""

    def __init__(self, ngram_min: int = 1, ngram_max: int = 4, window: int = 4096,
                 full_len: int = 1) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.window = window
        self.full_len = full_len

    def propose(self, requests: SequenceOf[tuple[Sequence, int]]) -> list[list[int]]:
        return [propose_ngram(seq.token_ids[-self.window:], k, self.ngram_min, self.ngram_max,
                              self.full_len) for seq, k in requests]

    def retain(self, keys: Collection[int]) -> None:
        """Stateless: nothing to free."""


class Speculator:
    """Decides which sequences get proposals and asks their proposer.

    Args:
      config: engine defaults.
      max_model_len: context window (a sequence never gets proposals past it).
      proposers: the available proposers by method; a request asking for a
        missing one runs without speculation.
    """

    def __init__(self, config: SpeculativeConfig, max_model_len: int,
                 proposers: Mapping[SpeculativeMethod, Proposer]) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposers = dict(proposers)

    def resolve(self, options: SpeculativeOptions) -> tuple[SpeculativeMethod, int]:
        """A request's effective method and proposal count (its own or the defaults)."""
        method = options.method if options.method is not None else self.config.method
        if method not in self.proposers:
            method = SpeculativeMethod.NONE
        count = options.num_speculative_tokens or self.config.num_speculative_tokens
        return method, count if method is not SpeculativeMethod.NONE else 0

    def budget(self, seq: Sequence) -> int:
        """Most proposals ``seq`` may take now: its ``num_spec_tokens``, fewer near
        its ``max_tokens`` or the context window (a step emits at most ``k + 1``)."""
        left = seq.request.sampling.max_tokens - seq.num_generated_tokens
        return max(min(seq.num_spec_tokens, left - 1,
                       self.max_model_len - seq.num_tokens - 1), 0)

    def propose(self, seqs: SequenceOf[Sequence], num_running: int) -> None:
        """Sets ``spec_token_ids`` of each of ``seqs`` (decoding sequences that just
        produced a token): empty while more than ``disable_batch_size`` run."""
        limit = self.config.disable_batch_size
        if limit is not None and num_running > limit:
            return
        by_method: dict[SpeculativeMethod, list[tuple[Sequence, int]]] = {}
        for seq in seqs:
            if seq.spec_method is SpeculativeMethod.NONE:
                continue
            k = self.budget(seq)
            if k > 0:
                by_method.setdefault(seq.spec_method, []).append((seq, k))
        for method, requests in by_method.items():
            for (seq, _), proposal in zip(requests, self.proposers[method].propose(requests)):
                seq.spec_token_ids[:] = proposal

    def retain(self, keys: Collection[int]) -> None:
        """Lets every proposer free the state of sequences no longer running
        (``keys``: the ``arrival`` of each running one)."""
        for proposer in self.proposers.values():
            proposer.retain(keys)

    def check_integrity(self, idle: bool = False) -> None:
        """Checks the block bookkeeping of proposers that hold KV blocks (with
        ``idle``, also that they hold none).

        Raises:
          KVIntegrityError: naming the inconsistency.
        """
        for proposer in self.proposers.values():
            check = getattr(proposer, "check_integrity", None)
            if check is not None:
                check(idle=idle)
