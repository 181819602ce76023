"""How much to speculate: a cost rule from measured step times and acceptance.

The engine measures its decode steps (no prompt tokens in them) by their row
count ``R``: :class:`StepCostModel` keeps the recent step time of each ``R``
it has timed lately, and estimates the others from their neighbours. The time
is not linear here: on 2 Zen 4 cores a step of 1 to 4 rows cost ~4.8 to 7.2
ms, one of 5 rows ~9 ms, when the native integer kernels took rows in tiles
of four (``docs/engine.md``, speculative decoding numbers; now rows from 5
share a 32-row chunk).

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

import bisect
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field

from services.common.sampling import SpeculativeMethod
from services.common.step_profile import PRIOR_ROW_S, prior_decode_step_s

# The prior decode step (services/common/step_profile.py: ~4.6 ms + ~0.8 ms a
# row, SmolLM2 int4 on 2 Zen 4 cores). Only its shape matters once the engine
# has timed a step: a count the engine has not timed is scaled from the
# nearest one it has.
#: Steps of a row count timed before its own average replaces the estimate
#: from its neighbours.
MIN_SAMPLES = 3


@dataclass
class StepCostModel:
    """Decode step time by row count, from the engine's own recent steps.

    Each row count keeps the moving average of its step times. Its average is
    trusted while it is *fresh*: timed at least ``MIN_SAMPLES`` times, the
    last within the last ``stale_after`` decode steps. Any other count is
    estimated from the nearest trusted ones: linearly between two; above
    them along the steeper of the last two trusted counts' line and the
    prior's shape ``a + b * R`` scaled to the largest; below them by that
    shape (the prior alone before any count is trusted). A stale count takes
    the lower of that estimate and its own old average; when it is timed
    again, the new step replaces the old average.

    Why the staleness: the cost rule stops proposing the rows whose measured
    cost was high, so a count is timed again only if it is tried again. Steps
    timed in a spell of contention (a benchmark client or another process on
    the same two cores: 2-row steps took 2-3.5x a 1-row step there, against
    1.15x on a quiet machine) kept speculation off for good after the
    contention ended, since the 1-row steps that kept running were timed anew
    and the multi-row ones never were. The optimistic estimate makes the rule
    try such a count again within ``stale_after`` steps, and what it measures
    then stands; on a machine whose costs have not changed, that try costs
    one step's extra rows per count and ``stale_after`` steps. The cut-off
    decisions (:func:`choose_lengths`, ``Speculator.bar``) use ratios of step
    times only.

    Attributes:
      table_weight: least weight of a new step in its row count's average
        (the first ``1 / table_weight`` steps are averaged plainly).
      stale_after: decode steps (of any count) after which a count's average
        is stale (64: ~0.3 s of one stream here).
      stall: a step slower than this many times its estimate counts as that
        (one GC pause or preemption cannot turn speculation off).
    """

    table_weight: float = 0.1
    stale_after: int = 64
    stall: float = 3.0
    # rows -> [average seconds, steps timed, index of the last one]
    _table: dict[int, list[float]] = field(default_factory=dict, repr=False)
    _steps: int = field(default=0, repr=False)
    # trusted counts, ascending, and the estimates asked for since the last
    # step (both rebuilt at each step)
    _trusted: list[int] = field(default_factory=list, repr=False)
    _estimates: dict[int, float] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.table_weight <= 1:
            raise ValueError(f"table_weight must be in (0, 1], got {self.table_weight}")
        if self.stale_after < 1 or not self.stall > 1:
            raise ValueError(f"need stale_after >= 1 and stall > 1, got {self.stale_after} "
                             f"and {self.stall}")

    def _fresh(self, entry: list[float]) -> bool:
        return self._steps - entry[2] <= self.stale_after

    def observe(self, rows: int, seconds: float) -> None:
        """One decode step of ``rows`` rows that took ``seconds``."""
        if rows <= 0 or seconds <= 0:
            return
        seconds = min(seconds, self.stall * self.seconds(rows))
        found = self._table.get(rows)
        if found is None or not self._fresh(found):  # a stale average starts afresh
            self._table[rows] = [seconds, 1.0 if found is None else found[1] + 1, self._steps]
        else:
            weight = max(self.table_weight, 1.0 / (found[1] + 1))
            found[0] += weight * (seconds - found[0])
            found[1] += 1
            found[2] = self._steps
        self._steps += 1
        self._trusted = sorted(count for count, entry in self._table.items()
                               if entry[1] >= MIN_SAMPLES and self._fresh(entry))
        self._estimates = {}

    @property
    def measured(self) -> bool:
        """True once some row count's own average is trusted (before, every
        estimate is the prior's)."""
        return bool(self._trusted)

    def seconds(self, rows: int) -> float:
        """Estimated seconds of a decode step of ``rows`` rows (class doc)."""
        cached = self._estimates.get(rows)
        if cached is not None:
            return cached
        found = self._table.get(rows)
        if found is not None and found[1] >= MIN_SAMPLES and self._fresh(found):
            estimate = found[0]
        else:
            estimate = self._from_neighbours(rows)
            if found is not None and not self._fresh(found):
                estimate = min(estimate, found[0])
        self._estimates[rows] = estimate
        return estimate

    def _from_neighbours(self, rows: int) -> float:
        trusted = self._trusted
        if not trusted:
            return prior_decode_step_s(rows)
        at = bisect.bisect_left(trusted, rows)
        below = trusted[at - 1] if at > 0 else None
        above = trusted[at] if at < len(trusted) else None
        if below is not None and above is not None:
            low, high = self._table[below][0], self._table[above][0]
            return low + (high - low) * (rows - below) / (above - below)
        if above is not None:
            return (self._table[above][0] * prior_decode_step_s(rows)
                    / prior_decode_step_s(above))
        assert below is not None
        top = self._table[below][0]
        slope = top * PRIOR_ROW_S / prior_decode_step_s(below)
        if at >= 2:  # the steeper of the prior's shape and the last two trusted counts
            second = trusted[at - 2]
            slope = max(slope, (top - self._table[second][0]) / (below - second))
        return top + slope * (rows - below)


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
      method_relax: the same for a method's per-position records at each
        step it scores nothing (:meth:`idle_method`; slower: they speak for
        every sequence of the method).
      min_factor: the least a sequence's record scales its estimates by
        (0.5; measured: at 0.02 a few failed guesses silenced n-gram lookup
        through the copy stretches that followed, 1.29x became 1.14x on the
        input-grounded set; at 1.0 the repeated set lost 1.69x to 1.52x).
    """

    decay: float = 0.9
    method_decay: float = 0.98
    prior_steps: float = 2.0
    relax: float = 0.98
    method_relax: float = 0.995
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

    def idle_method(self, method: SpeculativeMethod) -> None:
        """``method`` had sequences to speculate for this step but scored no
        proposal: its per-position records move back toward ratio 1
        (``method_relax``), as a sequence's do in :meth:`idle`. Without it a method
        whose first drafts failed (a cold start on text it could not predict)
        stayed below every later bar for good, since only drafts update its
        records (measured: four failed warm-up drafts kept suffix decoding off
        through 2,500 steps of four clients repeating one answer its cache held)."""
        weight = (1 - self.method_relax) * self.prior_steps
        for (owner, _), found in self._positions.items():
            if owner is method:
                found.add(self.method_relax, weight, weight)

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
