"""One async streaming client per target (``--backend``).

- ``llmesh``: ``llmesh.v1.GenerationService/Generate`` over one long-lived
  ``grpc.aio`` channel (through Envoy or straight to the router), with
  ``bypass_cache`` so the response cache never answers, and ``ignore_eos``
  so every request generates the tokens asked for. Output tokens are the
  token ids streamed back.
- ``openai``: ``POST /v1/completions`` with ``stream: true``.
- ``openai-chat``: ``POST /v1/chat/completions`` with ``stream: true``.

The OpenAI clients read the server-sent events line by line, ask for usage
(``stream_options: {"include_usage": true}``) and send ``ignore_eos`` as
vLLM, SGLang and llama.cpp accept it. Output tokens are the usage's
``completion_tokens`` when the server reports it, else the bench tokenizer's
count of the streamed text. ``$OPENAI_API_KEY``, when set, is sent as a bearer
token.

Timing, the same for every client (as ``vllm bench serve``): a chunk counts
when it carries output (text or token ids); TTFT is the time to the first such
chunk, ITL every gap between such chunks, e2e the time to the stream's end.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from services.bench.datasets import BenchRequest
from services.bench.records import RequestOutput
from services.bench.tokenizer import BenchTokenizer

BACKENDS = ("llmesh", "openai", "openai-chat")
DEFAULT_ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


@dataclass(frozen=True, slots=True)
class BackendConfig:
    """How to reach the target and what to ask of it.

    Attributes:
      base_url: ``host:port`` (llmesh; ``grpc://`` / ``http://`` prefixes are
        dropped) or ``http://host:port`` (OpenAI).
      endpoint: path for OpenAI backends (``/v1/completions`` ...).
      model: model id; empty: the target's first listed model.
      temperature, top_p, top_k: sampling; ``None`` leaves the server default
        (temperature defaults to 0, greedy, as in ``vllm bench serve``).
      ignore_eos: generate exactly ``output_len`` tokens.
      timeout_s: per-request deadline.
      request_id_prefix: request ids are this plus a counter.
      extra_body: merged into every OpenAI request body.
    """

    base_url: str
    endpoint: str = ""
    model: str = ""
    temperature: float | None = 0.0
    top_p: float | None = None
    top_k: int | None = None
    ignore_eos: bool = True
    timeout_s: float = 6 * 3600.0
    request_id_prefix: str = "bench-"
    extra_body: Mapping[str, Any] = field(default_factory=dict)


class Backend(Protocol):
    """A target the benchmark can send requests to."""

    model_id: str

    async def start(self) -> None:
        """Opens the connection and resolves ``model_id`` (raises if unreachable)."""

    async def send(self, request: BenchRequest) -> RequestOutput:
        """Sends one request, streams it to the end; never raises for a failed request."""

    async def close(self) -> None:
        """Closes the connection."""


def make_backend(name: str, config: BackendConfig, tokenizer: BenchTokenizer) -> Backend:
    """The client for ``--backend NAME``."""
    if name == "llmesh":
        return LlmeshBackend(config)
    if name in ("openai", "openai-chat"):
        return OpenAIBackend(config, tokenizer, chat=name == "openai-chat")
    raise ValueError(f"--backend: unknown {name!r}; choose from {', '.join(BACKENDS)}")


def grpc_target(url: str) -> str:
    """``host:port`` from ``host:port``, ``grpc://host:port`` or ``http://host:port/``."""
    for scheme in ("http://", "grpc://"):
        url = url.removeprefix(scheme)
    return url.rstrip("/")


class StreamErrorEvent(Exception):
    """An ``{"error": ...}`` event inside a 200 stream (recorded as ``STREAM_ERROR``)."""


class _Ids:
    def __init__(self, prefix: str) -> None:
        self._prefix = f"{prefix}{uuid.uuid4().hex[:8]}-"
        self._next = 0

    def __call__(self) -> str:
        self._next += 1
        return f"{self._prefix}{self._next}"


class _Timer:
    """Collects TTFT, ITL and e2e for one request as chunks arrive."""

    def __init__(self, output: RequestOutput) -> None:
        self._out = output
        self._start = output.start_time = time.perf_counter()
        self._last: float | None = None

    def chunk(self) -> None:
        """A chunk with output arrived now."""
        now = time.perf_counter()
        if self._last is None:
            self._out.ttft = now - self._start
        else:
            self._out.itl.append(now - self._last)
        self._last = now

    def end(self) -> None:
        self._out.latency = time.perf_counter() - self._start


class LlmeshBackend:
    """``GenerationService/Generate`` over one ``grpc.aio`` channel."""

    def __init__(self, config: BackendConfig) -> None:
        self._config = config
        self._target = grpc_target(config.base_url)
        self._ids = _Ids(config.request_id_prefix)
        self._channel: Any = None
        self._stub: Any = None
        self.model_id = config.model

    async def start(self) -> None:
        import grpc

        from llmesh.v1 import generation_pb2, generation_pb2_grpc

        self._channel = grpc.aio.insecure_channel(self._target, options=[
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.http2.max_pings_without_data", 0),
        ])
        self._stub = generation_pb2_grpc.GenerationServiceStub(self._channel)
        reply = await self._stub.ListModels(generation_pb2.ListModelsRequest(), timeout=30.0)
        served = [card.id for card in reply.models]
        if not self.model_id:
            if not served:
                raise RuntimeError(f"{self._target}: ListModels returned no model")
            self.model_id = served[0]

    def _request(self, request: BenchRequest) -> Any:
        from llmesh.v1 import common_pb2, generation_pb2

        config = self._config
        sampling = common_pb2.SamplingParams(max_tokens=request.output_len,
                                             ignore_eos=config.ignore_eos)
        if config.temperature is not None:
            sampling.temperature = config.temperature
        if config.top_p is not None:
            sampling.top_p = config.top_p
        if config.top_k is not None:
            sampling.top_k = config.top_k
        message = generation_pb2.GenerateRequest(
            request_id=self._ids(), model=self.model_id, sampling=sampling, bypass_cache=True)
        if request.messages is not None:
            message.chat.messages.extend(
                common_pb2.ChatMessage(role=m.role, content=m.content) for m in request.messages)
        else:
            assert request.prompt is not None
            message.prompt = request.prompt
        return message

    async def send(self, request: BenchRequest) -> RequestOutput:
        import grpc

        from llmesh.v1 import common_pb2

        out = RequestOutput(prompt_len=request.prompt_len)
        message = self._request(request)
        timer = _Timer(out)
        call = self._stub.Generate(message, timeout=self._config.timeout_s)
        text: list[str] = []
        try:
            async for response in call:
                if response.token_ids or response.text:
                    timer.chunk()
                out.output_tokens += len(response.token_ids)
                text.append(response.text)
                if response.finish_reason:
                    out.finish_reason = common_pb2.FinishReason.Name(
                        response.finish_reason).removeprefix("FINISH_REASON_").lower()
                    out.server_prompt_tokens = response.usage.prompt_tokens
                    out.server_completion_tokens = response.usage.completion_tokens
            timer.end()
            out.success = out.finish_reason not in ("error", "cancelled")
            if not out.success:
                out.error = f"FINISH_{out.finish_reason.upper() or 'MISSING'}"
        except grpc.aio.AioRpcError as error:
            timer.end()
            out.error, out.error_detail = error.code().name, error.details() or ""
        finally:
            call.cancel()  # no-op once finished; frees the stream if we were cancelled
        out.generated_text = "".join(text)
        return out

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()


class OpenAIBackend:
    """Streaming ``/v1/completions`` or ``/v1/chat/completions`` over aiohttp."""

    def __init__(self, config: BackendConfig, tokenizer: BenchTokenizer, *, chat: bool) -> None:
        self._config = config
        self._tokenizer = tokenizer
        self._chat = chat
        base = config.base_url if "://" in config.base_url else f"http://{config.base_url}"
        self._base = base.rstrip("/")
        self._url = self._base + (config.endpoint or
                                  DEFAULT_ENDPOINTS["openai-chat" if chat else "openai"])
        self._ids = _Ids(config.request_id_prefix)
        self._session: Any = None
        self.model_id = config.model
        self._headers = {"Content-Type": "application/json"}
        if os.environ.get("OPENAI_API_KEY"):
            self._headers["Authorization"] = f"Bearer {os.environ['OPENAI_API_KEY']}"

    async def start(self) -> None:
        import aiohttp

        self._session = aiohttp.ClientSession(
            # A new loopback connection per request (~0.1 ms): reusing pooled
            # keep-alive connections raced with llama-server closing idle ones
            # (ClientOSError / ServerDisconnectedError on 4-15 % of requests at
            # 8-32 streams).
            connector=aiohttp.TCPConnector(limit=0, force_close=True),
            timeout=aiohttp.ClientTimeout(total=self._config.timeout_s),
            headers=self._headers,
        )
        if not self.model_id:
            async with self._session.get(self._base + "/v1/models") as response:
                response.raise_for_status()
                models = (await response.json()).get("data") or []
            if not models:
                raise RuntimeError(f"{self._base}/v1/models lists no model; pass --model")
            self.model_id = str(models[0]["id"])

    def _body(self, request: BenchRequest) -> dict[str, Any]:
        config = self._config
        body: dict[str, Any] = {
            "model": self.model_id,
            "max_tokens": request.output_len,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self._chat:
            messages = request.messages or ()
            body["messages"] = ([{"role": m.role, "content": m.content} for m in messages]
                                if request.messages is not None
                                else [{"role": "user", "content": request.prompt}])
            body["max_completion_tokens"] = request.output_len
        else:
            body["prompt"] = (request.prompt if request.prompt is not None
                              else self._tokenizer.render_chat(request.messages or ()))
        if config.temperature is not None:
            body["temperature"] = config.temperature
        if config.top_p is not None:
            body["top_p"] = config.top_p
        if config.top_k is not None:
            body["top_k"] = config.top_k
        if config.ignore_eos:
            body["ignore_eos"] = True
        body.update(config.extra_body)
        return body

    def _chunk_text(self, choice: Mapping[str, Any]) -> str:
        if not self._chat:
            return str(choice.get("text") or "")
        delta = choice.get("delta") or {}
        return "".join(str(delta.get(key) or "")
                       for key in ("reasoning_content", "reasoning", "content"))

    async def send(self, request: BenchRequest) -> RequestOutput:
        import aiohttp

        out = RequestOutput(prompt_len=request.prompt_len)
        body = self._body(request)
        headers = {"X-Request-Id": self._ids()}
        timer = _Timer(out)
        text: list[str] = []
        try:
            async with self._session.post(self._url, json=body, headers=headers) as response:
                if response.status != 200:
                    timer.end()
                    out.error = f"HTTP {response.status}"
                    out.error_detail = (await response.text())[:500]
                    return out
                async for raw in response.content:
                    line = raw.decode("utf-8").strip()
                    if not line.startswith("data:"):
                        continue  # blank separators, ": keep-alive" comments, event: lines
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    self._on_event(json.loads(data), timer, text, out)
            timer.end()
            out.success = True
        except StreamErrorEvent as error:
            timer.end()
            out.error, out.error_detail = "STREAM_ERROR", str(error)[:500]
        except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as error:
            timer.end()
            out.error = "TIMEOUT" if isinstance(error, asyncio.TimeoutError) \
                else type(error).__name__
            out.error_detail = str(error)[:500]
        out.generated_text = "".join(text)
        if out.success:
            out.output_tokens = (out.server_completion_tokens
                                 if out.server_completion_tokens is not None
                                 else len(self._tokenizer.encode(out.generated_text)))
        return out

    def _on_event(self, event: Mapping[str, Any], timer: _Timer, text: list[str],
                  out: RequestOutput) -> None:
        if "error" in event:
            error = event["error"]
            raise StreamErrorEvent(error.get("message", error) if isinstance(error, Mapping)
                                   else error)
        choices = event.get("choices") or []
        if choices:
            piece = self._chunk_text(choices[0])
            if piece:
                timer.chunk()
                text.append(piece)
            if choices[0].get("finish_reason"):
                out.finish_reason = str(choices[0]["finish_reason"])
        usage = event.get("usage")
        if usage:
            out.server_prompt_tokens = usage.get("prompt_tokens")
            out.server_completion_tokens = usage.get("completion_tokens")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
