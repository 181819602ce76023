"""The router's Prometheus metrics (names follow vLLM's where the concept matches).

These are the latencies a client sees, minus only Envoy's hop: all times are
in seconds, measured at the router with ``time.monotonic()`` from the moment
the router received the request (``Generate`` called, or a ``start`` read on
a ``GenerateStream``), and observed at the moment they happen:

* ``llmesh:time_to_first_token_seconds``: receipt to the first token-carrying
  message leaving the router; observed then, once per request that produced
  a token, whatever its outcome later (a response-cache hit: its replay).
* ``llmesh:inter_token_latency_seconds``: between consecutive token-carrying
  messages of one request (one engine step, or more with speculation);
  observed for each message after the first, as it leaves.
* ``llmesh:request_time_per_output_token_seconds``: (last token - first
  token) / (completion tokens - 1), once per generation that finished with
  STOP or LENGTH from an engine with at least two tokens.
* ``llmesh:e2e_request_latency_seconds``: receipt to the final message;
  observed for every request whose outcome is a finish reason (``stop``,
  ``length``, ``cancelled``), cache hits included; failed calls (a gRPC
  error status) are counted in ``requests_total`` only, so that refusals in
  microseconds do not pull the percentiles down.
* ``llmesh:request_queue_time_seconds``: receipt to the request being sent to
  an engine replica (validation, tokenization, cache lookup, replica choice);
  once per request sent to an engine (not for cache hits or refusals).
* ``llmesh:requests_total{outcome, priority}``: every request, once, when it
  ends; ``outcome`` is the finish reason (``stop``, ``length``,
  ``cancelled``: a client's cancel or a dropped call) or, for a failed call,
  the gRPC status in lower case (``invalid_argument``, ``out_of_range``,
  ``unavailable``, ``deadline_exceeded``, ``internal``...); ``priority`` is the
  traffic class (``interactive``, ``batch``).
* ``llmesh:prompt_tokens_total`` / ``llmesh:generation_tokens_total``: prompt
  and completion tokens of requests whose outcome is a finish reason, as
  reported to the client in the final message's ``usage`` (cache hits
  included; a failed call has no usage and adds nothing). The engine exports counters of the same
  names (tokens it computed); Prometheus' ``job`` label tells them apart.
* ``llmesh:response_cache_queries_total`` / ``llmesh:response_cache_hits_total``:
  the router's lookups (the cache service counts its own under the same
  names, without ``model_name``).
* ``llmesh:router_response_cache_stores_total{outcome}``: the router's
  response-cache stores as each ended (:mod:`services.router.cache_stores`):
  ``stored``, ``not_stored`` (the cache did not keep it: store full or down),
  ``refused`` (the cache answered a status for it), ``failed`` (in flight
  when the store call broke, or at shutdown), ``timed_out`` (unanswered for
  the store timeout on a connected channel, :func:`~services.router.cache_stores.store_timeout_for`:
  a stalled cache) and ``dropped``
  (the bounded queue of stores waiting for their result was full).
* ``llmesh:router_requests_in_flight``: requests between receipt and their
  final message.
* ``llmesh:router_coalesced_requests_total``: requests that joined an
  identical deterministic generation already in flight instead of starting
  one (:mod:`services.router.single_flight`; the first request of a shared
  generation is not counted). A joined request is still a request above:
  counted by its own outcome, with its own TTFT, ITL (messages replayed
  from the buffer leave back to back, as its client sees them), e2e and
  usage; it has no queue time (it was not sent to an engine) and makes no
  response-cache lookup.

* ``llmesh:router_slow_client_cancels_total``: generations cancelled by the
  slow-reader budget (a write to the client blocked longer than
  ``--client-write-timeout-s``; the call ends RESOURCE_EXHAUSTED, and is
  counted in ``requests_total`` with that outcome too).

* admission (:mod:`services.router.admission`), per ``priority`` (traffic class):
  ``llmesh:router_queue_depth`` and ``llmesh:router_queued_prompt_tokens``
  (gauges: requests and prompt tokens in the router's queue),
  ``llmesh:router_running_requests`` (admitted and not yet ended),
  ``llmesh:router_admission_wait_seconds{priority, tenant}`` (time in the
  router's queue, per dispatched request; ``tenant`` is the ``x-tenant-id``,
  ``""`` without one, and ``other`` past the first 64 tenants so that callers
  cannot grow the series without bound),
  ``llmesh:router_admission_rejected_total{priority, reason}`` (``queue_full``,
  ``queued_tokens``, ``deadline``), ``llmesh:router_retry_after_seconds`` (the
  hints given), ``llmesh:router_admission_limit{limit}`` (the configured
  limits), ``llmesh:router_engine_retries_total{code}`` (a replica refused or
  failed a request before its first token, by status; the request moves on
  to the next replica if there is one).
* failover (:mod:`services.router.replicas`), per ``engine`` (its address,
  from the router's configuration): ``llmesh:router_replica_serving`` (1
  while the replica takes new requests), ``llmesh:router_replica_failovers_total{reason}``
  (the replica left routing: ``call_failed``, ``not_serving``, ``silent``,
  ``removed``: its address left DNS).
* discovery (:mod:`services.router.discovery`):
  ``llmesh:router_discovery_resolutions_total{name, outcome}`` (``ok``,
  ``no_records``, ``nxdomain``, ``timeout``, ``error``) and
  ``llmesh:router_discovery_replicas{name}`` (addresses at the last answer).
* prompt ids (:mod:`services.router.local_tokenizer`):
  ``llmesh:router_tokenize_total{model_name, path}``: prompts the router
  tokenized (``Tokenize`` or a chat template, the pipeline's and
  ``/tokenize``'s), by the path that answered: ``local`` (in this process,
  refusals included) or ``service`` (the tokenizer service: before the
  local tokenizer loaded, with ``--no-tokenize-in-router``, or a fallback);
  ``llmesh:router_tokenizer_in_process{model_name}``: 1 once the model's
  local tokenizer has loaded (it loads in the background after the router
  serves), else 0.
* routing (:mod:`services.router.routing`): ``llmesh:router_routed_requests_total{engine,
  policy}`` (requests sent to each replica, by policy),
  ``llmesh:router_prefix_hit_tokens{model_name}`` (histogram, per request an
  engine answered: prompt tokens it found in its prefix cache, as the
  engine reports them) and ``llmesh:router_prefix_score_seconds``
  (``ScorePrefix`` round trips).
* history compaction: :mod:`services.router.history.metrics`.
* tenants (:mod:`services.router.tenancy`, with ``--api-keys``; ``tenant`` is
  the key file's tenant id, never a key, ``other`` past 64 ids):
  ``llmesh:tenant_requests_total{tenant, outcome}`` (ended requests, outcome
  as in ``requests_total``), ``llmesh:tenant_tokens_total{tenant, kind}``
  (``prompt``, ``completion``: what each request was billed against its
  tokens per minute), ``llmesh:tenant_limited_total{tenant, limit}``
  (``requests_per_minute``, ``tokens_per_minute``, ``max_concurrent``),
  ``llmesh:auth_failures_total{reason}`` (``missing_key``, ``invalid_key``,
  ``model_not_allowed``), ``llmesh:api_key_reloads_total{outcome}`` (``ok``,
  ``error``: SIGHUP reloads) and ``llmesh:api_keys{what}`` (``keys``,
  ``tenants`` loaded now).

Every metric but the tenant ones carries ``model_name`` (a served model id: never a value the
client made up). Nothing is observed per token inside the decode loop beyond
one histogram observation per message.
"""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.common.sampling import Priority
from services.router.admission import AdmissionObserver
from services.router.history.metrics import HistoryMetrics
from services.router.local_tokenizer import TokenizeObserver
from services.router.retrieval.stage import RetrievalMetrics
from services.router.tenant_limits import LimitObserver

#: Prefix-hit buckets in tokens (0: a miss).
PREFIX_HIT_BUCKETS = (0, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
#: ScorePrefix round-trip buckets in seconds.
SCORE_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.02, 0.05)
# Bucket bounds in seconds; the low end resolves single milliseconds.
TTFT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
    0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
ITL_BUCKETS = (
    0.0005, 0.001, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03,
    0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)
E2E_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0,
    20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
)
QUEUE_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1,
    0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)

#: Outcomes that are finish reasons (the request got to its final message).
FINISHED_OUTCOMES = frozenset({"stop", "length", "cancelled"})


class RouterMetrics:
    """The router's metric families, registered once per process.

    Tests pass their own ``CollectorRegistry`` so several routers may live in
    one process.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        reg = prometheus_client.REGISTRY if registry is None else registry
        self.registry = reg
        #: ``llmesh:retrieval_*`` (:class:`RetrievalMetrics`).
        self.retrieval = RetrievalMetrics(reg)
        self.time_to_first_token = Histogram(
            "llmesh:time_to_first_token_seconds",
            "Time from the router receiving a request to its first token (seconds).",
            ["model_name"], buckets=TTFT_BUCKETS, registry=reg)
        self.inter_token_latency = Histogram(
            "llmesh:inter_token_latency_seconds",
            "Time between consecutive token deltas of a request (seconds).",
            ["model_name"], buckets=ITL_BUCKETS, registry=reg)
        self.time_per_output_token = Histogram(
            "llmesh:request_time_per_output_token_seconds",
            "Mean time per output token after the first, per finished generation (seconds).",
            ["model_name"], buckets=ITL_BUCKETS, registry=reg)
        self.e2e_request_latency = Histogram(
            "llmesh:e2e_request_latency_seconds",
            "Time from the router receiving a request to its final message (seconds).",
            ["model_name"], buckets=E2E_BUCKETS, registry=reg)
        self.request_queue_time = Histogram(
            "llmesh:request_queue_time_seconds",
            "Time from the router receiving a request to sending it to an engine (seconds).",
            ["model_name"], buckets=QUEUE_BUCKETS, registry=reg)
        self.requests = Counter(
            "llmesh:requests",
            "Ended requests by outcome (finish reason or gRPC status) and priority class.",
            ["model_name", "outcome", "priority"], registry=reg)
        self.prompt_tokens = Counter(
            "llmesh:prompt_tokens", "Prompt tokens of finished requests (as in usage).",
            ["model_name"], registry=reg)
        self.generation_tokens = Counter(
            "llmesh:generation_tokens", "Completion tokens of finished requests (as in usage).",
            ["model_name"], registry=reg)
        self.cache_queries = Counter(
            "llmesh:response_cache_queries", "Response cache lookups.",
            ["model_name"], registry=reg)
        self.cache_hits = Counter(
            "llmesh:response_cache_hits", "Response cache lookups that found an answer.",
            ["model_name"], registry=reg)
        self.cache_stores = Counter(
            "llmesh:router_response_cache_stores",
            "The router's response-cache stores by outcome (stored, not_stored, refused, "
            "failed, timed_out, dropped).", ["model_name", "outcome"], registry=reg)
        self.requests_in_flight = Gauge(
            "llmesh:router_requests_in_flight",
            "Requests received and not yet ended.", ["model_name"], registry=reg)
        self.coalesced_requests = Counter(
            "llmesh:router_coalesced_requests",
            "Requests that joined an identical generation in flight (single flight).",
            ["model_name"], registry=reg)
        self.slow_client_cancels = Counter(
            "llmesh:router_slow_client_cancels",
            "Generations cancelled because a write to their client stayed blocked longer "
            "than --client-write-timeout-s (the client read too slowly).",
            ["model_name"], registry=reg)

        self.queue_depth = Gauge(
            "llmesh:router_queue_depth", "Requests waiting in the router's admission queue.",
            ["model_name", "priority"], registry=reg)
        self.queued_prompt_tokens = Gauge(
            "llmesh:router_queued_prompt_tokens",
            "Prompt tokens of the requests waiting in the router's admission queue.",
            ["model_name", "priority"], registry=reg)
        self.running_requests = Gauge(
            "llmesh:router_running_requests",
            "Requests admitted by the router and not yet ended.", ["model_name"], registry=reg)
        self.admission_wait = Histogram(
            "llmesh:router_admission_wait_seconds",
            "Time a dispatched request waited in the router's admission queue (seconds).",
            ["model_name", "priority", "tenant"], buckets=QUEUE_BUCKETS, registry=reg)
        self.admission_rejected = Counter(
            "llmesh:router_admission_rejected",
            "Requests refused by the router's admission control, by reason.",
            ["model_name", "priority", "reason"], registry=reg)
        self.retry_after = Histogram(
            "llmesh:router_retry_after_seconds",
            "The retry-after hints given with admission refusals (seconds).",
            ["model_name", "priority"], buckets=QUEUE_BUCKETS, registry=reg)
        self.admission_limit = Gauge(
            "llmesh:router_admission_limit",
            "The router's admission limits (requests, tokens or seconds, by `limit`).",
            ["model_name", "limit"], registry=reg)
        self.engine_retries = Counter(
            "llmesh:router_engine_retries",
            "Engine replicas that refused or failed a request before its first token.",
            ["model_name", "code"], registry=reg)
        self.replica_serving = Gauge(
            "llmesh:router_replica_serving",
            "1 while the engine replica takes new requests from this router, else 0.",
            ["engine"], registry=reg)
        self.replica_failovers = Counter(
            "llmesh:router_replica_failovers",
            "Engine replicas taken out of routing, by reason (call_failed, not_serving, "
            "silent).", ["engine", "reason"], registry=reg)
        self.discovery_resolutions = Counter(
            "llmesh:router_discovery_resolutions",
            "Resolutions of dns:/// engine names, by outcome (ok, no_records, nxdomain, "
            "timeout, error).", ["name", "outcome"], registry=reg)
        self.discovery_replicas = Gauge(
            "llmesh:router_discovery_replicas",
            "Addresses a dns:/// engine name resolved to at its last answer.",
            ["name"], registry=reg)
        self.routed_requests = Counter(
            "llmesh:router_routed_requests",
            "Requests sent to each engine replica, by routing policy.",
            ["engine", "policy"], registry=reg)
        self.prefix_hit_tokens = Histogram(
            "llmesh:router_prefix_hit_tokens",
            "Prompt tokens the engine found in its prefix cache, per routed request.",
            ["model_name"], buckets=PREFIX_HIT_BUCKETS, registry=reg)
        self.tenant_requests = Counter(
            "llmesh:tenant_requests",
            "Ended requests per tenant (the API key's tenant, never the key), by outcome.",
            ["tenant", "outcome"], registry=reg)
        self.tenant_tokens = Counter(
            "llmesh:tenant_tokens",
            "Tokens billed to each tenant's tokens_per_minute, by kind (prompt, completion).",
            ["tenant", "kind"], registry=reg)
        self.tenant_limited = Counter(
            "llmesh:tenant_limited",
            "Requests refused because their tenant was over a limit, by limit.",
            ["tenant", "limit"], registry=reg)
        self.auth_failures = Counter(
            "llmesh:auth_failures",
            "Calls refused by API key checks, by reason (missing_key, invalid_key, "
            "model_not_allowed).", ["reason"], registry=reg)
        self.api_key_reloads = Counter(
            "llmesh:api_key_reloads",
            "Reloads of the API key file (SIGHUP), by outcome (ok, error).",
            ["outcome"], registry=reg)
        self.api_keys = Gauge(
            "llmesh:api_keys", "Keys in the API key file now loaded, by `what` (keys, "
            "tenants).", ["what"], registry=reg)
        self.tokenize_requests = Counter(
            "llmesh:router_tokenize",
            "Prompts the router tokenized, by the path that answered (local: in the "
            "router's process; service: the tokenizer service).",
            ["model_name", "path"], registry=reg)
        self.tokenizer_in_process = Gauge(
            "llmesh:router_tokenizer_in_process",
            "1 once the model's prompts are tokenized in the router's process, else 0.",
            ["model_name"], registry=reg)
        self.prefix_score_duration = Histogram(
            "llmesh:router_prefix_score_seconds",
            "ScorePrefix round trips to the cache service's prefix index.",
            buckets=SCORE_BUCKETS, registry=reg)
        self.history = HistoryMetrics.create(reg)

    def tenant_observer(self) -> TenantMetrics:
        """The tenant limiter's observer."""
        return TenantMetrics(self)

    def admission_observer(self, model: str) -> AdmissionMetrics:
        """The admission controller's observer for ``model``."""
        return AdmissionMetrics(self, model)

    def tokenize_observer(self, model: str) -> TokenizeMetrics:
        """The prompt tokenizer's observer for ``model``."""
        return TokenizeMetrics(self, model)

    def observe_cache_store(self, model: str, outcome: str) -> None:
        """Counts one response-cache store as it ends (``outcome`` as in the module doc)."""
        self.cache_stores.labels(model, outcome).inc()

    def observe_first_token(self, *, model: str, ttft_seconds: float) -> None:
        """Records the first token of a request leaving the router."""
        self.time_to_first_token.labels(model).observe(ttft_seconds)

    def observe_finished(self, *, model: str, outcome: str, priority: str,
                         prompt_tokens: int, generation_tokens: int, e2e_seconds: float,
                         tpot_seconds: float | None = None) -> None:
        """Records one ended request (any outcome; see the module doc for what
        each outcome contributes)."""
        self.requests.labels(model, outcome, priority).inc()
        if outcome not in FINISHED_OUTCOMES:
            return
        self.e2e_request_latency.labels(model).observe(e2e_seconds)
        if tpot_seconds is not None:
            self.time_per_output_token.labels(model).observe(tpot_seconds)
        if prompt_tokens:
            self.prompt_tokens.labels(model).inc(prompt_tokens)
        if generation_tokens:
            self.generation_tokens.labels(model).inc(generation_tokens)

    def observe_refused(self, *, model: str, outcome: str, priority: str) -> None:
        """Counts a request refused before it reached the pipeline (validation,
        starting, draining, a protocol error on a stream)."""
        self.requests.labels(model, outcome, priority).inc()


class TokenizeMetrics(TokenizeObserver):
    """``llmesh:router_tokenize_total`` and ``llmesh:router_tokenizer_in_process``
    for one model (see the module doc)."""

    def __init__(self, metrics: RouterMetrics, model: str) -> None:
        self._paths = {path: metrics.tokenize_requests.labels(model, path)
                       for path in ("local", "service")}
        self._in_process = metrics.tokenizer_in_process.labels(model)

    def served(self, path: str) -> None:
        self._paths[path].inc()

    def loaded(self, in_process: bool) -> None:
        self._in_process.set(int(in_process))


#: Distinct tenant label values per model before the rest report as ``other``.
MAX_TENANT_LABELS = 64


class AdmissionMetrics(AdmissionObserver):
    """The admission controller's metrics for one model (see the module doc)."""

    def __init__(self, metrics: RouterMetrics, model: str) -> None:
        self._m = metrics
        self._model = model
        self._tenants: set[str] = set()

    def queue_changed(self, priority: Priority, depth: int, tokens: int) -> None:
        name = priority.name.lower()
        self._m.queue_depth.labels(self._model, name).set(depth)
        self._m.queued_prompt_tokens.labels(self._model, name).set(tokens)

    def running_changed(self, running: int) -> None:
        self._m.running_requests.labels(self._model).set(running)

    def refused(self, priority: Priority, reason: str, retry_after_s: float) -> None:
        name = priority.name.lower()
        self._m.admission_rejected.labels(self._model, name, reason).inc()
        self._m.retry_after.labels(self._model, name).observe(retry_after_s)

    def dispatched(self, priority: Priority, tenant: str, waited_s: float) -> None:
        if tenant not in self._tenants:
            if len(self._tenants) < MAX_TENANT_LABELS:
                self._tenants.add(tenant)
            else:
                tenant = "other"
        self._m.admission_wait.labels(self._model, priority.name.lower(), tenant).observe(
            waited_s)

    def limits(self, limits: dict[str, float]) -> None:
        """Publishes the configured limits (``limit`` label: their names)."""
        for name, value in limits.items():
            self._m.admission_limit.labels(self._model, name).set(value)


class TenantMetrics(LimitObserver):
    """Per-tenant counters (``tenant``: the key file's tenant id; past
    :data:`MAX_TENANT_LABELS` distinct ids, ``other``)."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self._m = metrics
        self._tenants: set[str] = set()

    def label(self, tenant: str) -> str:
        if tenant not in self._tenants:
            if len(self._tenants) >= MAX_TENANT_LABELS:
                return "other"
            self._tenants.add(tenant)
        return tenant

    def limited(self, tenant: str, limit: str) -> None:
        self._m.tenant_limited.labels(self.label(tenant), limit).inc()

    def settled(self, tenant: str, prompt_tokens: int, completion_tokens: int) -> None:
        label = self.label(tenant)
        if prompt_tokens:
            self._m.tenant_tokens.labels(label, "prompt").inc(prompt_tokens)
        if completion_tokens:
            self._m.tenant_tokens.labels(label, "completion").inc(completion_tokens)

    def ended(self, tenant: str, outcome: str) -> None:
        self._m.tenant_requests.labels(self.label(tenant), outcome).inc()
