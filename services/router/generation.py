"""The router's request pipeline, independent of the gRPC server API.

:meth:`GenerationPipeline.run` turns a validated request into an async
stream of events: :class:`Delta` values (text safe to send, and the token ids
generated since the previous one), then exactly one :class:`Finished`. The
path, step by step (docs: /work/shared/DESIGN.md "The request path"):

1. prompt ids: prompt text tokenized (with the model's special tokens), or
   the chat template applied (generation prompt added, history trimmed to
   ``max_model_len - 1`` tokens) by the tokenizer service's
   ``Tokenize``/``ApplyChatTemplate``, or with ``--tokenize-in-router`` in
   process on the service's own definition and template
   (:mod:`services.router.local_tokenizer`; the service the fallback); a
   prompt given as token ids (``prompt_tokens``) is used as it is. A chat of
   a model with a history budget is compacted to it instead
   (:mod:`services.router.history`: old turns replaced by a stored summary,
   summarised in the background when one is due). Nothing
   else waits for them: the coalescing and cache keys are made from the
   prompt ids after (tokenizing costs ~0.1 ms in process, less than a
   second key scheme would save; docs/architecture.md "What the mesh
   costs"); with ``request.retrieval`` the request's admission place is
   taken first when it would queue (step 4's queue:
   :meth:`AdmissionController.claim`, sized when the prompt is tokenized),
   then the retriever's Query starts, and its passages go into the chat
   just before the last user turn
   (:mod:`services.router.retrieval`): the request queues for its running
   slot while the Query runs (TTFT ~ max(queue wait, retrieval), not the
   sum); the request's log line, its latency
   histograms (TTFT at the first token) and the cache store come after the
   first token (before it: only an in-flight gauge and counters, ~1 µs each);
2. context check: ``max_tokens`` is clamped to the room the prompt leaves
   (see :mod:`services.router.validation`);
3. coalescing and the response cache (deterministic requests only: greedy
   or seeded, and not ``bypass_cache``): a request identical to one in
   flight joins its generation (:mod:`services.router.single_flight`: no
   lookup, no admission, no engine work; it replays the shared events from
   the start, then follows live); otherwise it starts one, whose own task
   runs the cache lookup (a hit is replayed at once as one delta) and steps
   4-7 for all its subscribers;
4. admission (:mod:`services.router.admission`): a running slot at once, a
   wait in the model's queue (class, tenant-fair order), or RESOURCE_EXHAUSTED
   at once with ``retry-after-ms`` (a request whose class queue is full is
   refused before step 1, with no tokenizer or cache round trip); a
   retrieval-augmented request's place, taken in step 1, is settled to the
   prompt's size here (a coalesced or cached one gives it up; a shared
   generation's leader hands it to the generation);
5. the admitted request goes to the engine replica in routing
   (:mod:`services.router.replicas`: serving, answering its health probes)
   that the routing policy puts first (:mod:`services.router.routing`:
   ``kv_aware`` by cached prefix and load, whose prefix-index lookup runs
   beside the cache lookup and admission; ``least_load``; ``round_robin``;
   a ``GenerateStream`` conversation stays on its replica); UNAVAILABLE or
   RESOURCE_EXHAUSTED before the first token moves on to the next replica in
   routing (each is tried once), so a replica that dies before a request's
   first token costs it only time; after the first token, a failure ends the
   request UNAVAILABLE (its tokens were sent: a retry would repeat them);
6. token ids are detokenized in process (:class:`IncrementalDetokenizer` on
   the tokenizer service's own definition, fetched once at start with
   ``GetTokenizer``: no round trip per token) and pass the
   :class:`StopStringMatcher`; a stop-string match cancels the engine
   sequence at once and ends with FINISH_REASON_STOP + ``matched_stop`` (the
   text ends before the stop string, or after it with
   ``include_stop_str_in_output``).
   With ``sampling.n`` > 1 each choice has its own detokenizer, matcher,
   usage and :class:`Finished` (events carry ``index``); a stop string ends
   its choice alone (the engine frees that choice's blocks at once) and the
   generation ends after the last choice's Finished;
   log-probabilities (``sampling.logprobs`` / ``prompt_logprobs``) ride with
   their ids, token text filled in (:class:`TokenTexts`), cut with them at a
   stop string; such requests are never coalesced nor cached (``_shareable``);
7. a cacheable request that finished normally (STOP or LENGTH) is stored in
   the cache in the background, never delaying the final event.

Cancellation: when the consumer stops iterating (``aclose``) or its task is
cancelled (client gone, deadline passed), the ``finally`` blocks drop the
engine stream at once (a shared generation: when its last subscriber leaves);
``asyncio.CancelledError`` is never swallowed.

Slow readers (:mod:`services.router.slow_reader`): with a budget
(``client_write_timeout_s`` > 0, the router's ``--client-write-timeout-s``,
default 30 s) the events run one step ahead of the client's writes from the
first write that stays blocked 50 ms (before that, in the consumer's own
task); while a write is blocked (the client reads slowly, or not at all) the
deltas that arrive are merged into one pending message per choice (before
the read-ahead starts, in the engine stream's inbox), and a write blocked
longer than the budget while the generation still runs cancels it at once
(the engine frees its KV blocks; a shared generation loses only this
subscriber) and ends the call RESOURCE_EXHAUSTED once that write returns:
the router's per-call buffer budget is what ran out, not the client's own
deadline (DEADLINE_EXCEEDED would tell it to allow more time, which does not
help a client that does not read). Counted in
``llmesh:router_slow_client_cancels_total``.

Deadlines: a request that is not shared passes its deadline to admission and
the engine. A shared generation passes the latest deadline of its
subscribers to admission, and opens the engine stream without one: each
subscriber ends at its own deadline on the router's clock (same statuses),
and the engine sequence is cancelled when the last one has left.

Errors: bad input raises :class:`InvalidRequestError` (INVALID_ARGUMENT,
OUT_OF_RANGE); upstream failures raise :class:`GenerationError`
with the status for the client (UNAVAILABLE, RESOURCE_EXHAUSTED,
DEADLINE_EXCEEDED, INTERNAL, ...).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import structlog
from prometheus_client import Histogram

from services.common import tracing
from services.common.detokenizer import IncrementalDetokenizer, TokenizersDecoder
from services.common.logprobs import PositionLogprobs
from services.common.sampling import FinishReason, InvalidRequestError, SamplingOptions
from services.common.wire.chat import ChatPrompt
from services.common.wire.engine_stream import TokenDelta, Usage
from services.common.wire.tools import ToolCallDelta
from services.router.admission import (
    AdmissionController,
    AdmissionRefused,
    Claim,
    Job,
    NoReplicaServing,
    Ticket,
)
from services.router.cascade.path import AnswerPath
from services.router.cascade.policy import PromptRerouted
from services.router.clients import (
    CacheClient,
    CachedResponse,
    CacheKey,
    UpstreamError,
)
from services.router.engine_client import EngineClient, EngineStream, OpenRequest
from services.router.local_tokenizer import PromptTokenizer
from services.router.logprob_text import TokenTexts
from services.router.metrics import RouterMetrics
from services.router.replicas import ReplicaSet
from services.router.request_trace import (
    end_request_span,
    start_request_span,
    timed_admission_wait,
)
from services.router.retrieval.report import RetrievalReport
from services.router.retrieval.stage import (
    PendingRetrieval,
    RetrievalStage,
    no_retriever,
)
from services.router.routing import (
    CachedPrefix,
    ReplicaPicker,
    RouteHint,
    RoutingPolicy,
    RoutingSession,
)
from services.router.single_flight import (
    CoalescingKey,
    DeadlinePassed,
    Flight,
    SingleFlight,
    Subscription,
)
from services.router.slow_reader import WriteStalled, paced
from services.router.stop_strings import StopStringMatcher
from services.router.validation import GenerationRequest, ModelLimits, fit_to_context

if TYPE_CHECKING:
    from services.router.history.compactor import HistoryCompactor

log = structlog.get_logger()

#: Engine statuses after which another replica is tried (before the first token).
#: Longest a cache lookup waits for a store of the same key still in flight.
_PENDING_STORE_WAIT_SECONDS = 0.5
_RETRYABLE_ENGINE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


@dataclass(frozen=True)
class Delta:
    """Text safe to send (never part of a stop string) and the ids since the last delta.

    Attributes:
      text: the new text.
      token_ids: the new ids.
      logprobs: with ``sampling.logprobs``: one entry per id, token text filled in.
      prompt_logprobs: with ``sampling.prompt_logprobs``: on choice 0's first delta.
      index: the choice (0..n-1) this delta belongs to.
      tool_calls: with tools: the call pieces parsed out of the text
        (:mod:`services.router.tools.stream`; ``text`` then holds content only).
      path: on the first event of an answer to the cascade alias: the path it
        took (:mod:`services.router.cascade`); None otherwise.
    """

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[PositionLogprobs, ...] = ()
    prompt_logprobs: tuple[PositionLogprobs, ...] = ()
    index: int = 0
    tool_calls: tuple[ToolCallDelta, ...] = ()
    path: AnswerPath | None = None


@dataclass(frozen=True)
class Finished:
    """The last event of a generation.

    Attributes:
      reason: STOP (EOS, stop token or stop string), LENGTH (max_tokens or the
        context window), CANCELLED (the engine cancelled it), TOOL_CALLS (set
        by :mod:`services.router.tools.stream`: the answer holds calls).
      matched_stop: the stop string that ended it, or "".
      usage: prompt and completion token counts; ``completion_tokens`` and the
        ids end at the token that completed a stop string, and
        ``cached_prompt_tokens`` is what the engine reused from its prefix
        cache (a replay: every prompt token).
      cached: True when replayed from the response cache.
      index: the choice (0..n-1) that ended; with ``sampling.n`` > 1 each
        choice has its own Finished and ``usage.completion_tokens`` is that
        choice's.
      model: the model that produced the answer (set by
        :meth:`GenerationPipeline.run`).
      path: for an answer to the cascade alias, the path it took.
      retrieval: with ``request.retrieval``: the chunks used and the latency.
    """

    reason: FinishReason
    matched_stop: str
    usage: Usage
    cached: bool = False
    index: int = 0
    model: str = ""
    path: AnswerPath | None = None
    retrieval: RetrievalReport | None = None


Event = Delta | Finished


#: Trailing metadata of an admission refusal: the hint in milliseconds, and
#: in whole seconds (rounded up) for HTTP clients: Envoy's JSON edge passes it
#: on as the ``Retry-After`` header of the 429.
RETRY_AFTER_MS_METADATA_KEY = "retry-after-ms"
RETRY_AFTER_METADATA_KEY = "retry-after"


#: A message that starts with the request field it is about (``a.b[0].c: ...``).
_FIELD_FIRST = re.compile(r"([A-Za-z_][A-Za-z0-9_.\[\]]*): ")


#: Why no replica serves when the pool knows none (its DNS name has no address).
NONE_KNOWN = "none is known: the engines' DNS name resolves to no address"


def no_replica_message(why: str) -> str:
    """The UNAVAILABLE message of a request no engine replica can take."""
    return f"no engine replica is serving ({why}); retry in a few seconds"


class GenerationError(Exception):
    """The request failed upstream; ``code`` is the status for the client,
    ``trailing_metadata`` extra pairs for the call's trailers (the retry hint),
    ``field`` the request field at fault when an upstream refused one (its
    message then starts with it, as :class:`InvalidRequestError`'s do)."""

    def __init__(self, code: grpc.StatusCode, message: str,
                 trailing_metadata: tuple[tuple[str, str], ...] = (),
                 field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.trailing_metadata = trailing_metadata
        self.field = field

    @classmethod
    def refused(cls, err: AdmissionRefused) -> GenerationError:
        """The status of an admission refusal, with the retry hint."""
        ms = err.retry_after_ms
        return cls(err.code, err.message, (
            (RETRY_AFTER_MS_METADATA_KEY, str(ms)),
            (RETRY_AFTER_METADATA_KEY, str(max(1, -(-ms // 1000))))))


@dataclass
class Progress:
    """Live token counts of a running generation, readable by the caller at any
    time (e.g. for the usage of a cancelled generation).

    ``on_dispatch``, when set, is awaited once, as soon as the request was
    sent to an engine replica (not for an answer from the response cache or a
    shared generation): the edge commits its response there (the gRPC edge
    sends the call's response headers, so that they do not ride with the
    first token). Whatever it raises ends the request."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    on_dispatch: Callable[[], Awaitable[None]] | None = None

    def usage(self) -> Usage:
        return Usage(self.prompt_tokens, self.completion_tokens, self.cached_prompt_tokens)


@dataclass
class _Timing:
    """Per-request timestamps (``time.monotonic()`` seconds)."""

    model: str
    received_at: float
    dispatched_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    #: False for a shared generation's own timing: its subscribers observe TTFT
    #: and ITL, each as its events leave to its client.
    observe_tokens: bool = True
    #: The request's ``llmesh.generate`` span (None: not traced), the parent
    #: of its stages' spans and of the other services' spans.
    span: tracing.Span | None = None
    #: (start, end) of an admission wait that ended granted, recorded as its
    #: span when the request ends (:func:`timed_admission_wait`).
    admission_wait: tuple[float, float] | None = None
    #: ``llmesh:inter_token_latency_seconds`` of ``model``, once looked up.
    itl: Histogram | None = None
    #: The TTFT (True) or ITL (False) seconds of the tokens that just left,
    #: observed once they are written (:meth:`GenerationPipeline._observe_token`).
    unobserved: tuple[bool, float] | None = None

    @property
    def ttft(self) -> float | None:
        """Receipt to the first token leaving, or None before it."""
        return None if self.first_token_at is None else self.first_token_at - self.received_at


@dataclass
class _Shared:
    """A shared generation's own values (:attr:`Flight.state`): whose request
    it runs (the leader's id goes to the engine), and its progress, timing and
    log fields."""

    request_id: str
    progress: Progress
    timing: _Timing
    info: dict[str, object] = dataclasses.field(default_factory=dict)


def _clone_error(err: Exception) -> Exception:
    """The status a subscriber of a failed shared generation raises: an
    equivalent :class:`GenerationError`, a fresh one per subscriber."""
    if isinstance(err, GenerationError):  # _shared_work maps every failure to one
        return GenerationError(err.code, err.message, err.trailing_metadata)
    return GenerationError(grpc.StatusCode.INTERNAL, f"internal error in the router: {err!r}")


def _stopped_error() -> Exception:
    return GenerationError(grpc.StatusCode.UNAVAILABLE,
                           "the router is stopping; retry on another router")


def upstream_name(service: str, replica: str, model: str) -> str:
    """How a client is told which upstream failed: an engine by its replica id
    (``engine replica 'host-12' of model 'smol'``), another service by its
    role; never its address (that goes to the router's log)."""
    of = f" of model {model!r}" if model else ""
    if service == "engine":
        return f"engine replica {replica!r}{of}" if replica else f"an engine replica{of}"
    if service in _MESH_WIDE_SERVICES:
        return f"the {service}"
    return f"the {service}" + (f" for model {model!r}" if model else "")


#: Upstreams that serve every model of the mesh: a failure names no model.
_MESH_WIDE_SERVICES = frozenset({"cache", "retriever"})


def upstream_to_generation_error(err: UpstreamError, *, model: str = "",
                                 completion_tokens: int = 0) -> GenerationError:
    """The client-facing status for an upstream failure, and the router's log
    line for it (``upstream_failed`` / ``upstream_refused``, with the call's
    ``request_id``): the log gets the upstream's address and its status
    details; the client gets the upstream's name (:func:`upstream_name`) and
    what to do, and the details only of a refusal of the request's own
    content (INVALID_ARGUMENT, OUT_OF_RANGE, FAILED_PRECONDITION,
    UNIMPLEMENTED), which are the upstream's words about the request.

    Args:
      model: the request's model, named in the message ("" to leave it out).
      completion_tokens: tokens already streamed to the client; a deadline that
        passes after some says the answer was cut, not that nothing came.
    """
    code = err.code
    refused = code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
                       grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED)
    (log.info if refused else log.warning)(
        "upstream_refused" if refused else "upstream_failed", upstream=err.service,
        target=err.target, replica=err.replica, code=code.name, details=err.details)
    who = upstream_name(err.service, err.replica, model)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        if completion_tokens:
            return GenerationError(code, (
                f"the call's deadline passed after {completion_tokens} generated tokens: the "
                "answer is incomplete; allow a longer deadline or ask for fewer max_tokens"))
        if err.client_message:  # a limit of the router's own, not the call's deadline
            return GenerationError(code, err.client_message)
        if err.service == "router":  # the router's own clock ran out between hops
            return GenerationError(code, "the call's deadline passed before the first token; "
                                   "allow a longer deadline")
        return GenerationError(code, f"deadline exceeded waiting for the {err.service} "
                               "(before the first token); allow a longer deadline")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return GenerationError(grpc.StatusCode.UNAVAILABLE,
                               f"{who} is unavailable; retry the request")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return GenerationError(code, f"{who} is at capacity; retry later")
    if code == grpc.StatusCode.ALREADY_EXISTS:
        return GenerationError(code, f"request_id: another request with this id is still "
                               f"running on {who}; use a unique request_id")
    if refused:
        # An engine names the field first (``sampling.structured_output.regex:
        # ...``): that message is the client's. A field the engine backend
        # cannot honour is INVALID_ARGUMENT (older engines said UNIMPLEMENTED,
        # which the OpenAI endpoint would answer with a 5xx that clients
        # retry): the client's to drop, not a fault.
        named = _FIELD_FIRST.match(err.details) if err.service == "engine" else None
        if named is not None:
            if code == grpc.StatusCode.UNIMPLEMENTED:
                code = grpc.StatusCode.INVALID_ARGUMENT
            return GenerationError(code, err.details, field=named[1])
        return GenerationError(code, f"{who} refused the request: {err.details}")
    return GenerationError(grpc.StatusCode.INTERNAL,
                           f"{who} failed ({code.name}); see the router's log for this "
                           "request_id")


class GenerationPipeline:
    """Runs requests through tokenizer, cache and engines (see the module doc).

    One instance per router; it holds the long-lived clients but does not own
    them (the service closes them).
    """

    def __init__(
        self, *, tokenizer: PromptTokenizer, decoder: TokenizersDecoder,
        replicas: ReplicaSet, cache: CacheClient | None,
        models: Mapping[str, ModelLimits], metrics: RouterMetrics, log_content: bool = False,
        admission: Mapping[str, AdmissionController] | None = None,
        picker: ReplicaPicker | None = None, client_write_timeout_s: float = 0.0,
        retrieval: RetrievalStage | None = None,
    ) -> None:
        """Args:
          tokenizer: makes prompt ids (in process with ``--tokenize-in-router``
            when it can, else the tokenizer service:
            :mod:`services.router.local_tokenizer`).
          decoder: the tokenizer's definition (:meth:`TokenizerDefinition.decoder`),
            which detokenizes generated ids in process.
          replicas: the engine replicas (all serve the models in ``models``) and
            which of them take new requests.
          cache: the response cache client, or None when there is no cache.
          models: served models by id.
          metrics: where to record the router's metrics.
          log_content: log prompt and output text (off by default: private data).
          admission: the admission controller of each model (None or a model
            missing: requests go to an engine at once).
          picker: the routing policy (default: ``least_load``).
          client_write_timeout_s: the slow-reader budget (seconds a write to
            the client may stay blocked while its generation runs; see the
            module doc); 0: none (events go to the client as they come).
          retrieval: the retrieval stage (:mod:`services.router.retrieval`);
            None: a request with ``retrieval`` is FAILED_PRECONDITION.
        """
        if client_write_timeout_s < 0:
            raise ValueError(f"client_write_timeout_s must be >= 0 (0: no budget), "
                             f"got {client_write_timeout_s}")
        if not replicas.engines:
            raise ValueError("at least one engine replica is needed")
        self.tokenizer = tokenizer
        self.decoder = decoder
        self.token_texts = TokenTexts(decoder)
        self.replicas = replicas
        self.cache = cache
        self.models = dict(models)
        self.metrics = metrics
        self.log_content = log_content
        self.client_write_timeout_s = client_write_timeout_s
        self.admission = dict(admission or {})
        self.picker = picker or ReplicaPicker(RoutingPolicy.LEAST_LOAD, cache, metrics)
        self.retrieval = retrieval
        # Stores still in flight, by key: a lookup of the same key waits for its
        # store, so a repeat sent right after the answer ends is a hit (the store
        # itself runs after the final message, off the response's path).
        self._pending_stores: dict[CacheKey, asyncio.Future[bool]] = {}
        self._flights: SingleFlight[Event, _Shared] = SingleFlight(
            clone=_clone_error, stopped=_stopped_error)
        #: The model's history compaction (:mod:`services.router.history`),
        #: set by the service when the model has a budget; None: chats are
        #: trimmed to the context window.
        self.history: HistoryCompactor | None = None

    # ------------------------------------------------------------------ API

    async def run(
        self, request: GenerationRequest, *, received_at: float,
        deadline: float | None = None, progress: Progress | None = None,
        session: RoutingSession | None = None,
        reserve_tokens: Callable[[int, int], None] | None = None,
    ) -> AsyncIterator[Event]:
        """Generates ``request``: yields :class:`Delta` events, then one :class:`Finished`.

        Args:
          received_at: its arrival (``time.monotonic()`` s), the origin of TTFT.
          deadline: absolute ``time.monotonic()`` deadline of the client's call, or None.
          progress: updated with live token counts, if given.
          session: the conversation's routing memory (``GenerateStream``), if any.
          reserve_tokens: called with (prompt tokens, clamped max_tokens x n)
            once the prompt is tokenized, before the cache and admission: the
            tenant's token reservation (:mod:`services.router.tenancy`); it
            may raise GenerationError or InvalidRequestError to refuse.

        Raises:
          InvalidRequestError: the prompt does not fit the context window
            (OUT_OF_RANGE) or the tokenizer refused the input.
          GenerationError: an upstream failure, with the client's status.
          PromptRerouted: a cascade leg's prompt is over the prompt-only rule
            (:meth:`CascadeLeg.check_prompt`, after tokenization, before
            admission; outcome ``rerouted``).
        """
        progress = Progress() if progress is None else progress
        timing = _Timing(request.model, received_at, span=start_request_span(request))
        outcome = "cancelled"  # unless set otherwise before leaving
        info: dict[str, object] = {}
        held = _Held()
        self.metrics.requests_in_flight.labels(request.model).inc()
        try:
            prompt_ids, sampling = await self._prepared(
                request, deadline, timing, info, held, progress, reserve_tokens)
            events = await self._answer(request, prompt_ids, sampling, deadline, progress,
                                        timing, info, session, held)
            # aclosing: when our consumer stops early, the engine stream closes now.
            async with contextlib.aclosing(self._paced(events, request.model)) as paced_events:
                async for event in paced_events:
                    if isinstance(event, Finished):
                        outcome = event.reason.name.lower()
                        event = _finished(event, request.model, held, info)
                    yield event
        except PromptRerouted:
            outcome = "rerouted"
            raise
        except Exception as err:
            failure = _client_failure(err, progress.completion_tokens, request.model)
            outcome = "internal" if failure is None else failure.code.name.lower()
            if isinstance(failure, GenerationError):
                info.update(error=failure.message)
            if failure is None or failure is err:
                raise
            raise failure from (err if isinstance(err, UpstreamError) else None)
        finally:
            held.release()
            self._record(request, outcome, progress, timing, info)
            end_request_span(timing.span, request, outcome=outcome, progress=progress,
                             timing=timing, info=info)

    async def _prepared(
        self, request: GenerationRequest, deadline: float | None, timing: _Timing,
        info: dict[str, object], held: _Held, progress: Progress,
        reserve_tokens: Callable[[int, int], None] | None,
    ) -> tuple[tuple[int, ...], SamplingOptions]:
        """:meth:`run`'s steps before the cache and the engine: refuse when full,
        tokenize, the cascade's prompt-only rule, fit ``max_tokens`` to the
        context window, reserve the tenant's tokens. Returns (prompt ids, the
        fitted sampling options); raises what :meth:`run` documents."""
        self._refuse_if_full(request)
        prompt_ids = await self._tokenized(request, deadline, timing, info, held)
        progress.prompt_tokens = len(prompt_ids)
        if request.cascade is not None:
            request.cascade.check_prompt(len(prompt_ids))
        sampling = self._fitted(request, prompt_ids)
        if reserve_tokens is not None:
            reserve_tokens(len(prompt_ids), sampling.max_tokens * sampling.n)
        return prompt_ids, sampling

    async def prompt_ids(self, request: GenerationRequest, *,
                         deadline: float | None) -> tuple[int, ...]:
        """The prompt ids :meth:`run` makes of ``request`` (step 1), for an edge
        that needs them before it runs the request (OpenAI's ``echo``), which
        then passes them back as ``prompt_token_ids``: one tokenization.

        Raises:
          InvalidRequestError: the tokenizer refused the input.
          GenerationError: the tokenizer failed, with the client's status.
        """
        try:
            return await self._prompt_ids(request, self.models[request.model], deadline, {})
        except UpstreamError as err:
            raise upstream_to_generation_error(err, model=request.model) from err

    async def close(self) -> None:
        """Cancels the shared generations and history compactions still
        running, and waits up to a second for the cache stores in flight (the
        cache client's close fails the rest)."""
        await self._flights.close()
        if self.history is not None:
            await self.history.close()
        if self._pending_stores:
            await asyncio.wait(list(self._pending_stores.values()), timeout=1.0)

    # --------------------------------------------------------------- steps

    def _start_retrieval(self, request: GenerationRequest, deadline: float | None,
                         timing: _Timing, held: _Held) -> PendingRetrieval | None:
        """The retriever's Query started (``held`` cancels it if the request
        ends first), when the request asks for passages
        (:mod:`services.router.retrieval.stage`), and the request's admission
        place taken first when it would queue (``held.claim``: it queues for
        its running slot while the Query runs; sized when the prompt is
        known, in :meth:`_admit`). A refusal comes before the Query starts."""
        if request.retrieval is None:
            return None
        if self.retrieval is None:
            raise no_retriever()
        sampling = request.sampling
        held.claim = self._claim(request, 0, sampling.max_tokens * sampling.n, deadline,
                                 only_to_queue=True)
        held.retrieval = self.retrieval.start(
            request.retrieval, model=request.model, request_id=request.request_id,
            cache_scope=request.cache_scope, deadline=deadline, parent=timing.span)
        return held.retrieval

    async def _tokenized(self, request: GenerationRequest, deadline: float | None,
                         timing: _Timing, info: dict[str, object],
                         held: _Held) -> tuple[int, ...]:
        """Step 1: the prompt ids, under the request's ``llmesh.tokenize`` span;
        with retrieval, the retriever's Query started (``held.retrieval``) and
        its passages inserted into the chat first."""
        if (retrieval := self._start_retrieval(request, deadline, timing, held)) is not None:
            assert request.messages is not None  # retrieval needs chat (validation)
            messages = await retrieval.messages(request.messages, held.claim)
            request = dataclasses.replace(request, messages=messages)
            assert retrieval.report is not None
            info.update(retrieval.report.log_fields())
        with tracing.span("llmesh.tokenize", timing.span) as tokenize:
            if tokenize is not None:
                tokenize.set_attribute("llmesh.tokenize.in_process", self.tokenizer.in_process)
            return await self._prompt_ids(request, self.models[request.model], deadline, info,
                                          tracing.traceparent_of(tokenize))

    def _fitted(self, request: GenerationRequest, prompt_ids: tuple[int, ...]
                ) -> SamplingOptions:
        """Step 2: the request's sampling with ``max_tokens`` clamped to the room
        the context window leaves (OUT_OF_RANGE when there is none)."""
        sampling = request.sampling
        max_tokens = fit_to_context(len(prompt_ids), sampling.max_tokens,
                                    self.models[request.model].max_model_len,
                                    field=request.input_field)
        if max_tokens == sampling.max_tokens and sampling.min_tokens <= max_tokens:
            return sampling  # it fits (the usual case): no copy
        return dataclasses.replace(sampling, max_tokens=max_tokens,
                                   min_tokens=min(sampling.min_tokens, max_tokens))

    async def _answer(
        self, request: GenerationRequest, prompt_ids: tuple[int, ...],
        sampling: SamplingOptions, deadline: float | None, progress: Progress,
        timing: _Timing, info: dict[str, object], session: RoutingSession | None, held: _Held,
    ) -> AsyncIterator[Event]:
        """Step 3: where the answer comes from. A shareable request joins or
        starts the shared generation (response cache inside it); any other is
        admitted and computed alone by an engine (nothing to look up or share),
        the prefix-index lookup running beside admission. ``held`` gets what
        the caller releases at the end (admission ticket, lookup task); its
        ``claim`` (a place taken while the passages were retrieved) is
        settled to the prompt's size, or handed to the shared generation."""
        if _shareable(request.sampling) and not request.bypass_cache:
            return self._shared(request, prompt_ids, sampling, deadline, progress, timing,
                                info, session, held)
        held.matches = self._start_prefix_matches(request, prompt_ids)
        # n choices hold the engine for n x max_tokens (the prompt once)
        with timed_admission_wait(timing):
            held.ticket = await self._admit(request, len(prompt_ids),
                                            sampling.max_tokens * sampling.n, deadline,
                                            held.claim)
        return self._from_engine(request, prompt_ids, sampling,
                                 self._cache_key(request, prompt_ids), deadline, progress,
                                 timing, info, held.ticket,
                                 RouteHint(len(prompt_ids), held.matches, session,
                                           sampling.max_tokens, sampling.n))

    def _paced(self, events: AsyncIterator[Event], model: str) -> AsyncIterator[Event]:
        """Step 4: ``events`` under the slow-reader budget (module doc), when set."""
        if self.client_write_timeout_s <= 0:
            return events

        def count() -> None:
            self.metrics.slow_client_cancels.labels(model).inc()
            log.info("slow_client_cancelled", budget_s=self.client_write_timeout_s)

        return paced(events, write_timeout_s=self.client_write_timeout_s,
                     merge=merge_deltas, on_stall=count)

    async def _prompt_ids(self, request: GenerationRequest, limits: ModelLimits,
                          deadline: float | None, info: dict[str, object],
                          traceparent: str = "") -> tuple[int, ...]:
        if request.prompt_token_ids is not None:  # the caller's ids, checked at the edge
            return request.prompt_token_ids
        if request.messages is None:
            assert request.prompt is not None
            try:
                return await self.tokenizer.tokenize(
                    request.prompt, add_special_tokens=True, request_id=request.request_id,
                    deadline=deadline, traceparent=traceparent)
            except UpstreamError as err:
                if err.code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise InvalidRequestError("prompt", f"the tokenizer refused it: "
                                              f"{err.details}") from err
                raise
        try:
            chat = await self._chat_prompt(request, limits, deadline, info, traceparent)
        except UpstreamError as err:
            if err.code == grpc.StatusCode.OUT_OF_RANGE:
                raise InvalidRequestError(
                    "chat.messages", f"does not fit the context window of "
                    f"{limits.max_model_len} tokens even with only the last message: "
                    f"{err.details}", grpc.StatusCode.OUT_OF_RANGE) from err
            if err.code == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidRequestError(
                    "chat.messages", f"the chat template refused the conversation: "
                    f"{err.details}") from err
            if err.code == grpc.StatusCode.FAILED_PRECONDITION:
                raise InvalidRequestError(
                    "chat", f"the model has no chat template; send `prompt` text instead "
                    f"({err.details})", grpc.StatusCode.FAILED_PRECONDITION) from err
            raise
        if chat.num_dropped_messages:
            info.update(dropped_messages=chat.num_dropped_messages)
        return chat.token_ids

    async def _chat_prompt(self, request: GenerationRequest, limits: ModelLimits,
                           deadline: float | None, info: dict[str, object],
                           traceparent: str) -> ChatPrompt:
        """The chat template applied, history trimmed to the context window or,
        with history compaction (:attr:`history`), compacted to its budget
        (what it did goes into ``info`` for the usage). Raises UpstreamError."""
        if self.history is not None and not request.history_exempt:
            chat, report = await self.history.prompt(
                request, max_prompt_tokens=limits.max_model_len - 1, deadline=deadline,
                traceparent=traceparent)
            if report.turns_summarized:
                info.update(history_turns_summarized=report.turns_summarized,
                            history_tokens_saved=report.tokens_saved)
            return chat
        return await self.tokenizer.apply_chat_template(
            request.messages or (), add_generation_prompt=True,
            max_prompt_tokens=limits.max_model_len - 1, request_id=request.request_id,
            deadline=deadline, allow_special_tokens=request.allow_special_tokens,
            traceparent=traceparent, tools=request.chat_tools)

    def _cache_key(self, request: GenerationRequest,
                   prompt_ids: tuple[int, ...]) -> CacheKey | None:
        """The response-cache key of a deterministic request when there is a cache."""
        if self.cache is None or not _shareable(request.sampling):
            return None
        return CacheKey(request.model, prompt_ids, request.sampling, request.cache_scope)

    async def _shared(
        self, request: GenerationRequest, prompt_ids: tuple[int, ...],
        sampling: SamplingOptions, deadline: float | None, progress: Progress,
        timing: _Timing, info: dict[str, object], session: RoutingSession | None,
        held: _Held,
    ) -> AsyncIterator[Event]:
        """Joins the identical generation in flight, or starts it
        (:mod:`services.router.single_flight`), and passes its events on; this
        request's progress, TTFT and ITL follow the events it is sent.

        Raises:
          GenerationError: the shared generation's failure (the same status for
            every subscriber).
          UpstreamError: DEADLINE_EXCEEDED (service ``router``) at ``deadline``.
        """
        subscription, leader = self._join_or_start(request, prompt_ids, sampling, deadline,
                                                   timing, session, held)
        shared = subscription.flight.state
        texts: list[str] = []
        try:
            async with contextlib.aclosing(subscription):
                if not leader:
                    self.metrics.coalesced_requests.labels(request.model).inc()
                    info.update(coalesced_with=shared.request_id)
                async for event in subscription:
                    progress.cached_prompt_tokens = shared.progress.cached_prompt_tokens
                    if isinstance(event, Delta):
                        if event.token_ids:
                            progress.completion_tokens += len(event.token_ids)
                            self._token_time(timing)
                        if self.log_content:
                            texts.append(event.text)
                    else:
                        progress.completion_tokens = event.usage.completion_tokens
                        progress.cached_prompt_tokens = event.usage.cached_prompt_tokens
                        if event.cached:
                            info.update(cached=True)
                        if self.log_content:
                            info.update(output="".join(texts))
                    yield event
        except DeadlinePassed:
            raise UpstreamError("router", "-", grpc.StatusCode.DEADLINE_EXCEEDED,
                                "the call's deadline passed") from None
        finally:
            if "engine" in shared.info:
                info.setdefault("engine", shared.info["engine"])
            if leader:
                timing.dispatched_at = shared.timing.dispatched_at

    def _join_or_start(
        self, request: GenerationRequest, prompt_ids: tuple[int, ...],
        sampling: SamplingOptions, deadline: float | None, timing: _Timing,
        session: RoutingSession | None, held: _Held,
    ) -> tuple[Subscription[Event, _Shared], bool]:
        """The identical generation's flight joined, or started (True).
        ``held.claim`` (an admission place taken early) is given up on joining,
        and owned by the flight it starts (given up when its task ends). Awaits
        nothing since the table is read: requests that arrive together find
        the same flight."""
        key = CoalescingKey(request.model, prompt_ids, sampling, request.speculative,
                            request.priority, request.cache_scope)
        joined = self._flights.join(key, deadline)
        claim, held.claim = held.claim, None
        if joined is not None:
            if claim is not None:
                claim.cancel()
            return joined, False
        state = _Shared(request.request_id, Progress(prompt_tokens=len(prompt_ids)),
                        _Timing(request.model, timing.received_at, observe_tokens=False,
                                span=timing.span))
        started = self._flights.start(
            key, deadline, state,
            lambda flight: self._shared_work(flight, request, prompt_ids, sampling,
                                             session, claim))
        task = started.flight.task
        if claim is not None and task is not None:
            task.add_done_callback(lambda _: claim.cancel())
        return started, True

    async def _shared_work(
        self, flight: Flight[Event, _Shared], request: GenerationRequest,
        prompt_ids: tuple[int, ...], sampling: SamplingOptions,
        session: RoutingSession | None, claim: Claim | None,
    ) -> AsyncIterator[Event]:
        """A shared generation (steps 3-7 of the module doc for the leader's
        ``request``), run by its flight's task: every failure leaves as a
        :class:`GenerationError`, the status each subscriber gets. The
        prefix-index lookup runs beside the cache lookup and admission;
        ``claim``: the leader's admission place taken early (given up on a
        cache hit)."""
        shared = flight.state
        progress, timing, info = shared.progress, shared.timing, shared.info
        key = self._cache_key(request, prompt_ids)
        ticket: Ticket | None = None
        matches = self._start_prefix_matches(request, prompt_ids)
        try:
            with tracing.span("llmesh.cache_lookup", timing.span) as lookup:
                hit = await self._cache_lookup(key, request, flight.latest_deadline(),
                                               tracing.metadata_of(lookup))
            if hit is not None:
                if claim is not None:
                    claim.cancel()
                info.update(cached=True, output=hit.text)
                events = self._replay(hit, progress, timing)
            else:
                deadline = flight.latest_deadline()
                with (flight.bound_by(deadline),
                      tracing.span("llmesh.admission_wait", timing.span)):
                    ticket = await self._admit(request, len(prompt_ids), sampling.max_tokens,
                                               deadline, claim)
                # No engine deadline: each subscriber ends at its own, and the last
                # one leaving cancels the stream.
                events = self._from_engine(request, prompt_ids, sampling, key, None,
                                           progress, timing, info, ticket,
                                           RouteHint(len(prompt_ids), matches, session,
                                                     sampling.max_tokens, sampling.n))
            async with contextlib.aclosing(events):
                async for event in events:
                    yield event
        except GenerationError:
            raise
        except UpstreamError as err:
            raise upstream_to_generation_error(
                err, model=request.model, completion_tokens=progress.completion_tokens) from err
        except Exception as err:
            log.error("internal_error", exc_info=err)
            raise GenerationError(grpc.StatusCode.INTERNAL, (
                f"internal error in the router (request_id={request.request_id}); "
                "see its logs")) from err
        finally:  # the claim, if any: given up when the flight's task ends (_join_or_start)
            if matches is not None:
                matches.cancel()
            if ticket is not None:
                ticket.release()

    async def _cache_lookup(self, key: CacheKey | None, request: GenerationRequest,
                            deadline: float | None,
                            trace_metadata: Sequence[tuple[str, str]] = ()
                            ) -> CachedResponse | None:
        if key is None or self.cache is None:
            return None
        self.metrics.cache_queries.labels(request.model).inc()
        # One cache budget for the lookup, the wait for a pending store included
        # (QA: with the cache stalled, 0.5 s of waiting then the lookup's own 0.5 s).
        budget = time.monotonic() + self.cache.timeout
        budget = budget if deadline is None else min(budget, deadline)
        pending = self._pending_stores.get(key)
        if pending is not None and self.cache.connected():  # else the lookup misses anyway
            await asyncio.wait([pending], timeout=min(_PENDING_STORE_WAIT_SECONDS,
                                                      max(budget - time.monotonic(), 0.0)))
        try:
            hit = await self.cache.get(key, request_id=request.request_id, deadline=budget,
                                       trace_metadata=trace_metadata)
        except UpstreamError:  # DEADLINE_EXCEEDED: the budget passed before the call
            if budget == deadline:
                raise  # the client's own deadline
            return None  # the cache's budget, spent waiting: a miss, not an error
        if hit is not None:
            self.metrics.cache_hits.labels(request.model).inc()
        return hit

    async def _replay(self, hit: CachedResponse, progress: Progress,
                      timing: _Timing) -> AsyncIterator[Event]:
        progress.completion_tokens = len(hit.token_ids)
        # Nothing was prefilled: the whole prompt counts as cached, and ``cached``
        # tells a replay from an engine run that reused every prompt block.
        progress.cached_prompt_tokens = progress.prompt_tokens
        self._token_time(timing)
        yield Delta(hit.text, hit.token_ids)
        yield Finished(hit.finish_reason, hit.matched_stop, progress.usage(), cached=True)

    def _start_prefix_matches(self, request: GenerationRequest, prompt_ids: tuple[int, ...]
                              ) -> asyncio.Task[dict[EngineClient, CachedPrefix]] | None:
        """Starts the prefix-index lookup of ``prompt_ids`` in the request's
        cache scope (it runs beside the cache lookup and admission), when the
        policy uses one."""
        serving = self.replicas.serving()
        if not self.picker.wants_matches(serving):
            return None
        return asyncio.create_task(
            self.picker.prefix_matches(prompt_ids, serving, request.cache_scope))

    def _serving_replicas(self) -> list[EngineClient]:
        """The replicas in routing. Raises GenerationError (UNAVAILABLE) for none."""
        serving = self.replicas.serving()
        if not serving:
            known = len(self.replicas.engines)
            why = (f"of {known} known, each failed, went silent or is draining" if known else
                   NONE_KNOWN)
            raise GenerationError(grpc.StatusCode.UNAVAILABLE, no_replica_message(why))
        return serving

    async def _open_engine(
        self, request: GenerationRequest, prompt_ids: tuple[int, ...],
        sampling: SamplingOptions, deadline: float | None, timing: _Timing, hint: RouteHint,
        on_dispatch: Callable[[], Awaitable[None]] | None = None, ticket: Ticket | None = None,
    ) -> tuple[EngineClient, OpenRequest, EngineStream, TokenDelta]:
        """Opens a stream on the best replica that answers (the routing policy's
        order); returns it with its first delta. ``on_dispatch`` (:class:`Progress`) is
        awaited once the first replica tried has the start. The chosen replica
        counts the request (:meth:`EngineClient.opened`: the returned record);
        the caller uncounts it.
        ``ticket`` (the admission slot) is placed on each replica tried, so it
        counts against that replica's capacity alone.
        """
        failures: list[UpstreamError] = []
        choice = await self.picker.choose(self._serving_replicas(), request.priority, hint)
        for engine in choice.order:
            if ((failures and not self.replicas.is_serving(engine))
                    or not self.replicas.is_member(engine)):
                continue  # left routing while an earlier one was tried, or left DNS
            opened = engine.opened(request.priority, sampling.n, sampling.max_tokens)
            if ticket is not None:
                ticket.place(engine, opened)
            stream: EngineStream | None = None
            ok = False
            try:
                stream = engine.start(
                    prompt_ids, sampling, priority=request.priority,
                    request_id=request.request_id, deadline=deadline,
                    speculative=request.speculative, tenant=request.tenant,
                    cache_scope=request.cache_scope,
                    traceparent=tracing.traceparent_of(timing.span))
                # Booked before any await: a request routed meanwhile sees it.
                self.picker.routed(engine, choice, hint)
                dispatched = timing.dispatched_at is None  # once, even when retried
                if dispatched:
                    timing.dispatched_at = time.monotonic()
                # The start leaves now: the bookkeeping and the response headers
                # follow it instead of holding it (~0.3 ms at one stream).
                await stream.flush()
                if dispatched:
                    await self._dispatched(request.model, timing, on_dispatch)
                first = await stream.read()
                ok = True
                if hint.session is not None:
                    hint.session.replica = engine
                return engine, opened, stream, first
            except UpstreamError as err:
                if err.code not in _RETRYABLE_ENGINE_CODES:
                    raise
                log.warning("engine_unavailable", engine=engine.target, code=err.code.name,
                            details=err.details)
                self.metrics.engine_retries.labels(request.model, err.code.name.lower()).inc()
                failures.append(err)
            finally:
                if not ok:
                    engine.closed(opened)
                    if stream is not None:
                        stream.close()
        raise _no_replica_took(request.model, failures)

    async def _dispatched(self, model: str, timing: _Timing,
                          on_dispatch: Callable[[], Awaitable[None]] | None) -> None:
        """After the request's start left for its first replica: its queue time
        (received to dispatched) observed, and ``on_dispatch`` awaited (the
        response headers, while the engine prefills)."""
        assert timing.dispatched_at is not None
        self.metrics.request_queue_time.labels(model).observe(
            timing.dispatched_at - timing.received_at)
        if on_dispatch is not None:
            await on_dispatch()

    async def _from_engine(
        self, request: GenerationRequest, prompt_ids: tuple[int, ...],
        sampling: SamplingOptions, key: CacheKey | None, deadline: float | None,
        progress: Progress, timing: _Timing, info: dict[str, object], ticket: Ticket | None,
        hint: RouteHint,
    ) -> AsyncIterator[Event]:
        """The engine's answer as events; ``ticket`` (the admission slot, released
        by the caller) hears of every token that leaves."""
        engine, opened, stream, delta = await self._open_engine(
            request, prompt_ids, sampling, deadline, timing, hint, progress.on_dispatch, ticket)
        info.update(engine=engine.target)
        cached_tokens = delta.num_cached_tokens
        # One detokenizer and stop-string matcher per choice (``sampling.n``).
        choices = [_ChoiceOutput(StopStringMatcher(sampling.stop,
                                                   sampling.include_stop_str_in_output),
                                 IncrementalDetokenizer(self.decoder, skip_special_tokens=True))
                   for _ in range(sampling.n)]
        hidden_ids = self._hidden_ids(request, sampling)
        keep_output = key is not None or self.log_content
        try:
            while True:
                opened.advance(delta.index, len(delta.token_ids), delta.finished)
                choice = _choice_of(choices, delta, engine)
                if choice.finished:  # ended on a stop string; the engine's last words
                    delta = await stream.read()
                    continue
                safe, ids, finished = await self._choice_step(
                    choice, delta, hidden_ids, sampling, progress, engine, stream)
                progress.completion_tokens = sum(c.completion_tokens for c in choices)
                if keep_output:
                    choice.text.append(safe)
                    choice.ids.extend(ids)
                # An update with no token may still carry the prompt's logprobs
                # (choice 0 ended CANCELLED before its first token): they go on.
                if safe or ids or delta.prompt_logprobs:
                    if ids:
                        now = self._token_time(timing, observe=False)
                        if ticket is not None:
                            ticket.on_tokens(len(ids), now)
                    yield self._delta(safe, ids, delta)
                    self._observe_token(timing)  # once written: off the token's path
                if finished is not None:
                    self._choice_finished(request, choices, choice, finished, key, info)
                    yield finished
                    if all(c.finished for c in choices):
                        return
                delta = await stream.read()
        finally:
            engine.closed(opened)
            stream.close()
            self._observe_token(timing)  # the consumer stopped at the token's write
            self.metrics.prefix_hit_tokens.labels(request.model).observe(cached_tokens)

    def _hidden_ids(self, request: GenerationRequest, sampling: SamplingOptions
                    ) -> frozenset[int]:
        """The ids whose text is never returned: a stop token id (or EOS, unless
        ignored) ends the sequence, so it can only be the last id; it counts in
        usage."""
        eos = () if sampling.ignore_eos else self.models[request.model].eos_token_ids
        return frozenset(sampling.stop_token_ids) | frozenset(eos)

    async def _choice_step(
        self, choice: _ChoiceOutput, delta: TokenDelta, hidden_ids: frozenset[int],
        sampling: SamplingOptions, progress: Progress, engine: EngineClient,
        stream: EngineStream,
    ) -> tuple[str, tuple[int, ...], Finished | None]:
        """One engine update of one choice: its ids detokenized, the text fed to
        the choice's stop-string matcher. Returns the text safe to send, the ids
        it covers (all, or those through a stop string) and the choice's
        :class:`Finished` when it ended (a stop string tells the engine to end
        the sequence, or this choice, at once)."""
        ids = delta.token_ids
        progress.cached_prompt_tokens = delta.num_cached_tokens
        shown = ([p for p, i in enumerate(ids) if i not in hidden_ids] if hidden_ids
                 else range(len(ids)))
        last = delta.finished
        matcher = choice.matcher
        text, text_ends = self._detokenize(choice.detok, [ids[p] for p in shown], engine,
                                           last=last, with_ends=bool(matcher.stops))
        safe, stop = matcher.feed(text)
        if stop is not None:
            if sampling.n == 1:
                await stream.cancel()
            else:
                stream.cancel_choice(delta.index)
            ids = _ids_through_stop(ids, shown, text_ends, matcher.match_end)
            choice.completion_tokens += len(ids)
            return safe, ids, Finished(FinishReason.STOP, stop, choice.usage(progress),
                                       index=delta.index)
        choice.completion_tokens += len(ids)
        if not last:
            return safe, ids, None
        return safe + matcher.flush(), ids, self._engine_finished(delta, progress, choice)

    def _choice_finished(self, request: GenerationRequest, choices: Sequence[_ChoiceOutput],
                         choice: _ChoiceOutput, finished: Finished, key: CacheKey | None,
                         info: dict[str, object]) -> None:
        """Marks ``choice`` finished; with the last one the output goes to the log
        fields (when kept), and a choice that ended on STOP or LENGTH is stored
        in the response cache (under ``key``, when set)."""
        choice.finished = True
        if (key is not None or self.log_content) and all(c.finished for c in choices):
            texts = ["".join(c.text) for c in choices]
            info.update(output=texts[0] if len(texts) == 1 else texts)
        if key is not None and finished.reason in (FinishReason.STOP, FinishReason.LENGTH):
            self._store(key, CachedResponse(tuple(choice.ids), "".join(choice.text),
                                            finished.reason, finished.matched_stop),
                        request.request_id)

    def _delta(self, text: str, ids: tuple[int, ...], delta: TokenDelta) -> Delta:
        """The event for ``ids`` (the leading ids of ``delta``: all, or those
        through a stop string) with their log-probabilities, token text filled
        in (the entries past a stop string are dropped, like their ids)."""
        if not (delta.logprobs or delta.prompt_logprobs):
            return Delta(text, ids, index=delta.index)
        return Delta(text, ids, logprobs=self.token_texts.fill(delta.logprobs[:len(ids)]),
                     prompt_logprobs=self.token_texts.fill(delta.prompt_logprobs),
                     index=delta.index)

    def _refuse_if_full(self, request: GenerationRequest) -> None:
        """Refuses at once, before tokenization and the cache lookup, a request
        whose class's queue is full (:meth:`AdmissionController.refuse_if_full`):
        under overload the refusal costs no round trip (a would-be cache hit is
        refused too; it is served whenever the queue has room).

        Raises:
          GenerationError: RESOURCE_EXHAUSTED with the retry hint.
        """
        controller = self.admission.get(request.model)
        if controller is not None:
            try:
                controller.refuse_if_full(request.priority)
            except AdmissionRefused as err:
                raise GenerationError.refused(err) from None

    def _claim(self, request: GenerationRequest, prompt_tokens: int, max_tokens: int,
               deadline: float | None, *, only_to_queue: bool = False) -> Claim | None:
        """The request's place in its model's admission (a running slot or a
        queue position: :meth:`AdmissionController.claim`), taken now; None
        when the model has no admission controller, or with ``only_to_queue``
        when a slot is free now (a request whose prompt is not ready yet
        takes no slot it would hold idle: it queues early only when it must
        queue anyway).

        Raises:
          GenerationError: UNAVAILABLE at once when no engine replica is in
            routing; RESOURCE_EXHAUSTED refused at once (retry hint in the
            trailing metadata).
        """
        self._serving_replicas()
        controller = self.admission.get(request.model)
        if controller is None:
            return None
        job = Job(request.request_id, request.priority, request.tenant, prompt_tokens,
                  max_tokens, sequences=max(request.sampling.n, 1))
        if only_to_queue and not controller.would_queue(job):
            return None
        try:
            return controller.claim(job, deadline=deadline)
        except AdmissionRefused as err:
            raise GenerationError.refused(err) from None

    async def _admit(self, request: GenerationRequest, prompt_tokens: int, max_tokens: int,
                     deadline: float | None, claim: Claim | None = None) -> Ticket | None:
        """A running slot from the model's admission controller (None: it has
        none): ``claim`` (taken before the prompt was known, :meth:`_claim`)
        settled to this size, else a place claimed now; then its grant awaited.

        Raises:
          GenerationError: UNAVAILABLE at once when no engine replica is in
            routing, or when the last one leaves while it is queued,
            RESOURCE_EXHAUSTED (refused at once, with the
            retry hint in its trailing metadata) or DEADLINE_EXCEEDED (the
            deadline passed in the queue).
        """
        waited_from = time.monotonic()
        try:
            if claim is None:
                claim = self._claim(request, prompt_tokens, max_tokens, deadline)
                if claim is None:
                    return None
            else:
                claim.settle(prompt_tokens, max_tokens, deadline=deadline)
            return await claim.wait(deadline)
        except AdmissionRefused as err:
            raise GenerationError.refused(err) from None
        except NoReplicaServing as err:
            raise GenerationError(err.code, str(err)) from None
        except TimeoutError:
            raise GenerationError(grpc.StatusCode.DEADLINE_EXCEEDED, (
                f"the call's deadline passed after {time.monotonic() - waited_from:.3f} s in "
                f"the router's {request.priority.name.lower()} queue (before the first "
                "token); allow a longer deadline or retry when the mesh is less busy")) from None

    def _detokenize(self, detok: IncrementalDetokenizer, ids: Sequence[int],
                    engine: EngineClient, *, last: bool,
                    with_ends: bool) -> tuple[str, Sequence[int]]:
        """The text ``ids`` make final (all the rest when ``last``) and, when
        ``with_ends`` (stop strings to match), the text's end after each id (see
        :meth:`IncrementalDetokenizer.add_with_ends`; else ()). ~2 µs an id.

        Raises:
          GenerationError: INTERNAL for an id outside the vocabulary (an engine
            fault: ``tokenizers`` would drop it silently).
        """
        try:
            self.decoder.check_token_ids(ids)
        except ValueError as err:
            log.error("engine_bad_token", engine=engine.target, error=str(err))
            raise GenerationError(grpc.StatusCode.INTERNAL, (
                f"{upstream_name('engine', engine.replica_id, '')} returned a bad token: "
                f"{err}")) from err
        if with_ends:
            return detok.add_with_ends(ids, flush=last)
        text = detok.add(ids)
        return (text + detok.flush() if last else text), ()

    def _engine_finished(self, delta: TokenDelta, progress: Progress,
                         choice: _ChoiceOutput) -> Finished:
        reason = delta.finish_reason
        if reason == FinishReason.ERROR:
            raise GenerationError(grpc.StatusCode.INTERNAL,
                                  "the engine failed the request (FINISH_REASON_ERROR)")
        if delta.num_generated_tokens:
            # The engine's count is authoritative (it knows what it generated).
            choice.completion_tokens = delta.num_generated_tokens
        return Finished(reason, "", choice.usage(progress), index=delta.index)

    # ------------------------------------------------------------ helpers

    def _token_time(self, timing: _Timing, *, observe: bool = True) -> float:
        """Notes that tokens leave now: the first's TTFT, the others' ITL
        (unless ``timing.observe_tokens`` is off), observed now, or with
        ``observe`` False by :meth:`_observe_token` once they are written;
        returns now (``time.monotonic()``). Mutates ``timing``."""
        now = time.monotonic()
        first = timing.last_token_at is None
        if first:
            timing.first_token_at = now
        if timing.observe_tokens:
            since = timing.received_at if first else timing.last_token_at
            assert since is not None
            timing.unobserved = (first, now - since)
        timing.last_token_at = now
        if observe:
            self._observe_token(timing)
        return now

    def _observe_token(self, timing: _Timing) -> None:
        """Observes the TTFT or ITL :meth:`_token_time` noted, if one waits
        (the histograms' lookups and locks, tens of µs with cold caches, come
        after the token's write, not before it). Mutates ``timing``."""
        if timing.unobserved is None:
            return
        first, seconds = timing.unobserved
        timing.unobserved = None
        if first:
            self.metrics.observe_first_token(model=timing.model, ttft_seconds=seconds)
            return
        if timing.itl is None:  # labels() is a locked lookup: 2 µs a token
            timing.itl = self.metrics.inter_token_latency.labels(timing.model)
        timing.itl.observe(seconds)

    def _store(self, key: CacheKey, response: CachedResponse, request_id: str) -> None:
        """Queues the store (no task, no call of its own: the cache client's
        one stream carries it) and keeps its result's future under ``key``
        until it resolves, for :meth:`_cache_lookup`."""
        assert self.cache is not None
        stored = self.cache.put(key, response, request_id=request_id)
        self._pending_stores[key] = stored

        def forget(done: asyncio.Future[bool]) -> None:
            if self._pending_stores.get(key) is done:
                del self._pending_stores[key]

        stored.add_done_callback(forget)

    def _record(self, request: GenerationRequest, outcome: str, progress: Progress,
                timing: _Timing, info: dict[str, object]) -> None:
        e2e = time.monotonic() - timing.received_at
        tpot = _time_per_output_token(outcome, progress, timing, cached=bool(info.get("cached")))
        self.metrics.requests_in_flight.labels(request.model).dec()
        self.metrics.observe_finished(
            model=request.model, outcome=outcome, priority=request.priority.name.lower(),
            prompt_tokens=progress.prompt_tokens, generation_tokens=progress.completion_tokens,
            e2e_seconds=e2e, tpot_seconds=tpot)
        output = info.pop("output", None)
        fields: dict[str, object] = dict(
            outcome=outcome, prompt_tokens=progress.prompt_tokens,
            completion_tokens=progress.completion_tokens, e2e_ms=_ms(e2e),
            ttft_ms=_ms(timing.ttft),
            queue_ms=_ms(None if timing.dispatched_at is None
                         else timing.dispatched_at - timing.received_at),
            tpot_ms=_ms(tpot), priority=request.priority.name.lower(), **info)
        if request.cascade is not None:
            fields.update(model=request.model, **request.cascade.log_fields())
        if self.log_content:
            fields.update(prompt=request.prompt if request.prompt is not None
                          else list(request.prompt_token_ids)
                          if request.prompt_token_ids is not None
                          else [dataclasses.asdict(m) for m in request.messages or ()],
                          output=output)
        log.info("request_finished", **fields)


@dataclass
class _Held:
    """What :meth:`GenerationPipeline.run` releases when the request ends: the
    admission place (taken beside retrieval) and ticket, the prefix-index
    lookup and the retriever's Query, when taken."""

    ticket: Ticket | None = None
    claim: Claim | None = None
    matches: asyncio.Task[dict[EngineClient, CachedPrefix]] | None = None
    retrieval: PendingRetrieval | None = None

    def reported(self, event: Finished) -> Finished:
        """``event`` with the request's retrieval report, when it has one."""
        if self.retrieval is None or self.retrieval.report is None:
            return event
        return dataclasses.replace(event, retrieval=self.retrieval.report)

    def release(self) -> None:
        if self.retrieval is not None:
            self.retrieval.cancel()
        if self.matches is not None:
            self.matches.cancel()
        if self.claim is not None:
            self.claim.cancel()
        if self.ticket is not None:
            self.ticket.release()


def _no_replica_took(model: str, failures: Sequence[UpstreamError]) -> GenerationError:
    """The error when every replica tried refused or failed the request
    (RESOURCE_EXHAUSTED when each was full, else UNAVAILABLE). Each failure
    was logged with its address and details; the client gets the replicas'
    ids and codes."""
    tried = "; ".join(f"{e.replica or '?'}: {e.code.name}" for e in failures)
    code = (grpc.StatusCode.RESOURCE_EXHAUSTED
            if all(e.code == grpc.StatusCode.RESOURCE_EXHAUSTED for e in failures)
            else grpc.StatusCode.UNAVAILABLE)
    return GenerationError(code, f"no engine replica could take the request for model "
                           f"{model!r} (tried {tried}); retry in a few seconds")


def _client_failure(err: Exception, completion_tokens: int, model: str
                    ) -> InvalidRequestError | GenerationError | None:
    """The client's status for a failure inside :meth:`GenerationPipeline.run`:
    ``err`` itself when it is one, an upstream failure or a stalled write
    mapped to one; None for anything else (a bug: INTERNAL)."""
    if isinstance(err, (InvalidRequestError, GenerationError)):
        return err
    if isinstance(err, UpstreamError):
        return upstream_to_generation_error(err, model=model,
                                            completion_tokens=completion_tokens)
    if isinstance(err, WriteStalled):
        return slow_client_error(err, completion_tokens)
    return None


@dataclass
class _ChoiceOutput:
    """One choice's output state in :meth:`GenerationPipeline._from_engine`:
    its own detokenizer and stop-string matcher (``sampling.n`` choices are
    independent texts), its completion tokens, and its text and ids when they
    are kept (cache, content logs)."""

    matcher: StopStringMatcher
    detok: IncrementalDetokenizer
    completion_tokens: int = 0
    finished: bool = False
    text: list[str] = dataclasses.field(default_factory=list)
    ids: list[int] = dataclasses.field(default_factory=list)

    def usage(self, progress: Progress) -> Usage:
        """The request's prompt counts with this choice's completion tokens."""
        return Usage(progress.prompt_tokens, self.completion_tokens,
                     progress.cached_prompt_tokens)


def _choice_of(choices: Sequence[_ChoiceOutput], delta: TokenDelta,
               engine: EngineClient) -> _ChoiceOutput:
    """The output state of ``delta``'s choice.

    Raises:
      GenerationError: INTERNAL for an index beyond ``sampling.n`` (an engine fault).
    """
    if not 0 <= delta.index < len(choices):
        log.error("engine_bad_choice", engine=engine.target, index=delta.index, n=len(choices))
        raise GenerationError(grpc.StatusCode.INTERNAL,
                              f"{upstream_name('engine', engine.replica_id, '')} sent choice "
                              f"{delta.index} of a request with n = {len(choices)}")
    return choices[delta.index]


def _ids_through_stop(ids: tuple[int, ...], shown: Sequence[int],
                      text_ends: Sequence[int], match_end: int | None) -> tuple[int, ...]:
    """The leading ``ids`` up to and including the one that completed a stop string.

    Args:
      ids: the engine message's ids.
      shown: positions in ``ids`` of the ids that were detokenized, in order.
      text_ends: per detokenized id, the code points of the message's text
        final after it (:meth:`IncrementalDetokenizer.add_with_ends`); () when
        not asked for (then every id is kept).
      match_end: code points of the message's text through the stop's end.
    """
    if match_end is None:
        return ids
    for position, end in zip(shown, text_ends):
        if end >= match_end:
            return ids[:position + 1]
    return ids


def merge_deltas(earlier: Event, later: Event) -> Event | None:
    """One :class:`Delta` for two consecutive deltas of one choice that both
    wait for a blocked client (text, ids and log-probabilities joined), or
    None (a :class:`Finished`, or another choice: they stay apart)."""
    if not (isinstance(earlier, Delta) and isinstance(later, Delta)
            and earlier.index == later.index and not later.prompt_logprobs):
        return None
    return dataclasses.replace(
        earlier, text=earlier.text + later.text, token_ids=earlier.token_ids + later.token_ids,
        logprobs=earlier.logprobs + later.logprobs)


def slow_client_error(err: WriteStalled, completion_tokens: int) -> GenerationError:
    """RESOURCE_EXHAUSTED for a client over the slow-reader budget (module doc)."""
    return GenerationError(grpc.StatusCode.RESOURCE_EXHAUSTED, (
        f"the client read too slowly: a write to it stayed blocked for more than "
        f"{err.budget_s:g} s (the router's --client-write-timeout-s) after "
        f"{completion_tokens} generated tokens, so the generation was cancelled; read the "
        "stream as it arrives, or ask for fewer max_tokens"))


def _ms(seconds: float | None) -> float | None:
    """Seconds as milliseconds for a log line (µs precision), None stays None."""
    return None if seconds is None else round(seconds * 1e3, 3)


def _time_per_output_token(outcome: str, progress: Progress, timing: _Timing, *,
                           cached: bool) -> float | None:
    """(last token - first token) / (tokens - 1) of a complete generation from an
    engine (STOP or LENGTH, two tokens or more), else None."""
    if (cached or outcome not in ("stop", "length") or progress.completion_tokens < 2
            or timing.first_token_at is None or timing.last_token_at is None):
        return None
    return (timing.last_token_at - timing.first_token_at) / (progress.completion_tokens - 1)


def _finished(event: Finished, model: str, held: _Held, info: dict[str, object]) -> Finished:
    """A request's last event as the client sees it: the model that answered,
    the retrieval report and the history summary's counts; its stop string
    goes to the ``request_finished`` log line (``info``)."""
    info.update(matched_stop=event.matched_stop)
    return _with_history(held.reported(dataclasses.replace(event, model=model)), info)


def _with_history(finished: Finished, info: Mapping[str, object]) -> Finished:
    """``finished`` with the request's history compaction in its usage (step 1)."""
    turns = info.get("history_turns_summarized")
    if not isinstance(turns, int):
        return finished
    saved = info.get("history_tokens_saved")
    usage = dataclasses.replace(finished.usage, history_turns_summarized=turns,
                                history_tokens_saved=saved if isinstance(saved, int) else 0)
    return dataclasses.replace(finished, usage=usage)


def _shareable(sampling: SamplingOptions) -> bool:
    """True when a request may be coalesced with an identical one or answered
    from the response cache: its output is a function of the request
    (deterministic) and it uses no field the cache key leaves out (plain)."""
    return sampling.deterministic and sampling.plain
