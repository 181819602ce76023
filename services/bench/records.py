"""What one benchmark request produced: the record every figure is computed from."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestOutput:
    """The outcome and timings of one request (times in seconds).

    Attributes:
      success: the stream ended normally.
      error: the status of a failure: a gRPC status name (``UNAVAILABLE``),
        ``HTTP 503``, ``TIMEOUT`` or an exception class name; empty on success.
      error_detail: the server's or the exception's message.
      prompt_len: prompt tokens by the bench tokenizer.
      output_tokens: completion tokens received: token ids counted (llmesh),
        the server's usage, else the bench tokenizer's count of the text.
      ttft: time from sending to the first chunk with output.
      itl: every gap between consecutive chunks with output.
      latency: end-to-end time, sending to the end of the stream.
      start_time: ``time.perf_counter()`` when sent.
      generated_text: the streamed text, concatenated.
      server_prompt_tokens: prompt tokens the server reported (usage), if any.
      server_completion_tokens: completion tokens the server reported, if any.
      finish_reason: the server's finish reason, lower case, if any.
      tag: the dataset tag of the request (``random/3`` ...).
      turn: the conversation turn it asked for (0-based), ``None`` outside
        conversations.
    """

    success: bool = False
    error: str = ""
    error_detail: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    generated_text: str = ""
    server_prompt_tokens: int | None = None
    server_completion_tokens: int | None = None
    finish_reason: str = ""
    tag: str = ""
    turn: int | None = None
