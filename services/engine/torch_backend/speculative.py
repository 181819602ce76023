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
* :class:`~services.engine.torch_backend.suffix_proposer.SuffixProposer`,
  suffix decoding (Oliaro et al. 2024): the most frequent continuation of the
  longest match in the sequence's own tokens or in the engine's cache of
  earlier outputs, with the empirical probability of each token.

How much of a proposal is kept (``cost_model``, the default): the cost rule of
:mod:`~services.engine.torch_backend.spec_policy`, from the step times the
engine measures and each sequence's calibrated acceptance: a proposed token is
scored only while it is likely enough to raise the step's tokens per second.
In a large batch the step is compute-bound and only near-certain proposals
pass; ``disable_batch_size`` (vLLM's ``disable_by_batch_size``) remains as a
hard cut-off: no proposals while more sequences run.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence as SequenceOf
from typing import Protocol

import numpy as np

from services.common.sampling import (
    FinishReason,
    SpeculativeMethod,
    SpeculativeOptions,
)
from services.engine.torch_backend.sequence import Sequence
from services.engine.torch_backend.spec_options import SpeculativeConfig
from services.engine.torch_backend.spec_policy import (
    AcceptanceModel,
    StepCostModel,
    choose_lengths,
)


class Proposal(list[int]):
    """A proposer's tokens for one sequence (a list of ids) and, where the
    proposer estimates them, ``probs[j]``: the probability that tokens
    ``0..j`` are all accepted (None: the speculator uses the method's
    measured acceptance by position)."""

    def __init__(self, tokens: SequenceOf[int] = (),
                 probs: SequenceOf[float] | None = None) -> None:
        super().__init__(tokens)
        self.probs = None if probs is None else tuple(probs)


class Proposer(Protocol):
    """Proposes lookahead tokens for sequences."""

    def propose(self, requests: SequenceOf[tuple[Sequence, int]]) -> list[list[int]]:
        """Up to ``k`` proposals per ``(sequence, k)``, given its ``token_ids``
        (all verified); a :class:`Proposal` where it knows their probabilities.
        Mutates only the proposer's own state."""
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
    """Decides which sequences get proposals, asks their proposer, and cuts the
    proposals by the cost rule (module doc).

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
        #: Decode step times, fitted as they come (:meth:`observe_step`).
        self.cost = StepCostModel()
        #: Acceptance by method and position, and per-sequence calibration.
        self.acceptance = AcceptanceModel()
        # arrival -> (method, the proposer's probabilities of its scored proposals
        # (None: it gives none), their per-position calibration)
        self._predicted: dict[int, tuple[SpeculativeMethod, tuple[float, ...] | None,
                                         tuple[float, ...]]] = {}

    def resolve(self, options: SpeculativeOptions) -> tuple[SpeculativeMethod, int]:
        """A request's effective method and proposal count (its own or the defaults)."""
        method = options.method if options.method is not None else self.config.method
        if method not in self.proposers:
            method = SpeculativeMethod.NONE
        default = (self.config.suffix_num_speculative_tokens
                   if method is SpeculativeMethod.SUFFIX else self.config.num_speculative_tokens)
        count = options.num_speculative_tokens or default
        return method, count if method is not SpeculativeMethod.NONE else 0

    def budget(self, seq: Sequence) -> int:
        """Most proposals ``seq`` may take now: its ``num_spec_tokens``, fewer near
        its ``max_tokens`` or the context window (a step emits at most ``k + 1``)."""
        left = seq.request.sampling.max_tokens - seq.num_generated_tokens
        return max(min(seq.num_spec_tokens, left - 1,
                       self.max_model_len - seq.num_tokens - 1), 0)

    def bar(self, num_running: int) -> float:
        """About the probability a first proposed token must beat to pay for
        its row with ``num_running`` sequences decoding: the average cost of
        the next four rows against the tokens per second without them."""
        n = max(num_running, 1)
        extra = (self.cost.seconds(n + 4) - self.cost.seconds(n)) / 4
        return max(extra, 0.0) * n / self.cost.seconds(n)

    def propose(self, seqs: SequenceOf[Sequence], num_running: int) -> None:
        """Sets ``spec_token_ids`` of each of ``seqs`` (decoding sequences that just
        produced a token): empty while more than ``disable_batch_size`` run;
        with the cost model, each proposal cut to the tokens likely enough to
        pay for their rows (a sequence whose calibrated acceptance cannot
        reach the bar is not even looked up). A method asked for that scores
        nothing in a step relaxes its calibration (``AcceptanceModel.idle_method``)."""
        limit = self.config.disable_batch_size
        if limit is not None and num_running > limit:
            return
        bar = self.bar(num_running) if self.config.cost_model else 0.0
        by_method: dict[SpeculativeMethod, list[tuple[Sequence, int]]] = {}
        asked: set[SpeculativeMethod] = set()
        for seq in seqs:
            if seq.spec_method is SpeculativeMethod.NONE:
                continue
            asked.add(seq.spec_method)
            k = self.budget(seq)
            if k > 0 and self.acceptance.ceiling(seq.arrival, seq.spec_method) > bar:
                by_method.setdefault(seq.spec_method, []).append((seq, k))
            else:
                self.acceptance.idle(seq.arrival)
        # (sequence, proposal, the proposer's probabilities, per-position calibrated
        # ones, those scaled by the sequence's own record)
        chosen: list[tuple[Sequence, list[int], tuple[float, ...] | None, tuple[float, ...],
                           tuple[float, ...]]] = []
        for method, requests in by_method.items():
            for (seq, _), proposal in zip(requests, self.proposers[method].propose(requests)):
                if not proposal:
                    self.acceptance.idle(seq.arrival)
                    continue
                raw = getattr(proposal, "probs", None)
                calibrated = self.acceptance.by_position(method, raw, len(proposal))
                factor = self.acceptance.factor(seq.arrival)
                chosen.append((seq, proposal, raw, calibrated,
                               tuple(min(1.0, factor * q) for q in calibrated)))
        keep = (choose_lengths([q for *_, q in chosen], max(num_running, 1), self.cost)
                if self.config.cost_model else [len(item[1]) for item in chosen])
        drafted: set[SpeculativeMethod] = set()
        for (seq, proposal, raw, calibrated, _), length in zip(chosen, keep):
            if length:
                seq.spec_token_ids[:] = proposal[:length]
                self._predicted[seq.arrival] = (
                    seq.spec_method, None if raw is None else raw[:length], calibrated[:length])
                drafted.add(seq.spec_method)
            else:
                self.acceptance.idle(seq.arrival)
        for method in asked - drafted:
            self.acceptance.idle_method(method)

    def observe_step(self, scheduled: SequenceOf[tuple[Sequence, int, int]],
                     seconds: float, num_rows: int, decode_only: bool) -> None:
        """What a step's verification found: ``(sequence, proposals scored,
        accepted)`` for each sequence whose proposals it scored; the step took
        ``seconds`` for ``num_rows`` rows (the cost model learns from steps
        with no prompt tokens, ``decode_only``)."""
        if decode_only:
            self.cost.observe(num_rows, seconds)
        for seq, scored, accepted in scheduled:
            found = self._predicted.pop(seq.arrival, None)
            if found is not None and scored:
                method, raw, calibrated = found
                self.acceptance.observe(seq.arrival, method,
                                        None if raw is None else raw[:scored],
                                        calibrated[:scored], accepted)

    def finished(self, seqs: SequenceOf[Sequence]) -> None:
        """Hands the outputs of finished sequences (not failed ones) to the
        proposers that learn from traffic (the suffix cache)."""
        done = [seq for seq in seqs if seq.finish_reason is not FinishReason.ERROR]
        if not done:
            return
        for proposer in self.proposers.values():
            learn = getattr(proposer, "finished", None)
            if learn is not None:
                learn(done)

    def cache_size(self) -> tuple[int, int]:
        """Tokens and estimated bytes held by the proposers' caches of earlier
        outputs (the suffix cache)."""
        tokens = nbytes = 0
        for proposer in self.proposers.values():
            cache = getattr(proposer, "cache", None)
            if cache is not None:
                tokens += cache.num_tokens
                nbytes += cache.nbytes()
        return tokens, nbytes

    def retain(self, keys: Collection[int]) -> None:
        """Lets every proposer free the state of sequences no longer running
        (``keys``: the ``arrival`` of each running one)."""
        keys = set(keys)
        for proposer in self.proposers.values():
            proposer.retain(keys)
        self.acceptance.retain(keys)
        for key in [key for key in self._predicted if key not in keys]:
            del self._predicted[key]

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
