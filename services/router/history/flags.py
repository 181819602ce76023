"""The router's history flags (``python -m services.router`` and ``llmesh up``)."""

from __future__ import annotations

import argparse

from services.router.history.settings import (
    DEFAULT_SUMMARY_MAX_TOKENS,
    HistorySettings,
    parse_budget,
)


def _budget(text: str) -> tuple[str, int]:
    try:
        return parse_budget(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_history_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the ``history`` flag group."""
    group = parser.add_argument_group(
        "history", "chat history that is summarised, not just dropped (README, "
        "\"Summarised history\"; services/router/history/)")
    group.add_argument("--history-budget-tokens", action="append", default=[], type=_budget,
                       metavar="[MODEL=]N",
                       help="prompt-token budget of a chat: past it the oldest turns are "
                            "dropped for that turn and summarised in the background (stored "
                            "in the cache service); the next turns start with the summary. "
                            "Without MODEL= every model's; repeatable. Default: off")
    group.add_argument("--history-summarizer-model", default="", metavar="MODEL",
                       help="the served model that writes summaries (default: the "
                            "cascade's small model with --cascade, else the chat's own model)")
    group.add_argument("--history-summary-max-tokens", type=int,
                       default=DEFAULT_SUMMARY_MAX_TOKENS, metavar="N",
                       help=f"most tokens of one summary (default {DEFAULT_SUMMARY_MAX_TOKENS})")


def history_settings(args: argparse.Namespace, *, cascade_small: str = "") -> HistorySettings:
    """The settings the flags ask for; the summariser is
    ``--history-summarizer-model``, else the cascade's small model
    (``cascade_small``, "" without ``--cascade``), else each chat's own model.

    Raises:
      ValueError: a budget not above ``--history-summary-max-tokens``.
    """
    return HistorySettings(budgets=dict(args.history_budget_tokens),
                           summarizer_model=args.history_summarizer_model or cascade_small,
                           summary_max_tokens=args.history_summary_max_tokens)


def problem(args: argparse.Namespace, models: list[str]) -> str | None:
    """What is wrong with ``llmesh up``'s history flags given its ``--model``
    names (checked before any service starts; with no ``--model`` the default
    model's name is not known here, so model names are not checked), or None.
    QA: a bad summary size failed only once the engines had started, and a
    budget or summariser naming no served model started silently."""
    try:
        settings = history_settings(args)
    except ValueError as err:
        return str(err)
    if not models:
        return None
    named = [m for m in settings.budgets if m] + (
        [settings.summarizer_model] if settings.summarizer_model else [])
    missing = [m for m in named if m not in models]
    if missing:
        return (f"--history-budget-tokens/--history-summarizer-model name {missing}, which no "
                f"--model NAME=PATH serves (served: {models})")
    return None


def router_flags(args: argparse.Namespace) -> list[str]:
    """The router flags for the history flags ``llmesh up`` was given."""
    flags = [f"--history-budget-tokens={model + '=' if model else ''}{tokens}"
             for model, tokens in args.history_budget_tokens]
    if args.history_summarizer_model:
        flags.append(f"--history-summarizer-model={args.history_summarizer_model}")
    if args.history_summary_max_tokens != DEFAULT_SUMMARY_MAX_TOKENS:
        flags.append(f"--history-summary-max-tokens={args.history_summary_max_tokens}")
    return flags
