"""A request's spans on the router (:mod:`services.common.tracing`).

``llmesh.generate`` is the request's span: a root, or the child of the
client's W3C ``traceparent`` (gRPC metadata or the HTTP header; validated
nowhere: a malformed one starts a new trace); its attributes are set when
it ends. The pipeline opens its live children around the awaited stages
(``llmesh.tokenize``, ``llmesh.cache_lookup``, and ``llmesh.admission_wait``
of a shared generation); the stages known only by their timestamps are
recorded here when the request ends, with explicit times, as vLLM does (no
span per token), off the first token's path:

* ``llmesh.admission_wait`` of a request computed alone
  (:func:`timed_admission_wait`; at once when the wait fails);
* ``llmesh.first_token``: dispatch to the engine until the first token left
  the router (engine queue, prefill and the way back);
* ``llmesh.decode``: the first token until the last.

Off (every function returns at once) unless tracing is configured.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from services.common import tracing

if TYPE_CHECKING:
    from services.router.validation import GenerationRequest


class _Progress(Protocol):
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


class _Timing(Protocol):
    span: tracing.Span | None
    dispatched_at: float | None
    first_token_at: float | None
    last_token_at: float | None
    admission_wait: tuple[float, float] | None


def start_request_span(request: GenerationRequest) -> tracing.Span | None:
    """The request's ``llmesh.generate`` span (None: tracing is off), started
    now; its attributes are set when it ends (:func:`end_request_span`), off
    the first token's path."""
    if not tracing.enabled():
        return None
    return tracing.start_span(
        "llmesh.generate", tracing.context_of(request.traceparent, request.tracestate))


def _request_attributes(request: GenerationRequest) -> dict[str, str | int | float | bool]:
    """What the request asked for, as ``llmesh.generate``'s attributes."""
    sampling = request.sampling
    return {
        tracing.REQUEST_ID: request.request_id, tracing.REQUEST_MODEL: request.model,
        tracing.REQUEST_MAX_TOKENS: sampling.max_tokens, tracing.REQUEST_N: sampling.n,
        tracing.REQUEST_TEMPERATURE: sampling.temperature,
        tracing.REQUEST_TOP_P: sampling.top_p,
        tracing.TENANT: request.tenant, "llmesh.priority": request.priority.name.lower()}


def end_request_span(span: tracing.Span | None, request: GenerationRequest, *,
                     outcome: str, progress: _Progress, timing: _Timing,
                     info: dict[str, object]) -> None:
    """Records the timed stages under ``span`` and ends it with the request's
    parameters, usage and outcome (ERROR status unless it finished: stop, length)."""
    if span is None:
        return
    tracing.record_span("llmesh.first_token", span, timing.dispatched_at,
                        timing.first_token_at)
    tracing.record_span("llmesh.decode", span, timing.first_token_at, timing.last_token_at)
    if timing.admission_wait is not None:
        tracing.record_span("llmesh.admission_wait", span, *timing.admission_wait)
    attributes = _request_attributes(request)
    attributes.update({
        tracing.USAGE_INPUT_TOKENS: progress.prompt_tokens,
        tracing.USAGE_OUTPUT_TOKENS: progress.completion_tokens,
        tracing.CACHED_TOKENS: progress.cached_prompt_tokens, tracing.OUTCOME: outcome})
    for key, name in (("engine", tracing.REPLICA), ("coalesced_with", "llmesh.coalesced_with")):
        if key in info:
            attributes[name] = str(info[key])
    if info.get("cached"):
        attributes["llmesh.response_cache_hit"] = True
    error = "" if outcome in ("stop", "length") else str(info.get("error", outcome))
    tracing.end_span(span, attributes=attributes, error=error)


@contextlib.contextmanager
def timed_admission_wait(timing: _Timing) -> Iterator[None]:
    """Times the block (a request's wait for its admission slot) as
    ``llmesh.admission_wait`` under ``timing.span``: a wait that ends granted
    is kept in ``timing.admission_wait`` and recorded when the request ends
    (a live span cost ~20 us warm, several times that cold, on the first
    token's path); one that raises is recorded at once, ERROR with the
    exception. Nothing when the request is not traced."""
    if timing.span is None:
        yield
        return
    start = time.monotonic()
    try:
        yield
    except BaseException as err:
        tracing.record_span("llmesh.admission_wait", timing.span, start, time.monotonic(),
                            error=f"{type(err).__name__}: {err}")
        raise
    timing.admission_wait = (start, time.monotonic())
