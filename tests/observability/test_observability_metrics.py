"""Metrics of the real mesh move by exactly what a known workload should add.

Phase A sends 3 greedy chat requests (``bypass_cache``, ``ignore_eos``,
``max_tokens=8``) through Envoy; phase B starts a long generation on a
``GenerateStream``, cancels it after 2 token messages and closes the stream.
Every ``/metrics`` and Envoy's ``/stats/prometheus`` are scraped before A,
between A and B and after B (once the mesh is quiet), and the deltas are
compared with what the client saw. Other tests may have used the session
mesh before: only deltas are compared, never absolute values (the gauges
must be back at 0).

What a cancelled request contributes (docs/observability.md): one
``requests_total{outcome="cancelled"}``, one TTFT (it had produced a token),
one e2e and one queue time observation, no time-per-output-token, and its
usage (as in its final CANCELLED message) in the token counters. Its ITL
observations are one per token message the router sent before the cancel
landed, which may be more than the client read: a range is checked.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import grpc
import pytest

from llmesh.v1 import common_pb2, generation_pb2_grpc, tokenizer_pb2, tokenizer_pb2_grpc
from services.cli.mesh import Mesh
from services.common.gpu_telemetry import GPU_METRIC_NAMES, open_gpus
from tests.e2e.mesh_client import BidiSession, chat_request
from tests.observability.observability_scrape import Scrape, delta, scrape_all, wait_until

pytestmark = pytest.mark.mesh

PROMPTS = ("Count from one to five.", "Name a green fruit.", "Say hello to Ada.")
MAX_TOKENS = 8
CANCEL_PROMPT = "Tell me a very long story about a lighthouse keeper."
UNSPECIFIED = common_pb2.FINISH_REASON_UNSPECIFIED
ROUTER, TOKENIZER, CACHE, ENGINE, ENVOY = "router", "tokenizer", "cache", "engine-0", "envoy"
ROUTER_CLUSTER = {"envoy_cluster_name": "router"}


@dataclass
class Seen:
    """What the client saw of one request."""

    prompt_tokens: int
    completion_tokens: int
    token_messages: int  # responses that carried token ids
    finish_reason: int
    ttft_s: float
    e2e_s: float


@dataclass
class Workload:
    start: dict[str, Scrape]  # before the direct ApplyChatTemplate calls
    before: dict[str, Scrape]
    middle: dict[str, Scrape]
    after: dict[str, Scrape]
    completed: list[Seen]
    cancelled: Seen
    expected_prompt_tokens: list[int]
    cancel_expected_prompt_tokens: int


def _quiet(s: dict[str, Scrape]) -> bool:
    return (s[ENGINE].sum("llmesh:num_requests_running") == 0
            and s[ENGINE].sum("llmesh:num_requests_waiting") == 0
            and s[ROUTER].sum("llmesh:router_requests_in_flight") == 0
            and s[TOKENIZER].sum("llmesh:tokenizer_detokenize_streams") == 0)


def _settled(mesh: Mesh) -> dict[str, Scrape]:
    """A scrape of a quiet mesh whose background work (cache writes) has landed:
    two scrapes 0.2 s apart agree on the counters that may still move."""
    moving = (("cache", "llmesh:cache_request_duration_seconds_count"),
              (ENGINE, "llmesh:generation_tokens_total"),
              (ROUTER, "llmesh:requests_total"))
    result: list[dict[str, Scrape]] = []

    def check() -> bool:
        first = scrape_all(mesh)
        time.sleep(0.2)
        second = scrape_all(mesh)
        result[:] = [second]
        return _quiet(second) and all(first[w].sum(n) == second[w].sum(n) for w, n in moving)

    wait_until(check, 10.0, "the mesh to be quiet")
    return result[0]


def _prompt_tokens(mesh: Mesh, content: str) -> int:
    channel = grpc.insecure_channel(mesh.services[TOKENIZER].grpc_address)
    with channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        reply = stub.ApplyChatTemplate(tokenizer_pb2.ApplyChatTemplateRequest(
            messages=[common_pb2.ChatMessage(role="user", content=content)],
            add_generation_prompt=True), timeout=10)
    return len(reply.token_ids)


def _generate(channel: grpc.Channel, content: str) -> Seen:
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    started = time.monotonic()
    first_token_at = None
    token_messages = 0
    last = None
    for response in stub.Generate(chat_request(content, max_tokens=MAX_TOKENS, ignore_eos=True,
                                               bypass_cache=True), timeout=60):
        if response.token_ids:
            token_messages += 1
            first_token_at = first_token_at or time.monotonic()
        last = response
    assert last is not None and first_token_at is not None
    return Seen(last.usage.prompt_tokens, last.usage.completion_tokens, token_messages,
                last.finish_reason, first_token_at - started, time.monotonic() - started)


def _generate_and_cancel(channel: grpc.Channel) -> Seen:
    session = BidiSession(channel, timeout=60)
    started = time.monotonic()
    session.start(chat_request(CANCEL_PROMPT, max_tokens=200, ignore_eos=True))
    token_messages = 0
    first_token_at = None
    while token_messages < 2:
        response = session.next()
        assert response.finish_reason == UNSPECIFIED, "finished before the cancel"
        if response.token_ids:
            token_messages += 1
            first_token_at = first_token_at or time.monotonic()
    session.cancel()
    while (last := session.next()).finish_reason == UNSPECIFIED:
        pass  # deltas already on their way are dropped by the router, not sent
    session.close()
    for _ in session.call:  # the stream ends OK once the client half-closed
        pass
    assert first_token_at is not None
    return Seen(last.usage.prompt_tokens, last.usage.completion_tokens, token_messages,
                last.finish_reason, first_token_at - started, time.monotonic() - started)


@pytest.fixture(scope="module")
def workload(mesh: Mesh, ingress_channel: grpc.Channel) -> Workload:
    start = _settled(mesh)
    expected = [_prompt_tokens(mesh, p) for p in PROMPTS]
    cancel_expected = _prompt_tokens(mesh, CANCEL_PROMPT)
    before = _settled(mesh)
    completed = [_generate(ingress_channel, p) for p in PROMPTS]
    middle = _settled(mesh)
    cancelled = _generate_and_cancel(ingress_channel)
    # The engine counts the cancelled sequence when it frees it, at its next step
    # (test_engine_counters says so when it never does).
    with contextlib.suppress(AssertionError):
        wait_until(lambda: delta(middle, scrape_all(mesh), ENGINE,
                                 "llmesh:request_success_total", finished_reason="cancelled") >= 1,
                   5.0, "the engine to count the cancelled request")
    after = _settled(mesh)
    return Workload(start, before, middle, after, completed, cancelled, expected,
                    cancel_expected)


# --------------------------------------------------------------------------- #
# What the client saw (the premises of the exact checks below).


def test_the_workload_ran_as_intended(workload: Workload) -> None:
    for seen, expected in zip(workload.completed, workload.expected_prompt_tokens, strict=True):
        assert seen.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert seen.completion_tokens == MAX_TOKENS
        assert seen.prompt_tokens == expected  # the router's prompt is the tokenizer's
    cancelled = workload.cancelled
    assert cancelled.finish_reason == common_pb2.FINISH_REASON_CANCELLED
    assert cancelled.prompt_tokens == workload.cancel_expected_prompt_tokens
    assert 2 <= cancelled.completion_tokens < 200


# --------------------------------------------------------------------------- #
# Router: the client's latencies and counts.


def test_router_histograms_count_each_completed_request(workload: Workload) -> None:
    a, b = workload.before, workload.middle
    n = len(PROMPTS)
    for name in ("llmesh:time_to_first_token_seconds", "llmesh:e2e_request_latency_seconds",
                 "llmesh:request_queue_time_seconds",
                 "llmesh:request_time_per_output_token_seconds"):
        assert delta(a, b, ROUTER, f"{name}_count") == n, name
        assert delta(a, b, ROUTER, f"{name}_bucket", le="+Inf") == n, name
    itl = sum(seen.token_messages - 1 for seen in workload.completed)
    assert delta(a, b, ROUTER, "llmesh:inter_token_latency_seconds_count") == itl
    # Measured from the router's receipt: never more than what the client measured.
    client_ttft = sum(seen.ttft_s for seen in workload.completed)
    router_ttft = delta(a, b, ROUTER, "llmesh:time_to_first_token_seconds_sum")
    assert 0 < router_ttft <= client_ttft
    client_e2e = sum(seen.e2e_s for seen in workload.completed)
    router_e2e = delta(a, b, ROUTER, "llmesh:e2e_request_latency_seconds_sum")
    assert router_ttft < router_e2e <= client_e2e


def test_router_counters_count_outcomes_and_tokens(workload: Workload) -> None:
    a, b = workload.before, workload.middle
    n = len(PROMPTS)
    assert delta(a, b, ROUTER, "llmesh:requests_total", outcome="length",
                 priority="interactive") == n
    assert delta(a, b, ROUTER, "llmesh:requests_total") == n
    assert delta(a, b, ROUTER, "llmesh:generation_tokens_total") == n * MAX_TOKENS
    assert delta(a, b, ROUTER, "llmesh:prompt_tokens_total") == sum(
        workload.expected_prompt_tokens)
    assert delta(a, b, ROUTER, "llmesh:response_cache_queries_total") == 0  # bypass_cache


def test_router_counts_a_cancelled_request_as_cancelled(workload: Workload) -> None:
    b, c = workload.middle, workload.after
    seen = workload.cancelled
    assert delta(b, c, ROUTER, "llmesh:requests_total", outcome="cancelled",
                 priority="interactive") == 1
    assert delta(b, c, ROUTER, "llmesh:requests_total") == 1
    for name in ("llmesh:time_to_first_token_seconds", "llmesh:e2e_request_latency_seconds",
                 "llmesh:request_queue_time_seconds"):
        assert delta(b, c, ROUTER, f"{name}_count") == 1, name
    assert delta(b, c, ROUTER, "llmesh:request_time_per_output_token_seconds_count") == 0
    itl = delta(b, c, ROUTER, "llmesh:inter_token_latency_seconds_count")
    assert seen.token_messages - 1 <= itl <= seen.completion_tokens - 1
    assert delta(b, c, ROUTER, "llmesh:generation_tokens_total") == seen.completion_tokens
    assert delta(b, c, ROUTER, "llmesh:prompt_tokens_total") == seen.prompt_tokens


def test_gauges_return_to_zero(workload: Workload) -> None:
    for scrape in (workload.middle, workload.after):
        assert scrape[ROUTER].sum("llmesh:router_requests_in_flight") == 0
        assert scrape[ENGINE].sum("llmesh:num_requests_running") == 0
        assert scrape[ENGINE].sum("llmesh:num_requests_waiting") == 0
        assert scrape[TOKENIZER].sum("llmesh:tokenizer_detokenize_streams") == 0


# --------------------------------------------------------------------------- #
# Engine, tokenizer, cache.


def test_engine_counts_completed_requests_and_their_tokens(workload: Workload) -> None:
    a, b = workload.before, workload.middle
    n = len(PROMPTS)
    assert delta(a, b, ENGINE, "llmesh:request_success_total", finished_reason="length") == n
    assert delta(a, b, ENGINE, "llmesh:request_success_total") == n
    assert delta(a, b, ENGINE, "llmesh:generation_tokens_total") == n * MAX_TOKENS
    assert delta(a, b, ENGINE, "llmesh:prompt_tokens_total") == sum(
        workload.expected_prompt_tokens)
    assert delta(a, b, ENGINE, "llmesh:engine_step_duration_seconds_count") >= MAX_TOKENS


def test_engine_counts_a_cancelled_request_as_cancelled(workload: Workload) -> None:
    b, c = workload.middle, workload.after
    # Counted once as cancelled; the engine may have generated a few tokens more
    # than reached the router before the cancel.
    assert delta(b, c, ENGINE, "llmesh:request_success_total", finished_reason="cancelled") == 1
    assert delta(b, c, ENGINE, "llmesh:request_success_total") == 1
    assert delta(b, c, ENGINE, "llmesh:generation_tokens_total") >= (
        workload.cancelled.completion_tokens)
    assert delta(b, c, ENGINE, "llmesh:prompt_tokens_total") == workload.cancelled.prompt_tokens


def test_tokenizer_counts_and_times_each_call(workload: Workload) -> None:
    """The tokenizer service counts the calls made to it (the workload's own
    ``ApplyChatTemplate`` calls that measured the prompts); the router makes
    the prompt ids in process (its default) and detokenizes in process, so
    the requests through the mesh call the service not once, and the router
    counts each prompt on the ``local`` path."""
    start, a, b, c = workload.start, workload.before, workload.middle, workload.after
    n = len(PROMPTS) + 1
    ok = dict(method="ApplyChatTemplate", code="OK")
    assert delta(start, a, TOKENIZER, "llmesh:tokenizer_requests_total", **ok) == n
    assert delta(start, a, TOKENIZER, "llmesh:tokenizer_request_duration_seconds_count",
                 method="ApplyChatTemplate") == n
    assert delta(start, a, TOKENIZER, "llmesh:tokenizer_tokens_total",
                 method="ApplyChatTemplate") == (sum(workload.expected_prompt_tokens)
                                                 + workload.cancel_expected_prompt_tokens)
    for name in ("llmesh:tokenizer_requests_total", "llmesh:tokenizer_tokens_total",
                 "llmesh:tokenizer_request_duration_seconds_count"):
        assert delta(a, c, TOKENIZER, name) == 0, name
    tokenized = "llmesh:router_tokenize_total"
    assert delta(a, b, ROUTER, tokenized, path="local") == len(PROMPTS)
    assert delta(b, c, ROUTER, tokenized, path="local") == 1
    assert delta(a, c, ROUTER, tokenized, path="service") == 0
    assert c[ROUTER].sum("llmesh:router_tokenizer_in_process") == 1


def test_cache_times_the_writes_of_completed_requests_only(workload: Workload) -> None:
    a, b, c = workload.before, workload.middle, workload.after
    # Greedy requests are stored even with bypass_cache (which skips the lookup only).
    # They travel batched on the router's one PutCachedResponses call: one
    # observation per message, each carrying one store or more.
    n = len(PROMPTS)
    assert 1 <= delta(a, b, CACHE, "llmesh:cache_request_duration_seconds_count",
                      method="PutCachedResponses") <= n
    assert delta(a, b, CACHE, "llmesh:cache_request_duration_seconds_count",
                 method="PutCachedResponse") == 0
    assert delta(a, b, CACHE, "llmesh:response_cache_stores_total") == n
    assert delta(a, b, ROUTER, "llmesh:router_response_cache_stores_total", outcome="stored") == n
    assert delta(a, b, CACHE, "llmesh:cache_request_duration_seconds_count",
                 method="GetCachedResponse") == 0
    assert delta(b, c, CACHE, "llmesh:cache_request_duration_seconds_count") == 0


# --------------------------------------------------------------------------- #
# Envoy.


def test_envoy_counts_each_request_to_the_router(workload: Workload) -> None:
    a, b, c = workload.before, workload.middle, workload.after
    n = len(PROMPTS)

    assert delta(a, b, ENVOY, "envoy_cluster_upstream_rq_total", **ROUTER_CLUSTER) == n
    assert delta(a, b, ENVOY, "envoy_cluster_upstream_rq", envoy_response_code="200",
                 **ROUTER_CLUSTER) == n
    assert delta(b, c, ENVOY, "envoy_cluster_upstream_rq_total", **ROUTER_CLUSTER) == 1
    assert delta(a, b, ENVOY, "envoy_cluster_grpc_total", envoy_grpc_bridge_method="Generate",
                 envoy_grpc_bridge_service="llmesh.v1.GenerationService", **ROUTER_CLUSTER) == n
    assert delta(a, b, ENVOY, "envoy_cluster_grpc_success", envoy_grpc_bridge_method="Generate",
                 **ROUTER_CLUSTER) == n
    assert delta(b, c, ENVOY, "envoy_cluster_grpc_total",
                 envoy_grpc_bridge_method="GenerateStream", **ROUTER_CLUSTER) == 1


# --------------------------------------------------------------------------- #
# GPU telemetry.


def test_gpu_gauges_only_where_a_gpu_is(workload: Workload) -> None:
    exported = workload.after[ENGINE].names & set(GPU_METRIC_NAMES)
    if open_gpus() is None:
        assert exported == set()  # absent, and the scrape still worked
    else:
        assert exported == set(GPU_METRIC_NAMES)
    for name in ("router", "tokenizer", "cache"):  # the engine reports the devices
        assert not workload.after[name].names & set(GPU_METRIC_NAMES)


def test_no_created_series(workload: Workload) -> None:
    for name, scrape in workload.after.items():
        if name != ENVOY:
            assert not [n for n in scrape.names if n.endswith("_created")], name

