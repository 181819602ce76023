"""structlog JSON logging shared by every service.

Each log line is one JSON object on stderr with ``service``, ``level``,
``timestamp``, ``event`` and, inside a request, ``request_id`` (bound with
:func:`bind_request_id`, carried in a contextvar so concurrent requests on one
event loop never mix their ids). Lines from the standard library's ``logging``
(grpc, asyncio, transformers, redis...) and Python warnings go through the
same JSON renderer, at WARNING and above, with their ``logger`` name, and so
do uncaught exceptions (main thread and other threads, e.g. an engine's
worker): a service's log file is JSON from end to end (only gRPC's C core,
which writes to stderr itself at ``GRPC_VERBOSITY``, bypasses it).

The request id travels between services as ``x-request-id`` gRPC metadata
(:data:`REQUEST_ID_METADATA_KEY`; see :mod:`services.common.grpc_util`).

Privacy: no service logs prompt or output text unless asked to (the router's
``--log-content``); log token counts, never tokens.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from collections.abc import MutableMapping
from typing import Any

import structlog

from services.common.cli_args import EnvText, env_refusal

REQUEST_ID_METADATA_KEY = "x-request-id"

#: Standard-library loggers (third-party libraries) are shown from this level up.
FOREIGN_LOG_LEVEL = logging.WARNING


class _AddService:
    """Adds ``service`` to every line, also on threads (contextvars do not
    follow ``run_in_executor`` or a plain ``threading.Thread``)."""

    def __init__(self, service: str) -> None:
        self.service = service

    def __call__(self, _logger: object, _name: str,
                 event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        event_dict.setdefault("service", self.service)
        return event_dict


#: The level names ``configure_logging`` (and every service's ``--log-level``) takes.
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
#: The environment variable every service's ``--log-level`` defaults to.
LOG_LEVEL_ENV = "LLMESH_LOG_LEVEL"


def log_level(text: str) -> str:
    """``--log-level``'s argparse type: the name in lower case. A
    :data:`LOG_LEVEL_ENV` default outside :data:`LOG_LEVELS` is refused here,
    naming the variable and its value (argparse checks no default against
    the choices: ``FOO`` was a KeyError traceback at start); a flag's value
    is refused by the choices.

    Raises:
      argparse.ArgumentTypeError: an :class:`~services.common.cli_args.EnvText`
        that names no level.
    """
    level = text.lower()
    if isinstance(text, EnvText) and level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            env_refusal(text.variable, str(text), f"choose one of {', '.join(LOG_LEVELS)}"))
    return level


def configure_logging(service: str, level: str = "info") -> structlog.stdlib.BoundLogger:
    """Configures structlog (and the standard library's root logger) for this
    process and returns the service's logger.

    Args:
      service: name written as ``service`` on every line (e.g. ``"engine"``).
      level: minimum level name (``debug``, ``info``, ``warning``, ``error``)
        of llmesh's own lines; other libraries log from WARNING up (or from
        ``level`` when it is higher).

    Raises:
      KeyError: ``level`` is not a level name.
    """
    level_no = logging.getLevelNamesMapping()[level.upper()]
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        _AddService(service),
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[
            *shared,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level_no),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    _route_stdlib_logging(shared, max(level_no, FOREIGN_LOG_LEVEL))
    _log_uncaught_exceptions()
    structlog.contextvars.bind_contextvars(service=service)
    return structlog.get_logger()


def _log_uncaught_exceptions() -> None:
    """Uncaught exceptions become ``uncaught_exception`` JSON lines (level
    critical) instead of bare tracebacks on stderr."""
    log = structlog.get_logger()

    def on_thread_exception(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit:
            return
        log.critical("uncaught_exception", thread=getattr(args.thread, "name", None),
                     exc_info=(args.exc_type, args.exc_value, args.exc_traceback))

    def on_exception(exc_type: type[BaseException], value: BaseException,
                     traceback: Any) -> None:
        if issubclass(exc_type, KeyboardInterrupt):
            sys.__excepthook__(exc_type, value, traceback)
            return
        log.critical("uncaught_exception", thread="MainThread",
                     exc_info=(exc_type, value, traceback))

    threading.excepthook = on_thread_exception
    sys.excepthook = on_exception


def _route_stdlib_logging(shared: list[Any], level: int) -> None:
    """Renders the standard library's log records as the same JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
    ))
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, "_llmesh", False):
            root.removeHandler(old)
    handler._llmesh = True  # type: ignore[attr-defined]  # replaced on reconfiguration
    root.addHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(True)


def bind_request_id(request_id: str) -> None:
    """Binds ``request_id`` to every log line of the current asyncio task (and of
    the tasks it creates afterwards)."""
    structlog.contextvars.bind_contextvars(request_id=request_id)
