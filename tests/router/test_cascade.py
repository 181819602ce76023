"""The cascade's parts alone (services/router/cascade): the confidence rule,
the policy and mode, the held-back window and the path decision with fake
legs (the mesh test, tests/e2e/test_mesh_cascade.py, runs real ones)."""

from __future__ import annotations

import argparse
import asyncio
import math
from collections.abc import AsyncIterator

import grpc
import pytest
from llmesh.v1 import generation_pb2
from prometheus_client import CollectorRegistry

from services.common.logprobs import PositionLogprobs, TokenLogprob
from services.common.sampling import (
    FinishReason,
    InvalidRequestError,
    Priority,
    SamplingOptions,
)
from services.common.wire.engine_stream import Usage
from services.router.cascade import flags
from services.router.cascade.metrics import CascadeMetrics
from services.router.cascade.policy import CascadeLeg, CascadeMode, CascadePolicy
from services.router.cascade.rule import Confidence, escalation_reason, score
from services.router.cascade.runner import Cascade
from services.router.cascade.window import for_client, hold
from services.router.generation import Delta, Event, Finished, Progress
from services.router.validation import GenerationRequest

POLICY = CascadePolicy("small", "large", window_tokens=3, min_mean_logprob=-1.0)


def position(logprob: float, second: float | None = None) -> PositionLogprobs:
    top = (TokenLogprob(1, logprob, 1),) + (() if second is None
                                              else (TokenLogprob(2, second, 2),))
    return PositionLogprobs(TokenLogprob(1, logprob, 1), top)


def test_score_is_the_mean_logprob_and_the_low_margin_share() -> None:
    window = [position(-0.1, -3.0), position(-0.7, -0.9), position(-1.0, -1.2)]
    got = score(window, margin=0.5)
    assert got.tokens == 3 and math.isclose(got.mean_logprob, -0.6)
    assert math.isclose(got.low_margin_share, 2 / 3)
    assert score(window, margin=0.0).low_margin_share == 0.0
    assert score([], margin=0.5) == Confidence(0, 0.0, 0.0)


def test_escalation_reason_by_threshold_and_margin() -> None:
    assert escalation_reason(POLICY, Confidence(3, -0.99, 1.0)) is None  # margin rule off
    assert escalation_reason(POLICY, Confidence(3, -1.01, 0.0)) == "low_confidence"
    assert escalation_reason(POLICY, Confidence(0, -5.0, 1.0)) is None  # nothing to judge
    margin = CascadePolicy("small", "large", margin=0.5, max_low_margin_share=0.5)
    assert escalation_reason(margin, Confidence(3, -0.2, 0.6)) == "low_margin"
    assert escalation_reason(margin, Confidence(3, -0.2, 0.5)) is None
    assert margin.internal_logprobs == 2 and POLICY.internal_logprobs == 0


@pytest.mark.parametrize("kwargs, message", [
    ({"small": "a", "large": "a"}, "must differ"),
    ({"small": "a", "large": "b", "window_tokens": 0}, "--cascade-window"),
    ({"small": "a", "large": "b", "min_mean_logprob": 0.5}, "log-probability"),
    # QA: NaN passed (every comparison false: nothing was ever escalated)
    ({"small": "a", "large": "b", "min_mean_logprob": float("nan")}, "log-probability"),
    ({"small": "a", "large": "b", "max_low_margin_share": 2.0}, "share"),
    ({"small": "a b", "large": "b"}, "not a model id"),
])
def test_policy_refuses_bad_settings(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CascadePolicy(**kwargs)


def test_mode_from_the_field_then_the_header() -> None:
    assert CascadeMode.of(generation_pb2.CASCADE_MODE_LARGE, "small") is CascadeMode.LARGE
    assert CascadeMode.of(0, " Small ") is CascadeMode.SMALL
    assert CascadeMode.of(0, None) is CascadeMode.AUTO
    with pytest.raises(InvalidRequestError, match="x-llmesh-cascade"):
        CascadeMode.of(0, "medium")
    with pytest.raises(InvalidRequestError, match="cascade"):
        CascadeMode.of(7, None)


def test_flags_build_the_policy_and_pass_on_to_the_router() -> None:
    parser = argparse.ArgumentParser()
    flags.add_arguments(parser)
    args = parser.parse_args(["--cascade", "s,l", "--cascade-window", "4",
                              "--cascade-min-mean-logprob=-0.5"])
    assert flags.policy_from_args(args) == CascadePolicy("s", "l", window_tokens=4,
                                                         min_mean_logprob=-0.5)
    assert flags.router_args(args) == ["--cascade", "s,l", "--cascade-window", "4",
                                       "--cascade-min-mean-logprob", "-0.5"]
    assert flags.policy_from_args(parser.parse_args([])) is None
    with pytest.raises(ValueError, match="need --cascade"):
        flags.policy_from_args(parser.parse_args(["--cascade-window", "4"]))


def delta(*logprobs: float) -> Delta:
    return Delta("x" * len(logprobs), tuple(range(len(logprobs))),
                 logprobs=tuple(position(lp, lp - 1.0) for lp in logprobs))


FINISHED = Finished(FinishReason.LENGTH, "", Usage(3, 4, 0))


async def events_of(*events: Event) -> AsyncIterator[Event]:
    for event in events:
        yield event


async def test_hold_stops_at_k_tokens_and_leaves_the_rest_unread() -> None:
    events = events_of(delta(-0.1, -0.2), delta(-0.3, -0.4), delta(-0.5), FINISHED)
    window = await hold(events, 3)
    assert window.tokens == 4 and not window.finished
    assert [p.chosen.logprob for p in window.logprobs(3)] == [-0.1, -0.2, -0.3]
    assert [e async for e in events] == [delta(-0.5), FINISHED]
    short = await hold(events_of(delta(-0.1), FINISHED), 3)
    assert short.finished and short.tokens == 1


def test_for_client_strips_or_cuts_the_internal_logprobs() -> None:
    assert for_client(delta(-0.1), None).logprobs == ()
    assert for_client(delta(-0.1), 1).logprobs[0].top == (TokenLogprob(1, -0.1, 1),)
    assert for_client(FINISHED, None) is FINISHED


class Legs:
    """Fake legs: the small model's scripted events; the large model's one
    delta. Records each leg's request and whether its stream was closed."""

    def __init__(self, small: list[Event], prompt_tokens: int = 5) -> None:
        self.small = small
        self.prompt_tokens = prompt_tokens
        self.requests: list[GenerationRequest] = []
        self.closed: list[str] = []

    async def run(self, request: GenerationRequest, progress: Progress) -> AsyncIterator[Event]:
        self.requests.append(request)
        try:
            if request.cascade is not None:  # as the pipeline does, once tokenized
                request.cascade.check_prompt(self.prompt_tokens)
            if request.model == "small":
                for event in self.small:
                    yield event
            else:
                yield Delta("large", (9,))
                yield FINISHED
        finally:
            self.closed.append(request.model)


def cascade_request(mode: CascadeMode = CascadeMode.AUTO, n: int = 1,
                    logprobs: int | None = None) -> GenerationRequest:
    return GenerationRequest("r", "small", "prompt", None,
                             SamplingOptions(max_tokens=8, n=n, logprobs=logprobs),
                             Priority.INTERACTIVE, cascade=CascadeLeg("auto", mode))


async def serve(legs: Legs, request: GenerationRequest,
                policy: CascadePolicy = POLICY) -> list[Event]:
    cascade = Cascade(policy, CascadeMetrics(CollectorRegistry()))
    return [e async for e in cascade.run(request, legs.run, progress=Progress())]


async def test_a_confident_window_is_released_without_the_internal_logprobs() -> None:
    legs = Legs([delta(-0.1, -0.2), delta(-0.3), delta(-0.2), FINISHED])
    out = await serve(legs, cascade_request())
    assert legs.requests[0].sampling.logprobs == 0  # asked internally
    assert [type(e) for e in out] == [Delta, Delta, Delta, Finished]
    assert all(e.logprobs == () for e in out if isinstance(e, Delta))
    first, last = out[0].path, out[-1].path
    assert first is not None and first == last
    assert (first.model, first.escalated, first.reason, first.held_back_tokens) == (
        "small", False, "confident", 3)
    assert out[1].path is None


async def test_a_doubtful_window_is_dropped_and_the_large_model_answers() -> None:
    legs = Legs([delta(-2.0, -3.0), delta(-0.1), delta(-0.1), FINISHED])
    out = await serve(legs, cascade_request())
    # Nothing of the small model: only the large model's events, the first named.
    assert [e.text for e in out if isinstance(e, Delta)] == ["large"]
    assert out[0].path is not None and out[0].path.escalated
    assert out[0].path.reason == "low_confidence" and out[0].path.held_back_tokens == 3
    assert legs.closed[0] == "small"  # closed before the large leg started
    assert [r.model for r in legs.requests] == ["small", "large"]
    small_leg = legs.requests[0].cascade
    assert small_leg is not None and small_leg.discarded
    assert legs.requests[1].sampling.logprobs is None  # the client's own sampling


@pytest.mark.parametrize("request_, prompt_tokens, reason", [
    (cascade_request(CascadeMode.LARGE), 5, "mode_large"),
    (cascade_request(n=2), 5, "n_choices"),
    (cascade_request(), 50, "prompt_tokens"),
])
async def test_the_prompt_rule_and_the_mode_skip_the_window(
        request_: GenerationRequest, prompt_tokens: int, reason: str) -> None:
    legs = Legs([delta(-0.1), FINISHED], prompt_tokens)
    policy = CascadePolicy("small", "large", max_prompt_tokens=10)
    out = await serve(legs, request_, policy)
    # The prompt rule runs on the small leg's own prompt (tokenized once):
    # that leg ends before it generates.
    legs_run = ["small", "large"] if reason == "prompt_tokens" else ["large"]
    assert [r.model for r in legs.requests] == legs_run
    assert [e.text for e in out if isinstance(e, Delta)] == ["large"]
    assert out[0].path is not None and out[0].path.reason == reason
    assert out[0].path.held_back_tokens == 0 and not out[0].path.escalated


async def test_leaving_during_the_window_closes_the_small_leg() -> None:
    started = asyncio.Event()

    class Stalled(Legs):
        async def run(self, request: GenerationRequest,
                      progress: Progress) -> AsyncIterator[Event]:
            try:
                yield delta(-0.1)
                started.set()
                await asyncio.Event().wait()  # decoding the rest of the window
                yield FINISHED
            finally:
                self.closed.append(request.model)

    legs = Stalled([])
    task = asyncio.create_task(serve(legs, cascade_request()))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert legs.closed == ["small"]


def test_up_refuses_a_cascade_over_models_it_does_not_serve() -> None:
    parser = argparse.ArgumentParser()
    flags.add_arguments(parser)
    args = parser.parse_args(["--cascade", "small,large"])
    assert flags.problem(args, ["small", "large"]) is None
    assert "['large']" in (flags.problem(args, ["small"]) or "")
    assert "SMALL,LARGE" in (flags.problem(parser.parse_args(["--cascade", "a"]), []) or "")


def test_token_ids_to_the_alias_are_refused_naming_prompt_tokens() -> None:
    """QA: SmolLM2's ids reached Gemma on the large leg and it answered noise;
    ids belong to one vocabulary, so the alias takes text only."""
    from llmesh.v1 import generation_pb2
    from services.common.sampling import InvalidRequestError
    from services.router.cascade.edge import validate_alias

    pb = generation_pb2.GenerateRequest(model="auto")
    pb.prompt_tokens.token_ids.extend([1, 2, 3])

    def validate_as(leg):
        raise AssertionError("validated a leg")

    with pytest.raises(InvalidRequestError) as err:
        validate_alias(pb, None, POLICY_WITH_ALIAS, validate_as)
    assert err.value.field == "prompt_tokens"


POLICY_WITH_ALIAS = CascadePolicy("small", "large", alias="auto")


async def test_a_deadline_in_the_window_says_the_client_received_no_token() -> None:
    """QA: the small leg's own message ("after 1 generated tokens") reached a
    client that had received none (the window held them back)."""
    from services.router.clients import UpstreamError
    from services.router.generation import GenerationError, upstream_to_generation_error

    class Late(Legs):
        async def run(self, request: GenerationRequest,
                      progress: Progress) -> AsyncIterator[Event]:
            yield delta(-0.1)
            raise upstream_to_generation_error(UpstreamError(
                "engine", "t", grpc.StatusCode.DEADLINE_EXCEEDED, "late"), completion_tokens=1)

    with pytest.raises(GenerationError) as late:
        await serve(Late([]), cascade_request())
    assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "generated tokens" not in late.value.message
    assert "received none" in late.value.message
