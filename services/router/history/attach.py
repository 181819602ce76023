"""Gives each model pool with a history budget its :class:`HistoryCompactor`."""

from __future__ import annotations

from collections.abc import Mapping

import structlog

from services.router.clients import CacheClient
from services.router.history.compactor import HistoryCompactor
from services.router.history.metrics import HistoryMetrics
from services.router.history.settings import HistorySettings
from services.router.history.store import SummaryStore
from services.router.history.summarizer import SummaryRunner
from services.router.model_pool import ModelPool

log = structlog.get_logger()


def attach_history(pools: Mapping[str, ModelPool], settings: HistorySettings,
                   cache: CacheClient | None, metrics: HistoryMetrics,
                   runner: SummaryRunner) -> None:
    """Sets ``pipeline.history`` of every pool whose model has a budget and no
    compactor yet. Without a cache service there is nowhere to keep summaries:
    chats are then trimmed to the context window, as without a budget (warned).

    Args:
      runner: runs a summary request through the pipeline of the model it
        names (the summariser's) as the chat's tenant.
    """
    wanted = [pool for model, pool in pools.items()
              if settings.budget(model) and pool.pipeline.history is None]
    if not wanted:
        return
    if cache is None:
        log.warning("history_off", why="--history-budget-tokens needs the cache service "
                    "(--cache) to keep summaries", models=[p.model for p in wanted])
        return
    store = SummaryStore(cache.stub, timeout=cache.timeout)
    for pool in wanted:
        summarizer = settings.summarizer(pool.model)
        if summarizer not in pools:
            log.warning("history_summarizer_not_served", model=pool.model,
                        summarizer=summarizer, effect="compactions fail until it is served")
        pool.pipeline.history = HistoryCompactor(
            model=pool.model, budget=settings.budget(pool.model), settings=settings,
            tokenizer=pool.pipeline.tokenizer, store=store, runner=runner,
            metrics=metrics)
        log.info("history_compaction", model=pool.model, budget_tokens=settings.budget(pool.model),
                 summarizer=summarizer, summary_max_tokens=settings.summary_max_tokens)
