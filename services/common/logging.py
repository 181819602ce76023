"""structlog JSON logging shared by every service.

Each log line is one JSON object on stderr with ``service``, ``level``,
``timestamp`` and, inside a request, ``request_id`` (bound with
:func:`bind_request_id`, carried in a contextvar so concurrent requests on one
event loop never mix their ids).
"""

from __future__ import annotations

import logging
import sys

import structlog

REQUEST_ID_METADATA_KEY = "x-request-id"


def configure_logging(service: str, level: str = "info") -> structlog.stdlib.BoundLogger:
    """Configures structlog for this process and returns the service's logger.

    Args:
      service: name written as ``service`` on every line (e.g. ``"engine"``).
      level: minimum level name (``debug``, ``info``, ``warning``, ``error``).
    """
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)
    return structlog.get_logger()


def bind_request_id(request_id: str) -> None:
    """Binds ``request_id`` to every log line of the current asyncio task."""
    structlog.contextvars.bind_contextvars(request_id=request_id)
