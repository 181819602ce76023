"""The gRPC status of each tokenizer error: one table for the tokenizer
service's answers and the router's in-process tokenization
(:mod:`services.router.local_tokenizer`), so both refuse an input alike."""

from __future__ import annotations

import grpc

from services.tokenizer.tokenizer import (
    ChatTemplateError,
    InvalidTokenIdError,
    NoChatTemplateError,
    PromptTooLongError,
)

# Most specific first: all of these are ValueErrors.
ERROR_STATUS: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (NoChatTemplateError, grpc.StatusCode.FAILED_PRECONDITION),
    (PromptTooLongError, grpc.StatusCode.OUT_OF_RANGE),
    (ChatTemplateError, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidTokenIdError, grpc.StatusCode.INVALID_ARGUMENT),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
)


def status_of_error(err: Exception) -> grpc.StatusCode:
    """The status for ``err`` raised by :class:`~services.tokenizer.tokenizer.Tokenizer`
    (:data:`ERROR_STATUS`); INTERNAL for any other exception (a bug)."""
    for kind, code in ERROR_STATUS:
        if isinstance(err, kind):
            return code
    return grpc.StatusCode.INTERNAL
