"""Which engine replica a request goes to: the routing policies.

``--routing-policy`` picks one of:

``round_robin``
  Replicas in turn, whatever their load or cache.

``least_load``
  Fewest requests this router has open on the replica (for an interactive
  request, fewest interactive ones first: a replica preempts batch sequences
  for it); ties in turn.

``kv_aware`` (the default when more than one replica serves)
  The replica where the request adds the least time, in seconds, to the
  completion times of everyone concerned: its own (first token, then its
  decode steps in the batch it joins) and the sequences' already there (its
  prefill stalls their steps; its rows slow each of their steps). Dynamo's KV
  router and llm-d's scorers weigh the same two things, cache overlap and
  load; here both are priced in the replica's own measured step times::

      p     = prompt_tokens - matched_tokens - offloaded_tokens  # its prefill after the hits
      r     = restore(offloaded_tokens)           # copying the offload tier's hit back
      Q     = pending_prefill_tokens + unreported_prefill_tokens
      B     = running + waiting + unreported_sequences  # the batch it joins
      k     = choices (n), L = min(max_tokens, decode_horizon_tokens)
      t(r)  = the replica's decode step of r rows, prefill(x) its time for x tokens
      cost  = k * (prefill(Q + p) + r + L * t(B + k))     # its own completion
            + B * (prefill(p) + r + (L - 1) * (t(B + k) - t(B)))   # what the batch loses
            + k * slot_wait                               # 0 with a free slot

  So a hot prefix stays with the replicas that hold it while one more
  sequence there slows the batch by less than a prefill elsewhere costs, and
  spreads beyond that; a long uncached prompt avoids a busy replica, since its
  prefill stalls every sequence there. ``t`` and ``prefill`` come from the
  replica's load report (``StepProfile``: measured by the engine; for a
  replica that has measured nothing yet, a measured peer's (replicas of a
  pool run one model, and priors from another machine would make the fresh
  replica look faster or slower than it is); else the priors of
  :mod:`services.common.step_profile`).

  ``slot_wait``: the request waits for ``q`` = sequences on the replica
  (running + waiting + sent since the report) + k - ``max_num_seqs``
  sequences to finish, when positive (for an interactive request only this
  router's interactive ones count, since the engine preempts batch sequences
  for it). The router knows each stream it opened there (its ``max_tokens``
  and the tokens it generated so far: :class:`~services.router.engine_client.OpenRequest`),
  so ``slot_wait`` = the q-th smallest of their tokens left times the
  replica's decode step of ``max_num_seqs`` rows. It assumes every sequence
  runs to its ``max_tokens`` (exact with ``ignore_eos``; an EOS or a stop
  string only frees the slot sooner, and so does a speculative step that
  yields several tokens): the estimate is an upper bound, so a wait chosen
  on it is repaid at worst. When fewer than ``q`` of the sequences there
  are this router's with a known length (the others are another router's,
  or the report counts more than this router sent), the wait is not
  bounded: it is priced as ``prefill(slot_wait_tokens) * q``.

  ``matched_tokens`` (leading prompt tokens in the replica's KV pool) and
  ``offloaded_tokens`` (the tokens after those in its KV offload tier: a hit
  there costs ``restore``, the replica's measured seconds per restored token,
  between a pool hit's nothing and a prefill) come from the cache service's
  prefix index (``ScorePrefix`` of the prompt's block hashes); the load from the
  replica's ``StreamLoad`` (:mod:`services.router.load_watch`). A replica
  whose load report is stale (over 1 s old), or whose KV cache is at least
  ``kv_full_usage`` used (a new sequence there preempts another), costs
  infinity: it goes after every finite cost of its group (below).

  The replicas known to start the request at once (a free sequence slot for
  each of its ``n`` choices among every priority's sequences, so neither a
  wait nor a batch sequence preempted, and room in the KV cache:
  :func:`starts_at_once`) go before those where it would wait, unless
  waiting is repaid in time to the first token: a replica where the wait is
  bounded (above) and its first token, ``slot_wait + prefill(Q + p) + r``,
  comes sooner by more than :data:`TIE_TOLERANCE` than ``prefill(Q + p) + r``
  on every replica that starts the request at once, goes first (QA: a long
  prompt whose prefix the full replica held prefilled whole on the free one,
  TTFT 3.3-4.3 s against ~1 s had it waited). The comparison is on the first
  token alone: decode after it runs at each replica's batch rate, and a
  measured decode profile is the noisiest input (under contention a free
  replica measured 4x slower); a wait the router cannot bound never beats a
  free slot. So a stale report (infinity) or a faster measured profile on the
  full replica never makes a request wait beside a free slot (CI: 4
  interactive streams split 3/1 over two 2-slot engines), nor does a prefix
  hit smaller than the prefill it saves. A stale report does not demote a
  free replica: this router's open streams are exact, and a replica that
  stops answering leaves routing by its health probe. In each group (waiting
  repaid, free, the others) costs within :data:`TIE_TOLERANCE` (10 %) of the
  group's cheapest tie; ties go to the least loaded (open requests), then in
  turn. Without a cache service, or when the index does not answer in time,
  matched tokens are 0 and the policy routes by load alone.

Session affinity (``GenerateStream``): the replica that served a
conversation's previous turn takes the next one unless it is gone, its
cost is infinite, the request would wait there and start at once on the
first in the order (a free slot, or a wait that is repaid), or it costs more than the prefill of
``affinity_slack_tokens`` (on that replica) above the cheapest (then the
conversation moves, paying its prefill once).

The weights' defaults and the measurements behind them are in
docs/architecture.md ("Routing across replicas").

Threading: everything on the router's event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import structlog

from services.common.block_hash import prompt_block_hashes, scoped_seed
from services.common.sampling import Priority
from services.common.step_profile import StepProfile
from services.common.wire.engine_info import LoadStats
from services.router.clients import CacheClient
from services.router.engine_client import EngineClient
from services.router.load_watch import LoadView
from services.router.metrics import RouterMetrics

log = structlog.get_logger()

#: ``kv_aware`` costs within this fraction of the cheapest count as a tie:
#: two alike replicas measure step times that differ by noise of about this
#: order under contention, and without it the one that happened to measure
#: faster took every request while both were idle.
TIE_TOLERANCE = 0.1


class RoutingPolicy(enum.Enum):
    """The ``--routing-policy`` values."""

    ROUND_ROBIN = "round_robin"
    LEAST_LOAD = "least_load"
    KV_AWARE = "kv_aware"


@dataclass(frozen=True)
class CostWeights:
    """The constants of the ``kv_aware`` cost (see the module docstring).

    Attributes:
      decode_horizon_tokens: most decode steps the cost looks ahead (a
        request's ``max_tokens`` beyond it counts as this many: most requests
        end before a large limit).
      slot_wait_tokens: prefill-token equivalents of waiting for a sequence slot
        (a running sequence to finish) when the wait cannot be bounded (the
        sequences ahead are not all this router's streams of known length).
      kv_full_usage: KV usage (0..1) from which a replica counts as saturated.
      affinity_slack_tokens: how much more a session's replica may cost than
        the cheapest, in prefill tokens, before the session moves.
    """

    decode_horizon_tokens: float = 256.0
    slot_wait_tokens: float = 2048.0
    kv_full_usage: float = 0.95
    affinity_slack_tokens: float = 2048.0

    def __post_init__(self) -> None:
        for name in ("decode_horizon_tokens", "slot_wait_tokens", "affinity_slack_tokens"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if not 0 < self.kv_full_usage <= 1:
            raise ValueError(f"kv_full_usage must be in (0, 1], got {self.kv_full_usage}")


@dataclass
class RoutingSession:
    """A conversation's routing memory (one per ``GenerateStream`` call).

    Attributes:
      replica: the replica that served its last turn (None before the first).
    """

    replica: EngineClient | None = None


@dataclass(frozen=True)
class CachedPrefix:
    """Leading prompt tokens a replica holds.

    Attributes:
      tokens: in its KV pool (a hit costs nothing).
      offloaded_tokens: right after those, in its KV offload tier (a hit
        costs a restore).
    """

    tokens: int
    offloaded_tokens: int = 0

    @property
    def total(self) -> int:
        """Tokens it need not prefill."""
        return self.tokens + self.offloaded_tokens


NO_PREFIX = CachedPrefix(0)


@dataclass(frozen=True)
class RouteHint:
    """What the policy knows of a request when it dispatches it.

    Attributes:
      prompt_tokens: the prompt's length in tokens.
      matches: a task resolving to replica → leading prompt tokens cached there
        (:class:`CachedPrefix`; started early, beside the response-cache
        lookup), or None.
      session: the conversation's routing memory, or None.
      max_tokens: most tokens each choice may generate (0: unknown, one
        decode step counts).
      num_choices: sequences the request runs (``n``).
    """

    prompt_tokens: int
    matches: asyncio.Task[dict[EngineClient, CachedPrefix]] | None = None
    session: RoutingSession | None = None
    max_tokens: int = 0
    num_choices: int = 1


@dataclass(frozen=True)
class Choice:
    """A routing decision: replicas to try in order, each one's predicted prefix
    hit (tokens) and ``kv_aware`` cost."""

    order: list[EngineClient]
    matches: dict[EngineClient, CachedPrefix] = field(default_factory=dict)
    costs: dict[EngineClient, float] = field(default_factory=dict)


def replica_cost(hint: RouteHint, matched_tokens: int, view: LoadView,
                 weights: CostWeights, slots: SlotUse | None = None,
                 peer: StepProfile | None = None, offloaded_tokens: int = 0) -> float:
    """The ``kv_aware`` cost of one replica for ``hint``'s request, in seconds
    (module docstring; inf: saturated); ``peer``: the profile to use if the
    replica has measured nothing."""
    if view.stale or view.load is None or view.load.kv_cache_usage >= weights.kv_full_usage:
        return math.inf
    load = view.load
    profile = pricing_profile(load, peer)
    # What ended since the report still counts here (it frees slots only,
    # all_sequences): a replica that just served a request stays priced as
    # busier until its report shows it idle, so separate calls spread over
    # idle replicas instead of all going to the one measured faster.
    batch = load.num_running + load.num_waiting + view.unreported_sequences
    choices = max(hint.num_choices, 1)
    steps = max(min(hint.max_tokens, weights.decode_horizon_tokens), 1)
    own_prefill = max(hint.prompt_tokens - matched_tokens - offloaded_tokens, 0)
    restore = profile.restore_s(offloaded_tokens)
    queued_prefill = load.num_pending_prefill_tokens + view.unreported_prefill_tokens
    joined = profile.decode_step(batch + choices)
    slowdown = joined - profile.decode_step(batch)
    own = choices * (profile.prefill_s(queued_prefill + own_prefill) + restore + steps * joined)
    imposed = batch * (profile.prefill_s(own_prefill) + restore + (steps - 1) * slowdown)
    return own + imposed + _wait_price(slots, profile, weights, choices)


def _wait_price(slots: SlotUse | None, profile: StepProfile, weights: CostWeights,
                choices: int) -> float:
    """Seconds the ``kv_aware`` cost adds for waiting for sequence slots: each
    choice's bounded wait (:func:`slot_wait_s`), else ``slot_wait_tokens`` of
    prefill per sequence that must finish first."""
    if slots is None or slots.queued == 0:
        return 0.0
    wait = slot_wait_s(slots, profile)
    if wait is None:
        return profile.prefill_s(round(weights.slot_wait_tokens)) * slots.queued
    return choices * wait


def slot_wait_s(slots: SlotUse | None, profile: StepProfile) -> float | None:
    """Seconds until the request has its slots on the replica (module doc:
    the ``queued``-th soonest end among this router's sequences there, each
    run to its ``max_tokens`` at the decode step of a full batch); 0 with
    free slots; None when it cannot be bounded (slots unknown, or fewer
    sequences of known length than must end)."""
    if slots is None:
        return None
    queued = slots.queued
    if queued == 0:
        return 0.0
    if queued > len(slots.tokens_left):
        return None
    return slots.tokens_left[queued - 1] * profile.decode_step(slots.max_num_seqs)


def first_token_s(hint: RouteHint, prefix: CachedPrefix, view: LoadView,
                  profile: StepProfile, wait_s: float) -> float:
    """Predicted seconds to the request's first token on a replica: ``wait_s``
    for its slots, then the prefill queued there and its own after the
    prefix hit (the restore of an offload-tier hit included)."""
    load = view.load
    queued = view.unreported_prefill_tokens + (0 if load is None
                                               else load.num_pending_prefill_tokens)
    own = max(hint.prompt_tokens - prefix.total, 0)
    return wait_s + profile.prefill_s(queued + own) + profile.restore_s(prefix.offloaded_tokens)


def pricing_profile(load: LoadStats, peer: StepProfile | None) -> StepProfile:
    """The step costs a replica is priced by: its own once it measured any,
    else ``peer``'s (a measured replica of the same pool), else the priors."""
    if load.step_profile.measured or peer is None:
        return load.step_profile
    return peer


@dataclass(frozen=True)
class SlotUse:
    """A replica's sequence slots as a request of some priority sees them.

    Attributes:
      busy: sequences ahead of it for a slot.
      max_num_seqs: the replica's slots.
      need: slots the request takes (one per choice, ``n``).
      tokens_left: of the ``busy`` sequences, this router's of known length,
        each as the most tokens it may still generate, ascending
        (:meth:`EngineClient.tokens_left`).
    """

    busy: int
    max_num_seqs: int
    need: int = 1
    tokens_left: tuple[int, ...] = ()

    @property
    def queued(self) -> int:
        """Sequences that must finish before the request has all its slots (0: they are free)."""
        return max(self.busy + self.need - self.max_num_seqs, 0)


def starts_at_once(view: LoadView, slots: SlotUse | None, weights: CostWeights) -> bool:
    """True when the replica has free sequence slots for all the request's
    choices by a count the router knows (``slots``: every priority's
    sequences, :func:`all_sequences`) and room in its KV cache: the request
    joins its batch at the next step instead of waiting for a sequence to
    finish or preempting one (an interactive request preempts batch ones:
    that is no free slot either). A stale report does not change this: this
    router's own open streams are exact, and a replica that stopped answering
    leaves routing by its health probe (:mod:`services.router.replicas`)."""
    return (slots is not None and slots.queued == 0 and view.load is not None
            and view.load.kv_cache_usage < weights.kv_full_usage)


def slot_use(engine: EngineClient, view: LoadView, priority: Priority,
             need: int = 1) -> SlotUse | None:
    """``engine``'s slots for a request of ``priority`` and ``need`` choices
    (None: slots unknown): an interactive request counts only the interactive
    sequences (the engine preempts batch ones for it), any other every
    sequence (:func:`all_sequences`)."""
    if priority is Priority.INTERACTIVE:
        everything = all_sequences(engine, view, need)
        return None if everything is None else dataclasses.replace(
            everything, busy=engine.sequences_interactive,
            tokens_left=tuple(engine.tokens_left(priority)))
    return all_sequences(engine, view, need)


def all_sequences(engine: EngineClient, view: LoadView, need: int = 1) -> SlotUse | None:
    """``engine``'s slots against every sequence on it, whatever its priority
    (None: slots unknown): the report brought up to date with what this
    router sent and saw end since (:attr:`LoadView.sequences`). The report
    lags (a request sent just before it may be missing from it and from the
    unreported count it resets); this router's own open sequences on the
    replica are exact, so they count when the report shows fewer."""
    if engine.info is None or not engine.info.max_num_seqs or view.load is None:
        return None
    return SlotUse(max(view.sequences, engine.sequences), engine.info.max_num_seqs, need,
                   tuple(engine.tokens_left(Priority.BATCH)))


class ReplicaPicker:
    """Orders the serving replicas for a request under one policy.

    Args:
      policy: the routing policy.
      cache: the cache service client (the prefix index), or None.
      metrics: the router's metrics.
      weights: the ``kv_aware`` constants.
      score_timeout_s: most seconds a ``ScorePrefix`` may take.
    """

    def __init__(self, policy: RoutingPolicy, cache: CacheClient | None,
                 metrics: RouterMetrics, weights: CostWeights = CostWeights(),
                 score_timeout_s: float = 0.05) -> None:
        self.policy = policy
        self.cache = cache
        self.metrics = metrics
        self.weights = weights
        self._score_timeout = score_timeout_s
        self._next = 0

    def wants_matches(self, serving: Sequence[EngineClient]) -> bool:
        """True when this request's prefix matches are worth a ``ScorePrefix``."""
        return (self.policy is RoutingPolicy.KV_AWARE and self.cache is not None
                and len(serving) > 1)

    async def prefix_matches(self, prompt_ids: Sequence[int], serving: Sequence[EngineClient],
                             cache_scope: str = "") -> dict[EngineClient, CachedPrefix]:
        """Leading prompt tokens each replica holds in its prefix cache (its
        pool, then its offload tier) for a
        request of ``cache_scope`` (its blocks hash from the scoped seed, as
        the engine hashes them: :func:`~services.common.block_hash.scoped_seed`),
        from the index (one ``ScorePrefix`` per distinct hash seed and block
        size among ``serving``, usually one). Never raises: an error counts
        as no match."""
        assert self.cache is not None
        groups: dict[tuple[bytes, int], list[EngineClient]] = {}
        ambiguous = duplicate_replica_ids(serving)
        for engine in serving:
            info = engine.info
            if (info is not None and info.kv_block_size and info.kv_hash_seed
                    and info.replica_id not in ambiguous):
                groups.setdefault((info.kv_hash_seed, info.kv_block_size), []).append(engine)
        matches: dict[EngineClient, CachedPrefix] = {}
        for (seed, block_size), engines in groups.items():
            hashes = prompt_block_hashes(scoped_seed(seed, cache_scope), prompt_ids, block_size)
            if not hashes:
                continue
            started = time.perf_counter()
            scores = await self.cache.score_prefix(
                hashes, deadline=time.monotonic() + self._score_timeout)
            self.metrics.prefix_score_duration.observe(time.perf_counter() - started)
            for engine in engines:
                found = (scores or {}).get(engine.info.replica_id if engine.info else "")
                if found is not None and (found.blocks or found.offloaded):
                    matches[engine] = CachedPrefix(found.blocks * block_size,
                                                   found.offloaded * block_size)
        return matches

    async def choose(self, serving: list[EngineClient], priority: Priority,
                     hint: RouteHint) -> Choice:
        """The order in which to try ``serving`` for this request (mutates the
        rotation)."""
        rotated = self._rotate(serving)
        if self.policy is RoutingPolicy.ROUND_ROBIN:
            return Choice(rotated)
        if self.policy is RoutingPolicy.LEAST_LOAD or len(serving) == 1:
            return Choice(_least_load(rotated, priority))
        matches = await _resolved(hint.matches)
        views = {engine: engine.load_watch.current() for engine in serving}
        peer = next((view.load.step_profile for view in views.values()
                     if view.load is not None and view.load.step_profile.measured), None)
        prices = {engine: self._price(engine, views[engine], priority, hint,
                                      matches.get(engine, NO_PREFIX), peer)
                  for engine in rotated}
        costs = {engine: price.cost for engine, price in prices.items()}
        groups = _groups(prices)
        order = _by_cost(rotated, costs, groups)
        sticky = self._sticky(hint.session, order, costs, views, peer, groups)
        if sticky is not None:
            order.remove(sticky)
            order.insert(0, sticky)
        return Choice(order, matches, costs)

    def _price(self, engine: EngineClient, view: LoadView, priority: Priority, hint: RouteHint,
               prefix: CachedPrefix, peer: StepProfile | None) -> _Price:
        """``engine``'s ``kv_aware`` cost for the request, whether it starts
        the request at once, and when its first token would come there: after
        a slot frees among every priority's sequences (an interactive request
        that preempts a batch sequence waits for none, but costs that sequence
        its progress: no free slot either)."""
        need = max(hint.num_choices, 1)
        slots = slot_use(engine, view, priority, need)
        cost = replica_cost(hint, prefix.tokens, view, self.weights, slots, peer,
                            prefix.offloaded_tokens)
        everything = all_sequences(engine, view, need)
        ready = starts_at_once(view, everything, self.weights)
        if view.load is None:
            return _Price(cost, ready, math.inf)
        profile = pricing_profile(view.load, peer)
        wait = 0.0 if ready else slot_wait_s(everything, profile)
        first = (math.inf if wait is None or math.isinf(cost)
                 else first_token_s(hint, prefix, view, profile, wait))
        return _Price(cost, ready, first)

    def routed(self, engine: EngineClient, choice: Choice, hint: RouteHint) -> None:
        """Books that ``engine`` took the request (metrics; its unreported
        load: prefill tokens and sequences)."""
        held = choice.matches.get(engine, NO_PREFIX).total
        engine.load_watch.dispatched(max(hint.prompt_tokens - held, 0),
                                     max(hint.num_choices, 1))
        self.metrics.routed_requests.labels(engine.target, self.policy.value).inc()

    def _sticky(self, session: RoutingSession | None, order: list[EngineClient],
                costs: dict[EngineClient, float], views: dict[EngineClient, LoadView],
                peer: StepProfile | None, groups: dict[EngineClient, int]) -> EngineClient | None:
        """The session's replica if it should keep the conversation, else None
        (never when ``order[0]`` starts the request at once or its wait there
        is repaid, :func:`_groups`, and neither holds on the session's)."""
        if session is None or session.replica is None or session.replica not in costs:
            return None
        if groups[order[0]] < WAIT_UNREPAID <= groups[session.replica]:
            return None
        cost = costs[session.replica]
        load = views[session.replica].load
        if math.isinf(cost) or load is None:
            return None
        slack = pricing_profile(load, peer).prefill_s(round(self.weights.affinity_slack_tokens))
        return None if cost > costs[order[0]] + slack else session.replica

    def _rotate(self, serving: list[EngineClient]) -> list[EngineClient]:
        n = len(serving)
        start = self._next % n
        self._next = (start + 1) % n
        return [serving[(start + i) % n] for i in range(n)]


def duplicate_replica_ids(engines: Sequence[EngineClient]) -> set[str]:
    """Replica ids that more than one of ``engines`` report (a misconfiguration:
    the index cannot tell them apart, so their matches are not used)."""
    seen: set[str] = set()
    duplicates: set[str] = set()
    for engine in engines:
        replica = engine.info.replica_id if engine.info is not None else ""
        (duplicates if replica in seen else seen).add(replica)
    return duplicates - {""}


@dataclass(frozen=True)
class _Price:
    """A replica for one request: its ``kv_aware`` cost (seconds), whether it
    starts the request at once (:func:`starts_at_once`), and the predicted
    seconds to its first token there (its bounded slot wait included; inf:
    not bounded, or the cost is infinite)."""

    cost: float
    ready: bool
    first_token_s: float


#: The ``kv_aware`` groups, in order (:func:`_groups`).
WAIT_REPAID, STARTS_AT_ONCE, WAIT_UNREPAID = 0, 1, 2


def _groups(prices: dict[EngineClient, _Price]) -> dict[EngineClient, int]:
    """Each replica's group: :data:`WAIT_REPAID` where the request waits for
    a slot and its first token still comes sooner, by more than
    :data:`TIE_TOLERANCE`, than on every replica that starts it at once
    (module doc); :data:`STARTS_AT_ONCE`; else :data:`WAIT_UNREPAID` (and all
    of them when none starts it at once: costs alone order them)."""
    free_first = min((p.first_token_s for p in prices.values() if p.ready), default=math.inf)

    def group(price: _Price) -> int:
        if price.ready:
            return STARTS_AT_ONCE
        repaid = price.first_token_s * (1 + TIE_TOLERANCE) < free_first < math.inf
        return WAIT_REPAID if repaid else WAIT_UNREPAID

    return {engine: group(price) for engine, price in prices.items()}


def _by_cost(rotated: list[EngineClient], costs: dict[EngineClient, float],
             groups: dict[EngineClient, int]) -> list[EngineClient]:
    """``rotated`` ordered for ``kv_aware``: by group (:func:`_groups`: a wait
    repaid before the first token, then a free slot, then the rest), whatever
    the costs; in each group, costs within :data:`TIE_TOLERANCE` of the
    group's cheapest tie, the rest go by cost; ties to the fewest open
    requests, then in turn."""
    near = {group: min((c for e, c in costs.items() if groups[e] == group), default=math.inf)
            * (1 + TIE_TOLERANCE) for group in set(groups.values())}  # inf: all saturated
    return sorted(rotated, key=lambda e: (groups[e], 0.0 if costs[e] <= near[groups[e]]
                                          else costs[e], e.in_flight))  # stable: rotation


def _least_load(rotated: list[EngineClient], priority: Priority) -> list[EngineClient]:
    if priority is Priority.INTERACTIVE:
        return sorted(rotated, key=lambda e: (e.in_flight_interactive, e.in_flight))
    return sorted(rotated, key=lambda e: e.in_flight)  # stable: keeps the rotation


async def _resolved(task: asyncio.Task[dict[EngineClient, CachedPrefix]] | None
                    ) -> dict[EngineClient, CachedPrefix]:
    if task is None:
        return {}
    try:
        return await task
    except Exception as exc:  # noqa: BLE001 - routing by load alone is always possible
        log.warning("prefix_match_failed", error=f"{type(exc).__name__}: {exc}")
        return {}
