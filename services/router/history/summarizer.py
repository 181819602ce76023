"""The summarisation request: a normal generation through the mesh.

:func:`summary_request` builds it (the summariser model, greedy so that the
same turns always give the same summary, ``summary_max_tokens`` at most,
batch priority, the caller's tenant and cache scope; exempt from the
history budget); :func:`generate_text` runs it through a pipeline and returns
the text; a :class:`SummaryRunner` runs it as the tenant whose chat it is.
The prompt is ours: an instruction in the system turn, then the previous
summary and the new turns as a transcript in one user turn, so an
incremental compaction never reads the turns the previous summary covers.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

from services.common.sampling import Priority, SamplingOptions
from services.common.wire.chat import ChatMessage
from services.router.admission import AdmissionRefused
from services.router.generation import Delta, Event
from services.router.validation import GenerationRequest

#: The summariser's instruction (system turn).
INSTRUCTION = (
    "You summarise a conversation between a user and an assistant so that the assistant "
    "can continue it without the original turns. Keep every name, number, fact, preference, "
    "decision and open question the user gave; drop greetings and small talk. Write plain "
    "sentences in the third person, in at most {words} words.")

#: Runs a request through the summariser model's pipeline (``GenerationPipeline.run``).
Generate = Callable[[GenerationRequest], AsyncIterator[Event]]


class SummaryRunner(Protocol):
    """Runs summary requests as the tenant whose chat they summarise (the
    router service: :meth:`Tenancy.background_refusal` and
    :meth:`Tenancy.run_background`)."""

    def refusal(self, request: GenerationRequest) -> AdmissionRefused | None:
        """Why the tenant may not start ``request`` now (over one of its
        limits), or None. Counts nothing."""

    def generate(self, request: GenerationRequest) -> AsyncIterator[Event]:
        """``request`` through the summariser model's pipeline, under the
        tenant's limits and counted in its usage and metrics.

        Raises:
          GenerationError: RESOURCE_EXHAUSTED when the tenant is over a
            limit; as the pipeline does otherwise.
        """


def transcript(previous: str, turns: Sequence[ChatMessage]) -> str:
    """The user turn of the summarisation prompt."""
    lines = []
    if previous:
        lines += ["Summary so far:", previous.strip(), ""]
    lines.append("New messages:" if previous else "Conversation:")
    lines += [f"{m.role.capitalize()}: {m.content.strip()}" for m in turns]
    lines += ["", "Write the updated summary." if previous else "Write the summary."]
    return "\n".join(lines)


def summary_request(origin: GenerationRequest, *, model: str, previous: str,
                    turns: Sequence[ChatMessage], max_tokens: int) -> GenerationRequest:
    """The request that summarises ``previous`` plus ``turns`` for ``origin``'s chat."""
    words = max(16, max_tokens * 3 // 5)
    return GenerationRequest(
        request_id=f"{origin.request_id}.history", model=model, prompt=None,
        messages=(ChatMessage("system", INSTRUCTION.format(words=words)),
                  ChatMessage("user", transcript(previous, turns))),
        sampling=SamplingOptions(temperature=0.0, max_tokens=max_tokens),
        priority=Priority.BATCH, tenant=origin.tenant, cache_scope=origin.cache_scope,
        history_exempt=True)


async def generate_text(generate: Generate, request: GenerationRequest) -> str:
    """The whole text ``request`` generates (deltas joined).

    Raises:
      GenerationError / InvalidRequestError: as the pipeline does.
    """
    parts: list[str] = []
    events = generate(request)
    async with contextlib.aclosing(events):  # type: ignore[type-var]
        async for event in events:
            if isinstance(event, Delta):
                parts.append(event.text)
    return "".join(parts).strip()
