"""How much to speculate: a cost rule from measured step times and acceptance.

The engine measures its decode steps (no prompt tokens in them) by their row
count ``R``: :class:`StepCostModel` keeps the recent step time of each ``R``
it has seen, and a linear fit ``a + b * R`` for the others. The time is not
linear here: the native integer kernels work on rows in groups of four, so on
2 Zen 4 cores a step of 1 to 4 rows costs ~4.8 to 7.2 ms, one of 5 rows ~9 ms
(``docs/engine.md``, speculative decoding numbers).

A step with ``n`` decoding sequences emits at least ``n`` tokens; a proposed
token adds a row and, with probability ``q`` (that it and every proposal
before it are accepted), a token. :func:`choose_lengths` orders all proposed
tokens by ``q`` (a proposal's tokens stay in order, since ``q`` falls along
it) and keeps the prefix of that order with the most expected tokens per
second, ``(n + sum of q) / t(n + kept)``: every proposal is cut to the tokens
that pay for their rows, with the step-time jumps taken into account. In a
big batch a row costs about as much as a step's share per sequence, so only
proposals that are nearly sure survive: this replaces the fixed
``--speculative-disable-batch-size`` (still there as a hard cut-off).

``q`` comes from the proposer, calibrated (:class:`AcceptanceModel`): the
suffix proposer gives each token the share of earlier occurrences that
continued with it, n-gram and draft proposals none; the method's measured
acceptance by position corrects both, and the sequence's own recent record
scales the result, so a sequence in a copy region speculates further and one
whose proposals keep failing stops (and tries again later).

Sources: the expected-tokens-per-second rule is ours; vLLM decides by batch
size alone (``disable_by_batch_size``) and SuffixDecoding by the path score
alone. Threading: the engine thread only.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field

from services.common.sampling import SpeculativeMethod

#: Prior decode step: ``a`` seconds for the step, ``b`` per row (measured:
#: SmolLM2 int4 on 2 Zen 4 cores, ~4.6 ms + ~0.8 ms a row up to four rows; the
#: engine's own measurements replace it within tens of steps).
PRIOR_STEP_S = 4.6e-3
PRIOR_ROW_S = 0.8e-3
#: Steps of a row count measured before its own time replaces the linear fit.
MIN_SAMPLES = 3


@dataclass
class StepCostModel:
    """Decode step time by row count: measured per count, else linear.

    Attributes:
      decay: weight kept by the past at each observation of the linear fit
        (0.99: ~100 steps).
      table_weight: weight of each new step in its row count's average.
      prior_weight: pseudo-steps of the prior (at 1 and 2 rows) in the fit.
    """

    decay: float = 0.99
    table_weight: float = 0.1
    prior_weight: float = 4.0
    _sums: list[float] = field(default_factory=list, repr=False)
    # rows -> [average seconds, steps seen]
    _table: dict[int, list[float]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.decay < 1:
            raise ValueError(f"decay must be in (0, 1), got {self.decay}")
        w = self.prior_weight / 2
        # Sums of w, w*x, w*x*x, w*y, w*x*y over the prior's two points.
        self._sums = [0.0] * 5
        for rows in (1.0, 2.0):
            self._add(w, rows, PRIOR_STEP_S + PRIOR_ROW_S * rows)

    def _add(self, weight: float, x: float, y: float) -> None:
        s = self._sums
        s[0] += weight
        s[1] += weight * x
        s[2] += weight * x * x
        s[3] += weight * y
        s[4] += weight * x * y

    def observe(self, rows: int, seconds: float) -> None:
        """One decode step of ``rows`` rows that took ``seconds``. A step much
        slower than predicted (a stall: GC, another process) counts as 3x the
        prediction, so one pause cannot turn speculation off."""
        if rows <= 0 or seconds <= 0:
            return
        seconds = min(seconds, 3 * self.seconds(rows))
        self._sums = [value * self.decay for value in self._sums]
        self._add(1.0, float(rows), seconds)
        found = self._table.get(rows)
        if found is None:
            self._table[rows] = [seconds, 1.0]
        else:
            weight = max(self.table_weight, 1.0 / (found[1] + 1))
            found[0] += weight * (seconds - found[0])
            found[1] += 1

    @property
    def per_row(self) -> float:
        """``b`` of the linear fit: seconds one more row costs (> 0)."""
        s0, s1, s2, sy, sxy = self._sums
        var = s0 * s2 - s1 * s1
        if var <= 1e-12 * max(s0 * s2, 1e-30):
            return PRIOR_ROW_S
        return max((s0 * sxy - s1 * sy) / var, 1e-6)

    @property
    def per_step(self) -> float:
        """``a`` of the linear fit: seconds of a step besides its rows (>= 0)."""
        s0, s1, _, sy, _ = self._sums
        return max((sy - self.per_row * s1) / s0, 0.0)

    def seconds(self, rows: int) -> float:
        """Predicted seconds of a decode step of ``rows`` rows: the measured
        average of that count once seen ``MIN_SAMPLES`` times, else the fit."""
        found = self._table.get(rows)
        if found is not None and found[1] >= MIN_SAMPLES:
            return found[0]
        return self.per_step + self.per_row * rows


@dataclass
class _Ratio:
    """Accepted and predicted tokens, exponentially decayed."""

    accepted: float
    predicted: float

    @property
    def ratio(self) -> float:
        return self.accepted / self.predicted

    def add(self, keep: float, accepted: float, predicted: float) -> None:
        self.accepted = self.accepted * keep + accepted
        self.predicted = self.predicted * keep + predicted


#: A proposer that gives no probabilities: each token's conditional
#: probability before calibration (the measured rates replace it).
UNSCORED_PROB = 0.5


@dataclass
class AcceptanceModel:
    """Calibrated acceptance probabilities: by method and position, then by sequence.

    A proposal's raw conditional probabilities ``p_j`` (token ``j`` accepted
    given ``0..j-1`` were: the proposer's ``probs[j] / probs[j-1]``, or
    :data:`UNSCORED_PROB`) become ``min(1, R[method, j] * p_j)``, where
    ``R[method, j]`` is the ratio of tokens accepted at position ``j`` to the
    ``p_j`` predicted there, over the method's recent drafts (a proposer's
    confidence means different things at its first and its tenth token). Their
    running product is scaled by the sequence's own ratio of accepted to
    predicted tokens over its last few drafts (``decay``), so a sequence in a
    copy region speculates further and one whose guesses keep failing stops.

    Attributes:
      decay: weight kept by a sequence's record at each of its drafts (0.9:
        its last ~10 drafts count most).
      method_decay: the same for a method's per-position record.
      prior_steps: pseudo-observations (at ratio 1) behind each ratio.
      relax: weight kept by a sequence's record at each step it does not
        speculate, the rest going back to ratio 1 (so a sequence that stopped
        speculating tries again some tens of steps later).
      min_factor: the least a sequence's record scales its estimates by
        (0.5; measured: at 0.02 a few failed guesses silenced n-gram lookup
        through the copy stretches that followed, 1.29x became 1.14x on the
        input-grounded set; at 1.0 the repeated set lost 1.69x to 1.52x).
    """

    decay: float = 0.9
    method_decay: float = 0.98
    prior_steps: float = 2.0
    relax: float = 0.98
    min_factor: float = 0.5
    _positions: dict[tuple[SpeculativeMethod, int], _Ratio] = field(
        default_factory=dict, repr=False)
    _sequences: dict[int, _Ratio] = field(default_factory=dict, repr=False)
    _scored: set[SpeculativeMethod] = field(default_factory=set, repr=False)

    def _prior(self) -> _Ratio:
        return _Ratio(self.prior_steps, self.prior_steps)

    def factor(self, key: int) -> float:
        """Sequence ``key``'s own ratio of accepted to predicted tokens, in
        [``min_factor``, 4]."""
        seq = self._sequences.get(key)
        return 1.0 if seq is None else min(max(seq.ratio, self.min_factor), 4.0)

    def by_position(self, method: SpeculativeMethod, probs: SequenceOf[float] | None,
                    length: int) -> tuple[float, ...]:
        """The probability that each prefix of a ``length``-token proposal is
        accepted, calibrated by the method's per-position record (``probs``:
        the proposer's cumulative estimates, or None); not yet scaled by the
        sequence's :meth:`factor`."""
        out: list[float] = []
        prob = 1.0
        for j, raw in enumerate(_conditionals(probs, length)):
            found = self._positions.get((method, j))
            prob *= min(1.0, (1.0 if found is None else found.ratio) * raw)
            out.append(prob)
        return tuple(out)

    def ceiling(self, key: int, method: SpeculativeMethod) -> float:
        """The most a first proposed token of sequence ``key`` can be given
        (a certain proposer, calibrated): under the bar, no lookup is worth it."""
        first = self._positions.get((method, 0))
        raw = 1.0 if method in self._scored or first is None else UNSCORED_PROB
        return min(1.0, (1.0 if first is None else first.ratio) * raw) * self.factor(key)

    def observe(self, key: int, method: SpeculativeMethod, probs: SequenceOf[float] | None,
                predicted: SequenceOf[float], accepted: int) -> None:
        """A verified draft of sequence ``key``: ``probs`` the proposer's
        cumulative estimates of its scored proposals (None: none),
        ``predicted`` what :meth:`by_position` made of them; ``accepted`` of
        them were accepted."""
        scored = len(predicted)
        if scored == 0:
            return
        if probs is not None:
            self._scored.add(method)
        for j, raw in enumerate(_conditionals(probs, min(scored, accepted + 1))):
            found = self._positions.setdefault((method, j), self._prior())
            found.add(self.method_decay, 1.0 if j < accepted else 0.0, raw)
        self._sequences.setdefault(key, self._prior()).add(self.decay, accepted,
                                                           float(sum(predicted)))

    def idle(self, key: int) -> None:
        """Sequence ``key`` had no proposal scored this step: its record moves
        back toward ratio 1 (``relax``), so it tries again after a while
        instead of staying off for good."""
        found = self._sequences.get(key)
        if found is not None:
            weight = (1 - self.relax) * self.prior_steps
            found.add(self.relax, weight, weight)

    def retain(self, keys: set[int]) -> None:
        """Forgets the sequences not in ``keys``."""
        for key in [key for key in self._sequences if key not in keys]:
            del self._sequences[key]


def _conditionals(probs: SequenceOf[float] | None, length: int) -> list[float]:
    """Per-token conditional probabilities of the first ``length`` of a
    proposal's cumulative ``probs`` (:data:`UNSCORED_PROB` each without)."""
    if probs is None:
        return [UNSCORED_PROB] * length
    out: list[float] = []
    previous = 1.0
    for prob in probs[:length]:
        out.append(prob / previous if previous > 0 else 0.0)
        previous = prob
    return out


def choose_lengths(probs: SequenceOf[SequenceOf[float]], num_decoding: int,
                   cost: StepCostModel) -> list[int]:
    """How many of each proposal to keep (module doc): ``probs[i][j]`` is the
    calibrated probability that proposal ``i``'s tokens ``0..j`` are all
    accepted (non-increasing in ``j``); ``num_decoding`` the decoding
    sequences of the step (each emits a token anyway). Returns a prefix
    length per proposal: the prefix of the most-likely-first order with the
    most expected tokens per second."""
    order = sorted(((q, j, i) for i, qs in enumerate(probs) for j, q in enumerate(qs)),
                   key=lambda item: (-item[0], item[1]))
    tokens = float(num_decoding)
    best_rate = tokens / cost.seconds(num_decoding)
    best = 0
    for added, (q, _, _) in enumerate(order, start=1):
        if q <= 0:
            break
        tokens += q
        rate = tokens / cost.seconds(num_decoding + added)
        if rate > best_rate:
            best_rate, best = rate, added
    keep = [0] * len(probs)
    for _, j, i in order[:best]:
        keep[i] = max(keep[i], j + 1)
    return keep
