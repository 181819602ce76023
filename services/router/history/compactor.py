"""The pipeline's history step (:class:`HistoryCompactor`), for one model.

Per chat request (:meth:`HistoryCompactor.prompt`), in place of the plain
chat template call:

1. the conversation's summary boundaries and their prefix hashes
   (:func:`~.conversation.boundaries`), and one ``GetHistorySummary`` for
   all of them: the longest prefix summarised, and whether a longer one is
   being summarised now;
2. the prompt: the system turn with that summary, then the turns after it
   (:func:`~.conversation.rewrite`), rendered within the budget: when it does
   not fit, the tokenizer drops the oldest turns, as without a budget (the
   turn that crosses the budget is served trimmed);
3. when the prompt passes three quarters of the budget or turns were dropped
   (:func:`~.plan.compaction_due`), and no compaction is under way, a
   compaction in the background (:meth:`HistoryCompactor._compact`): the turns from the
   stored summary's end to the boundary :func:`~.plan.compaction_end` picks
   are summarised together with the stored summary (incremental: the older
   turns are never read again), under a claim in the cache service so that
   one router writes it, then stored under that boundary's hash.

The summary is the tenant's work, run as the tenant (:class:`~.summarizer.SummaryRunner`):
at batch priority, under its limits, counted in its usage and metrics. A
tenant over a limit gets none: before it claims anything the compaction
waits out the limit's retry hint when that is short (at most
:data:`~.settings.DEFER_WAIT_S` in all), else it is deferred (outcome
``deferred``) and a later turn past the high-water mark tries again; its
turns are trimmed meanwhile. (Should the limit be reached between that
check and the generation, the generation is refused, the outcome is
``deferred`` too, and the claim's lease, ``lease_seconds``, holds the retry
off.)

A request with ``history.summarize: false`` is only trimmed to the budget.
The request learns what happened in a :class:`HistoryReport` (``usage``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import structlog

from services.common.wire.chat import ChatMessage, ChatPrompt
from services.router.admission import AdmissionRefused
from services.router.clients import UpstreamError
from services.router.generation import GenerationError
from services.router.history.conversation import (
    Boundary,
    Conversation,
    boundaries,
    earlier_turns,
    rewrite,
    split,
)
from services.router.history.metrics import HistoryMetrics
from services.router.history.plan import compaction_due, compaction_end, low_water_tokens
from services.router.history.settings import DEFER_WAIT_S, HistorySettings
from services.router.history.store import Lookup, Summary, SummaryStore
from services.router.history.summarizer import SummaryRunner, generate_text, summary_request
from services.router.local_tokenizer import PromptTokenizer
from services.router.validation import GenerationRequest

log = structlog.get_logger()
#: Seconds between two checks of a tenant's limits when its hint is shorter.
_MIN_RECHECK_S = 0.05


@dataclass(frozen=True)
class HistoryReport:
    """What compaction did to one request's prompt (``usage`` fields 4 and 5).

    Attributes:
      turns_summarized: turns a stored summary replaced (0: none).
      tokens_saved: prompt tokens those turns took, less the summary's.
    """

    turns_summarized: int = 0
    tokens_saved: int = 0


class HistoryCompactor:
    """History compaction of one model's chats; owner of its background compactions.

    Args:
      model: the model whose chats it compacts.
      budget: its prompt-token budget (>= 1).
      settings: the router's history settings.
      tokenizer: the model's prompt tokenizer.
      store: the cache service's summaries.
      runner: runs a summary request as the chat's tenant.
      metrics: where to count.
    """

    def __init__(self, *, model: str, budget: int, settings: HistorySettings,
                 tokenizer: PromptTokenizer, store: SummaryStore, runner: SummaryRunner,
                 metrics: HistoryMetrics) -> None:
        self.model = model
        self.budget = budget
        self.settings = settings
        self.summarizer = settings.summarizer(model)
        self._tokenizer = tokenizer
        self._store = store
        self._runner = runner
        self._metrics = metrics
        self._background: set[asyncio.Task[None]] = set()

    async def prompt(self, request: GenerationRequest, *, max_prompt_tokens: int,
                     deadline: float | None, traceparent: str = ""
                     ) -> tuple[ChatPrompt, HistoryReport]:
        """The request's chat prompt within the budget, and what compaction did.

        Raises:
          UpstreamError: as ``apply_chat_template`` (the pipeline maps it).
        """
        assert request.messages is not None
        budget = min(self.budget, max_prompt_tokens)
        if request.summarize_history is False:
            return await self._render_fitting(request, request.messages, budget,
                                              max_prompt_tokens, deadline,
                                              traceparent), HistoryReport()
        conversation = split(request.messages)
        candidates = boundaries(conversation, model=self.model, summarizer=self.summarizer)
        found = await self._lookup(request, candidates)
        start = candidates[found.index].end if found.summary is not None else 0
        messages = rewrite(conversation, found.summary.text if found.summary else "", start)
        chat = await self._render_fitting(request, messages, budget, max_prompt_tokens,
                                          deadline, traceparent)
        if compaction_due(len(chat.token_ids), chat.num_dropped_messages, budget) \
                and not found.pending:
            self._spawn(self._compact(request, conversation, candidates, found.summary, start))
        if found.summary is None:
            return chat, HistoryReport()
        self._metrics.tokens_saved.labels(self.model).inc(found.summary.tokens_saved)
        return chat, HistoryReport(start, found.summary.tokens_saved)

    async def close(self) -> None:
        """Cancels the compactions still running (their claims' leases end them)."""
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    async def _lookup(self, request: GenerationRequest, candidates: Sequence[Boundary]
                      ) -> Lookup:
        if not candidates:
            return Lookup()
        found = await self._store.lookup(request.cache_scope,
                                         [b.prefix_hash for b in candidates],
                                         request_id=request.request_id)
        result = "hit" if found.summary is not None else "miss"
        self._metrics.lookups.labels(self.model, result).inc()
        return found

    async def _render(self, request: GenerationRequest, messages: Sequence[ChatMessage],
                      max_prompt_tokens: int, deadline: float | None, traceparent: str = ""
                      ) -> ChatPrompt:
        return await self._tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, max_prompt_tokens=max_prompt_tokens,
            request_id=request.request_id, deadline=deadline,
            allow_special_tokens=request.allow_special_tokens, traceparent=traceparent,
            tools=request.chat_tools)

    async def _render_fitting(self, request: GenerationRequest,
                              messages: Sequence[ChatMessage], budget: int,
                              context_limit: int, deadline: float | None,
                              traceparent: str) -> ChatPrompt:
        """``messages`` rendered within the budget, which may drop only earlier
        turns: when the current exchange (the messages after the last assistant
        reply: the user's turn, retrieval passages, tool results) does not fit
        the budget by itself, it is rendered within the context window
        (``context_limit``) instead. The budget is a target for the history,
        never a limit on the request itself (QA: a long message was refused
        and a RAG request's passages were dropped while reported as used).

        Raises:
          UpstreamError: as ``apply_chat_template`` (OUT_OF_RANGE only when the
            context window itself is too small).
        """
        try:
            chat = await self._render(request, messages, budget, deadline, traceparent)
        except UpstreamError as err:
            if err.code != grpc.StatusCode.OUT_OF_RANGE or budget >= context_limit:
                raise
        else:
            if chat.num_dropped_messages <= earlier_turns(messages) or budget >= context_limit:
                return chat
        return await self._render(request, messages, context_limit, deadline, traceparent)

    def _spawn(self, work: object) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(work)  # type: ignore[arg-type]
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _compaction_end(self, request: GenerationRequest, conversation: Conversation,
                              candidates: Sequence[Boundary], start: int) -> Boundary | None:
        """Where this compaction ends (:func:`~.plan.compaction_end`)."""
        low = low_water_tokens(self.budget, self.settings.summary_max_tokens)
        try:
            kept = await self._render(request, conversation.system + conversation.turns[start:],
                                      low, None)
            min_end = start + kept.num_dropped_messages
        except UpstreamError as err:
            if err.code != grpc.StatusCode.OUT_OF_RANGE:
                raise
            min_end = len(conversation.turns)  # not even the last turn fits: all but it
        return compaction_end(candidates, start, min_end)

    async def _compact(self, request: GenerationRequest, conversation: Conversation,
                       candidates: Sequence[Boundary], previous: Summary | None,
                       start: int) -> None:
        """Summarises ``previous`` plus the turns from ``start`` to the planned
        boundary and stores it, once per boundary across routers (the claim)."""
        started = time.monotonic()
        outcome = "failed"
        running = self._metrics.running.labels(self.model)
        running.inc()
        try:
            end = await self._compaction_end(request, conversation, candidates, start)
            if end is None:
                return
            summarize = summary_request(
                request, model=self.summarizer, previous=previous.text if previous else "",
                turns=conversation.turns[start:end.end],
                max_tokens=self.settings.summary_max_tokens)
            if (refused := await self._tenant_room(summarize)) is not None:
                outcome = "deferred"
                log.info("history_compaction_deferred", model=self.model,
                         tenant=request.tenant, limit=refused.reason,
                         retry_after_ms=refused.retry_after_ms)
                return
            if not await self._store.claim(request.cache_scope, end.prefix_hash,
                                           lease_seconds=self.settings.lease_seconds,
                                           request_id=request.request_id):
                outcome = "claimed_elsewhere"
                return
            summary = await self._summary(request, conversation, summarize, previous,
                                          start, end.end)
            if await self._store.put(request.cache_scope, end.prefix_hash, summary,
                                     request_id=request.request_id):
                outcome = "stored"
                self._metrics.summarized_turns.labels(self.model).inc(end.end - start)
                self._metrics.summary_seconds.labels(self.model).observe(
                    time.monotonic() - started)
                log.info("history_compacted", model=self.model, summarized_turns=end.end,
                         new_turns=end.end - start, summary_tokens=summary.summary_tokens,
                         tokens_saved=summary.tokens_saved,
                         seconds=round(time.monotonic() - started, 3))
        except asyncio.CancelledError:
            raise
        except GenerationError as err:
            if err.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                log.warning("history_compaction_failed", model=self.model, error=repr(err))
            else:  # the tenant reached a limit since the check: its claim's lease ends it
                outcome = "deferred"
                log.info("history_compaction_deferred", model=self.model,
                         tenant=request.tenant, error=err.message)
        except Exception as err:  # noqa: BLE001 - a background task: logged and counted
            log.warning("history_compaction_failed", model=self.model, error=repr(err))
        finally:
            running.dec()
            self._metrics.compactions.labels(self.model, outcome).inc()

    async def _tenant_room(self, summarize: GenerationRequest) -> AdmissionRefused | None:
        """None once the tenant may start ``summarize``, waiting out its
        refusals' retry hints while the wait stays within
        :data:`~.settings.DEFER_WAIT_S` (a turn of a ``max_concurrent: 1``
        tenant holds its only slot while its compaction starts); else the
        refusal. Holds nothing while it waits."""
        waited = 0.0
        while (refused := self._runner.refusal(summarize)) is not None:
            wait = max(refused.retry_after_s, _MIN_RECHECK_S)
            if waited + wait > DEFER_WAIT_S:
                return refused
            await asyncio.sleep(wait)
            waited += wait
        return None

    async def _summary(self, request: GenerationRequest, conversation: Conversation,
                       summarize: GenerationRequest, previous: Summary | None, start: int,
                       end: int) -> Summary:
        """Writes the summary of ``previous`` and ``turns[start:end]`` (``summarize``,
        run as the tenant) and counts its tokens.

        Raises:
          ValueError: the summariser wrote nothing.
          GenerationError, InvalidRequestError, UpstreamError: as the pipeline does.
        """
        text = await generate_text(self._runner.generate, summarize)
        if not text:
            raise ValueError("the summariser wrote no text")
        with_turns = await self._render(request, conversation.system
                                        + conversation.turns[start:], 0, None)
        without = await self._render(request, conversation.system
                                     + conversation.turns[end:], 0, None)
        ids = await self._tokenizer.tokenize(text, add_special_tokens=False,
                                             request_id=request.request_id, deadline=None)
        earlier = previous.summarized_tokens if previous else 0
        return Summary(text, end, earlier + len(with_turns.token_ids) - len(without.token_ids),
                       len(ids), self.summarizer)
