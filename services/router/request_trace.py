"""A request's spans on the router (:mod:`services.common.tracing`).

``llmesh.generate`` is the request's span: a root, or the child of the
client's W3C ``traceparent`` (gRPC metadata or the HTTP header; validated
nowhere: a malformed one starts a new trace). The pipeline opens its live
children around the awaited stages (``llmesh.tokenize``,
``llmesh.cache_lookup``, ``llmesh.admission_wait``); the two stages known
only by their timestamps are recorded here when the request ends, with
explicit times, as vLLM does (no span per token):

* ``llmesh.first_token``: dispatch to the engine until the first token left
  the router (engine queue, prefill and the way back);
* ``llmesh.decode``: the first token until the last.

Off (every function returns at once) unless tracing is configured.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from services.common import tracing

if TYPE_CHECKING:
    from services.router.validation import GenerationRequest


class _Progress(Protocol):
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


class _Timing(Protocol):
    dispatched_at: float | None
    first_token_at: float | None
    last_token_at: float | None


def start_request_span(request: GenerationRequest) -> tracing.Span | None:
    """The request's ``llmesh.generate`` span (None: tracing is off), started now."""
    if not tracing.enabled():
        return None
    sampling = request.sampling
    attributes: dict[str, str | int | float | bool] = {
        tracing.REQUEST_ID: request.request_id, tracing.REQUEST_MODEL: request.model,
        tracing.REQUEST_MAX_TOKENS: sampling.max_tokens, tracing.REQUEST_N: sampling.n,
        tracing.REQUEST_TEMPERATURE: sampling.temperature,
        tracing.REQUEST_TOP_P: sampling.top_p,
        tracing.TENANT: request.tenant, "llmesh.priority": request.priority.name.lower()}
    return tracing.start_span(
        "llmesh.generate", tracing.context_of(request.traceparent, request.tracestate),
        attributes=attributes)


def end_request_span(span: tracing.Span | None, request: GenerationRequest, *,
                     outcome: str, progress: _Progress, timing: _Timing,
                     info: dict[str, object]) -> None:
    """Records the timed stages under ``span`` and ends it with the request's
    usage and outcome (ERROR status unless it finished: stop, length)."""
    if span is None:
        return
    tracing.record_span("llmesh.first_token", span, timing.dispatched_at,
                        timing.first_token_at)
    tracing.record_span("llmesh.decode", span, timing.first_token_at, timing.last_token_at)
    attributes: dict[str, str | int | float | bool] = {
        tracing.USAGE_INPUT_TOKENS: progress.prompt_tokens,
        tracing.USAGE_OUTPUT_TOKENS: progress.completion_tokens,
        tracing.CACHED_TOKENS: progress.cached_prompt_tokens, tracing.OUTCOME: outcome}
    for key, name in (("engine", tracing.REPLICA), ("coalesced_with", "llmesh.coalesced_with")):
        if key in info:
            attributes[name] = str(info[key])
    if info.get("cached"):
        attributes["llmesh.response_cache_hit"] = True
    error = "" if outcome in ("stop", "length") else str(info.get("error", outcome))
    tracing.end_span(span, attributes=attributes, error=error)
