"""The path decision and the two legs of a cascade request.

:meth:`Cascade.run` serves a validated request to the alias
(``request.cascade`` set, ``request.model`` the small model):

1. the mode (:class:`~.policy.CascadeMode`): ``small`` or ``large`` runs that
   model alone, no window;
2. the prompt-only rule, for ``auto``: ``n`` > 1 (the window judges one
   choice) or a prompt longer than ``max_prompt_tokens`` small-model tokens
   goes straight to the large model, so that only requests that need a
   decision pay the window. The length is the small leg's own prompt, after
   its retrieval and history steps and tokenized once: the leg checks it
   (:meth:`~.policy.CascadeLeg.check_prompt`) before admission and ends
   (:class:`~.policy.PromptRerouted`) without generating when it is too long;
3. the window: the small model runs with its engine's logprobs requested
   internally; its first ``k`` tokens are held back (:mod:`.window`) while
   the confidence rule (:mod:`.rule`) scores them; confident: they are
   released (logprobs the client did not ask for stripped) and the small
   generation streams on; else the small generation is cancelled (its
   stream closed: the engine frees its KV blocks at once) and the request
   runs on the large model from the start. The large model is not started
   speculatively: it starts only after the decision.

Every leg runs through the router's own per-model pipeline (``run_model``:
tenancy, admission, cache and coalescing as for a request naming the
model), so a leg's request is what a client naming that model would send:
the small leg carries logprobs and so is never coalesced nor cached (a
replay could not be judged again); the large leg is keyed by the large
model, the answer a direct request to it gets. A changed threshold thus
never replays another path's answer. Each answer's first event and its
Finished carry its :class:`~.path.AnswerPath`; the legs' ``request_finished``
lines carry the cascade's fields (:class:`~.policy.CascadeLeg`).

Cancellation and deadlines during the window: the consumer's ``aclose`` or
cancellation closes the small leg's stream (the engine frees its blocks);
``asyncio.CancelledError`` is never swallowed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable

import grpc

from services.router.cascade.metrics import CascadeMetrics
from services.router.cascade.path import AnswerPath
from services.router.cascade.policy import (
    CascadeLeg,
    CascadeMode,
    CascadePolicy,
    PromptRerouted,
)
from services.router.cascade.rule import escalation_reason, score
from services.router.cascade.window import Window, for_client, hold
from services.router.generation import Event, Finished, GenerationError, Progress
from services.router.validation import GenerationRequest

#: Runs one leg: the request (``model`` the small or large one) → its events.
RunModel = Callable[[GenerationRequest, Progress], AsyncIterator[Event]]


class Cascade:
    """One router's cascade (its policy and metrics)."""

    def __init__(self, policy: CascadePolicy, metrics: CascadeMetrics) -> None:
        self.policy = policy
        self.metrics = metrics

    async def run(self, request: GenerationRequest, run_model: RunModel, *,
                  progress: Progress) -> AsyncIterator[Event]:
        """Serves ``request`` (module doc); yields what the chosen leg yields.

        Raises:
          whatever the legs raise (GenerationError, InvalidRequestError).
        """
        tag = request.cascade
        assert tag is not None, "not a cascade request"
        policy = self.policy
        if tag.mode is CascadeMode.LARGE:
            direct: tuple[str, str] | None = (policy.large, "mode_large")
        elif tag.mode is CascadeMode.SMALL:
            direct = (policy.small, "mode_small")
        elif request.sampling.n > 1:
            direct = (policy.large, "n_choices")
        else:
            direct = None
        if direct is not None:
            events = self._direct(request, tag, *direct, run_model, progress)
        else:
            events = self._windowed(request, tag, run_model, progress)
        async with contextlib.aclosing(events):
            async for event in events:
                yield event

    async def _direct(self, request: GenerationRequest, tag: CascadeLeg, model: str,
                      reason: str, run_model: RunModel,
                      progress: Progress) -> AsyncIterator[Event]:
        path = AnswerPath(model, False, reason)
        leg = dataclasses.replace(tag, leg="small" if model == self.policy.small else "large",
                                  path=path)
        self.metrics.decided(tag.alias, path, held_back_s=None, discarded_tokens=0)
        events = run_model(dataclasses.replace(request, model=model, cascade=leg), progress)
        async with contextlib.aclosing(_stamped(events, path)) as stamped:
            async for event in stamped:
                yield event

    async def _windowed(self, request: GenerationRequest, tag: CascadeLeg,
                        run_model: RunModel, progress: Progress) -> AsyncIterator[Event]:
        policy = self.policy
        client_logprobs = request.sampling.logprobs
        asked = max(client_logprobs or 0, policy.internal_logprobs)
        small_leg = dataclasses.replace(tag, leg="small",
                                        max_prompt_tokens=policy.max_prompt_tokens)
        small = dataclasses.replace(
            request, model=policy.small, cascade=small_leg,
            sampling=dataclasses.replace(request.sampling, logprobs=asked))
        started = time.monotonic()
        # The caller's progress (a cancelled call's usage) counts only what
        # was released: the small leg's own is copied into it from then on.
        small_progress = Progress()
        events = run_model(small, small_progress)
        async with contextlib.aclosing(events):
            try:
                window = await _held(events, policy.window_tokens)
            except PromptRerouted:
                window = None
            if window is None:
                rerouted = self._direct(request, tag, policy.large, "prompt_tokens",
                                        run_model, progress)
                async with contextlib.aclosing(rerouted):
                    async for event in rerouted:
                        yield event
                return
            confidence = score(window.logprobs(policy.window_tokens), policy.margin)
            reason = escalation_reason(policy, confidence)
            held_back_s = time.monotonic() - started
            if reason is None:
                path = AnswerPath(policy.small, False, "confident", confidence.mean_logprob,
                                  window.tokens)
                small_leg.path = path
                self.metrics.decided(tag.alias, path, held_back_s=held_back_s,
                                     discarded_tokens=0)
                async with contextlib.aclosing(_stamped(
                        _released(window.released(client_logprobs), events,
                                  client_logprobs), path)) as kept:
                    async for event in kept:
                        _copy(small_progress, progress)
                        yield event
                return
            path = AnswerPath(policy.large, True, reason, confidence.mean_logprob,
                              window.tokens)
            small_leg.discarded = True
            small_leg.path = path
        # The small stream is closed: its engine sequence is cancelled.
        self.metrics.decided(tag.alias, path, held_back_s=held_back_s,
                             discarded_tokens=window.tokens)
        large = dataclasses.replace(request, model=policy.large,
                                    cascade=dataclasses.replace(tag, leg="large", path=path))
        async with contextlib.aclosing(_stamped(run_model(large, progress), path)) as answer:
            async for event in answer:
                yield event


async def _held(events: AsyncIterator[Event], k: int) -> Window:
    """The window (:func:`~.window.hold`). A deadline that passes while it is
    held says what the client got, none of the held-back tokens, not what
    the small model generated (QA: "after 1 generated tokens" for a client
    that received none).

    Raises:
      GenerationError: DEADLINE_EXCEEDED so reworded; any other the leg's own.
    """
    try:
        return await hold(events, k)
    except GenerationError as err:
        if err.code != grpc.StatusCode.DEADLINE_EXCEEDED:
            raise
        raise GenerationError(err.code, (
            "the call's deadline passed while the cascade held back the small model's first "
            "tokens for its decision: the client received none of them; allow a longer "
            "deadline")) from err


async def _released(held: list[Event], rest: AsyncIterator[Event],
                    client_logprobs: int | None) -> AsyncIterator[Event]:
    """The released window, then the rest of its generation (both as the
    client may see them)."""
    for event in held:
        yield event
    async for event in rest:
        yield for_client(event, client_logprobs)


def _copy(source: Progress, target: Progress) -> None:
    target.prompt_tokens = source.prompt_tokens
    target.completion_tokens = source.completion_tokens
    target.cached_prompt_tokens = source.cached_prompt_tokens


async def _stamped(events: AsyncIterator[Event], path: AnswerPath) -> AsyncIterator[Event]:
    """``events`` with ``path`` on the first event and on every Finished."""
    first = True
    async with contextlib.aclosing(events):
        async for event in events:
            if first or isinstance(event, Finished):
                event = dataclasses.replace(event, path=path)
                first = False
            yield event


__all__ = ["Cascade", "RunModel"]
