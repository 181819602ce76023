"""A minimal OpenAI-compatible HTTP server for the bench tests (no model).

It streams server-sent events with known timing and token counts, so the
tests can check that ``llmesh bench`` measures what happened:

- ``POST /v1/completions`` and ``POST /v1/chat/completions`` with
  ``stream: true``: waits ``first_delay_s``, then sends one chunk per token,
  ``gap_s`` apart; every chunk's text is ``" hello"`` (one token for
  SmolLM2). Tokens: ``max_tokens`` with ``ignore_eos``, else
  ``min(max_tokens, eos_after)``. The chat endpoint first sends the usual
  role-only delta at once (no content: must not count as the first token).
  With ``stream_options.include_usage`` and ``report_usage`` set, a last
  chunk carries ``usage``.
- ``GET /v1/models`` lists ``model``.
- Every ``fail_every``-th generation request gets HTTP 503.

Runs on its own event loop in a thread, on a free loopback port.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

TOKEN_TEXT = " hello"


class StubOpenAIServer:
    """The stub; ``start()`` returns its base URL, ``stop()`` ends it."""

    def __init__(self, *, first_delay_s: float = 0.05, gap_s: float = 0.01,
                 model: str = "stub-model", eos_after: int = 5,
                 count_prompt_tokens: Callable[[str], int] | None = None) -> None:
        self.first_delay_s = first_delay_s
        self.gap_s = gap_s
        self.model = model
        self.eos_after = eos_after
        self.count_prompt_tokens = count_prompt_tokens
        self.report_usage = True
        self.fail_every: int | None = None
        self.bodies: list[dict[str, Any]] = []
        self._count = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    # -- lifecycle ------------------------------------------------------------

    def start(self) -> str:
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()

        def serve() -> None:
            assert self._loop is not None
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._start_site())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, name="openai-stub", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the OpenAI stub did not start")
        return self.url

    async def _start_site(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        if self._loop is None:
            return
        assert self._runner is not None
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        assert self._thread is not None
        self._thread.join(10)
        self._loop.close()
        self._loop = None

    # -- handlers -------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "owned_by": "stub"}]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._stream(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._stream(request, chat=True)

    def _tokens(self, body: dict[str, Any]) -> int:
        wanted = int(body.get("max_completion_tokens") or body["max_tokens"])
        return wanted if body.get("ignore_eos") else min(wanted, self.eos_after)

    async def _stream(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self._count += 1
        if self.fail_every and self._count % self.fail_every == 0:
            return web.json_response({"error": {"message": "stub overloaded"}}, status=503)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        created, rid = int(time.time()), f"cmpl-{self._count}"

        async def send(choices: list[dict[str, Any]], **extra: Any) -> None:
            event = {"id": rid, "object": "chat.completion.chunk" if chat else
                     "text_completion", "created": created, "model": self.model,
                     "choices": choices, **extra}
            await response.write(f"data: {json.dumps(event)}\n\n".encode())

        if chat:  # role-only first delta, at once: carries no output
            await send([{"index": 0, "delta": {"role": "assistant", "content": ""},
                         "finish_reason": None}])
        n = self._tokens(body)
        await asyncio.sleep(self.first_delay_s)
        for i in range(n):
            if i:
                await asyncio.sleep(self.gap_s)
            finish = ("length" if body.get("ignore_eos") or n == int(body["max_tokens"])
                      else "stop") if i == n - 1 else None
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
            if chat:
                choice["delta"] = {"content": TOKEN_TEXT}
            else:
                choice["text"] = TOKEN_TEXT
            await send([choice])
        include = (body.get("stream_options") or {}).get("include_usage")
        if include and self.report_usage:
            prompt = body.get("prompt") if not chat else ""
            prompt_tokens = (self.count_prompt_tokens(prompt)
                             if self.count_prompt_tokens and prompt else 0)
            await send([], usage={"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                  "total_tokens": prompt_tokens + n})
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
