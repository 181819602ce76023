"""The retrieval stage of a request: a Query started, awaited where needed.

:meth:`RetrievalStage.start` begins the retriever's Query as soon as the
request has passed validation, the router's queue-full check and taken its
admission place (a request refused at once costs the retriever nothing), and
:meth:`PendingRetrieval.messages` awaits the passages where they are needed,
just before the chat template is applied. The time the request waits there,
after its admission slot was granted when it queued for one (a request
still queued when the passages come waited for its slot, not for them), is
``wait_ms``; the rest of the call (``overlap_ms``) ran beside other work.
The admission wait runs beside the Query (the request queues for its slot
meanwhile: :meth:`services.router.admission.AdmissionController.claim`); the
response cache, coalescing and the prefix index need the prompt's ids, which
need the passages, so on a quiet mesh ``overlap_ms`` is about 0.

The Query's timeout is the request's remaining time (its deadline) capped by
the router's ``--retrieval-timeout-ms``.

Errors (statuses the client sees):

* the retriever refuses the input: NOT_FOUND naming ``retrieval.collection``
  (unknown collection), INVALID_ARGUMENT naming ``retrieval.filter`` (a field
  no document has), ``retrieval.top_k``, or ``chat.messages[i].content``
  (the query), with the retriever's message; never degraded;
* the retriever fails (UNAVAILABLE: stopped or draining; DEADLINE_EXCEEDED;
  anything else): with ``on_failure`` FAIL the status
  :func:`services.router.generation.upstream_to_generation_error` gives
  (UNAVAILABLE / DEADLINE_EXCEEDED, naming the retriever and its message);
  with DEGRADE the request goes on without passages, its report says why
  (``degraded_reason``) and
  ``llmesh:retrieval_requests_total{outcome="degraded"}`` counts it;
* a router without ``--retriever-address``: FAILED_PRECONDITION naming
  ``retrieval``.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import structlog
from prometheus_client import CollectorRegistry, Counter, Histogram

from services.common import tracing
from services.common.sampling import InvalidRequestError
from services.common.wire.chat import ChatMessage
from services.router.admission import Claim
from services.router.clients import UpstreamError
from services.router.retrieval.client import QueryAnswer, RetrieverClient
from services.router.retrieval.placement import passages_text, with_passages
from services.router.retrieval.report import RetrievalReport
from services.router.retrieval.spec import FailurePolicy, RetrievalSpec

log = structlog.get_logger()

#: Default cap on one Query call (``--retrieval-timeout-ms``), seconds.
DEFAULT_RETRIEVAL_TIMEOUT_S = 1.0
#: Retrieval latency buckets in seconds: the low end resolves a cached top-k.
RETRIEVAL_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02,
                     0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
#: The retriever's statuses that are the client's input at fault.
_INPUT_CODES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                grpc.StatusCode.OUT_OF_RANGE)
#: A retriever message that starts with its field (``filter: ...``).
_FIELD_FIRST = re.compile(r"([A-Za-z_][A-Za-z0-9_.\[\]]*): ")


class RetrievalMetrics:
    """The router's retrieval metrics (vLLM has none; named like its histograms).

    * ``llmesh:retrieval_duration_seconds{model_name}``: the Query call as the
      router measured it;
    * ``llmesh:retrieval_wait_seconds{model_name}``: what the request waited
      for it after the rest of its preparation and its admission wait (its
      share of TTFT);
    * ``llmesh:retrieval_embed_seconds`` / ``llmesh:retrieval_search_seconds``:
      the retriever's stages of a cache miss;
    * ``llmesh:retrieval_requests_total{model_name,outcome}``: ``hit`` (the
      retriever's top-k cache), ``miss``, ``degraded``, ``failed`` (the
      request ended with the retriever's status), ``refused`` (bad input).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(f"llmesh:retrieval_{name}_seconds", doc, ["model_name"],
                             buckets=RETRIEVAL_BUCKETS, registry=registry)

        self.duration = histogram("duration", "Retriever Query call, as the router measured "
                                  "it (seconds).")
        self.wait = histogram("wait", "Time a request waited for its passages after the rest "
                              "of its preparation and its admission wait: what retrieval "
                              "added to TTFT (seconds).")
        self.embed = histogram("embed", "The retriever's query embedding, cache misses "
                               "(seconds).")
        self.search = histogram("search", "The retriever's index search, cache misses "
                                "(seconds).")
        self.requests = Counter("llmesh:retrieval_requests", "Retrieval-augmented requests, by "
                                "outcome (hit, miss, degraded, failed, refused).",
                                ["model_name", "outcome"], registry=registry)


@dataclass
class PendingRetrieval:
    """One request's Query in flight, and its report once awaited."""

    spec: RetrievalSpec
    task: asyncio.Task[QueryAnswer]
    started_at: float
    model: str
    metrics: RetrievalMetrics
    target: str
    report: RetrievalReport | None = None
    _answered_at: float | None = None

    async def messages(self, messages: Sequence[ChatMessage],
                       claim: Claim | None = None) -> tuple[ChatMessage, ...]:
        """``messages`` with the passages inserted before the query turn, once
        the Query answers; sets :attr:`report`. ``claim``: the request's
        admission place taken before the Query (it queued meanwhile): the
        Query's time before its slot was granted added nothing to TTFT.

        Raises:
          InvalidRequestError: the retriever refused the input (module doc).
          GenerationError: it failed and the policy is FAIL.
        """
        waiting_from = time.monotonic()
        try:
            answer = await asyncio.shield(self.task)
        except UpstreamError as err:
            self._degrade(err, *self._spans(waiting_from, claim))
            return tuple(messages)
        call_s, wait_s = self._spans(waiting_from, claim)
        text = passages_text(self.spec.collection, answer.passages)
        self.report = RetrievalReport(
            self.spec.collection, answer.passages, text, answer.version, "", answer.embed_ms,
            answer.search_ms, answer.cache_hit, call_s * 1e3, wait_s * 1e3)
        self._observe(wait_s, call_s, answer)
        return with_passages(messages, self.spec.query_index, text)

    def _spans(self, waiting_from: float, claim: Claim | None) -> tuple[float, float]:
        """(call, wait) seconds: start to answer, and the part of it after
        ``waiting_from`` and after ``claim``'s slot was granted (when the
        request had nothing else to wait for: a request still queued when
        the passages came waited for nothing but its slot)."""
        answered_at = self._answered_at or time.monotonic()
        idle_from = waiting_from
        if claim is not None:
            granted_at = claim.granted_at
            idle_from = max(idle_from, answered_at if granted_at is None else granted_at)
        return answered_at - self.started_at, max(0.0, answered_at - idle_from)

    def _observe(self, wait_s: float, call_s: float, answer: QueryAnswer) -> None:
        m = self.metrics
        m.wait.labels(self.model).observe(wait_s)
        m.duration.labels(self.model).observe(call_s)
        if not answer.cache_hit:
            m.embed.labels(self.model).observe(answer.embed_ms / 1e3)
            m.search.labels(self.model).observe(answer.search_ms / 1e3)
        m.requests.labels(self.model, "hit" if answer.cache_hit else "miss").inc()

    def _degrade(self, err: UpstreamError, call_s: float, wait_s: float) -> None:
        """Sets :attr:`report` to say why the request goes on without passages
        when the policy allows it; raises the client's status otherwise
        (``err`` itself for a failure: the pipeline maps it as any upstream's)."""
        if err.code in _INPUT_CODES:
            self.metrics.requests.labels(self.model, "refused").inc()
            raise _input_error(err, self.spec) from None
        if self.spec.on_failure is not FailurePolicy.DEGRADE:
            self.metrics.requests.labels(self.model, "failed").inc()
            raise err
        # The client learns the status; the address and the details go to the log.
        reason = f"the retriever failed: {err.code.name}"
        log.warning("retrieval_degraded", reason=reason, target=err.target, details=err.details)
        self.metrics.requests.labels(self.model, "degraded").inc()
        self.report = RetrievalReport(self.spec.collection, (), "", 0, reason, 0.0, 0.0,
                                      False, call_s * 1e3, wait_s * 1e3)

    def mark_answered(self, _: object) -> None:
        self._answered_at = time.monotonic()

    def cancel(self) -> None:
        self.task.cancel()


class RetrievalStage:
    """Starts requests' Queries (one per router, shared by its model pools).

    Args:
      client: the retriever (None: the router has no ``--retriever-address``).
      metrics: where to record.
      timeout_s: cap on one Query call (``--retrieval-timeout-ms``).
    """

    def __init__(self, client: RetrieverClient | None, metrics: RetrievalMetrics,
                 timeout_s: float = DEFAULT_RETRIEVAL_TIMEOUT_S) -> None:
        if timeout_s <= 0:
            raise ValueError(f"the retrieval timeout must be > 0 seconds, got {timeout_s:g}")
        self.client = client
        self.metrics = metrics
        self.timeout_s = timeout_s

    def start(self, spec: RetrievalSpec, *, model: str, request_id: str, cache_scope: str,
              deadline: float | None, parent: tracing.Span | None) -> PendingRetrieval:
        """Begins ``spec``'s Query now (under an ``llmesh.retrieve`` span), in the
        request's ``cache_scope`` (the retriever's top-k and query-embedding caches).

        Raises:
          InvalidRequestError: FAILED_PRECONDITION naming ``retrieval``: no retriever.
        """
        if self.client is None:
            raise no_retriever()
        now = time.monotonic()
        left = math.inf if deadline is None else deadline - now
        capped = self.timeout_s < left  # the router's cap, not the call's deadline, ends it
        timeout = min(self.timeout_s, left)
        task = asyncio.create_task(
            self._query(self.client, spec, request_id, cache_scope, timeout, parent,
                        capped=capped),
            name=f"retrieve {request_id}")
        pending = PendingRetrieval(spec, task, now, model, self.metrics, self.client.target)
        task.add_done_callback(pending.mark_answered)
        return pending

    @staticmethod
    async def _query(client: RetrieverClient, spec: RetrievalSpec, request_id: str,
                     cache_scope: str, timeout: float, parent: tracing.Span | None, *,
                     capped: bool) -> QueryAnswer:
        """The Query's answer. ``capped``: ``timeout`` is the router's
        ``--retrieval-timeout-ms``, not the client's deadline: running out of
        it is still DEADLINE_EXCEEDED, told as the router's cap, which a
        longer client deadline would not lift (QA: "allow a longer deadline")."""
        with tracing.span("llmesh.retrieve", parent, attributes={
                "llmesh.retrieval.collection": spec.collection,
                "llmesh.retrieval.top_k": spec.top_k}) as span:
            try:
                answer = await client.query(
                    spec.collection, spec.query, top_k=spec.top_k, filter=spec.filter,
                    request_id=request_id, timeout=timeout, cache_scope=cache_scope,
                    metadata=tracing.metadata_of(span))
            except UpstreamError as err:
                if not (capped and err.code == grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                cap = f"{timeout * 1e3:.0f} ms"
                raise UpstreamError(
                    err.service, err.target, err.code, err.details,
                    client_message=f"the retriever did not answer within the router's "
                    f"retrieval timeout ({cap}, --retrieval-timeout-ms) before the first "
                    "token; retry, or ask with retrieval.on_failure degrade to be answered "
                    "without passages") from None
            if span is not None:
                span.set_attributes({"llmesh.retrieval.cache_hit": answer.cache_hit,
                                     "llmesh.retrieval.embed_ms": answer.embed_ms,
                                     "llmesh.retrieval.search_ms": answer.search_ms,
                                     "llmesh.retrieval.chunks": len(answer.passages)})
            return answer


def no_retriever() -> InvalidRequestError:
    """FAILED_PRECONDITION naming ``retrieval``: the router has no retriever."""
    return InvalidRequestError("retrieval", "this router has no retriever (start it with "
                               "--retriever-address, or `llmesh up --retrieval`)",
                               grpc.StatusCode.FAILED_PRECONDITION)


def _input_error(err: UpstreamError, spec: RetrievalSpec) -> InvalidRequestError:
    """The retriever's refusal, naming the request's field."""
    named = _FIELD_FIRST.match(err.details)
    theirs = named[1] if named else ""
    detail = err.details[named.end():] if named else err.details
    if err.code == grpc.StatusCode.NOT_FOUND:
        field = "retrieval.collection"
    elif theirs == "query":
        field = spec.query_field
    elif theirs.startswith(("filter", "top_k", "collection")):
        field = f"retrieval.{theirs}"
    else:
        field = "retrieval"
    return InvalidRequestError(field, detail, err.code)

