"""Helpers of the tokenizer tests (fixtures are in conftest.py)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
from llmesh.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from prometheus_client import CollectorRegistry

from services.common.grpc_util import SERVER_OPTIONS
from services.tokenizer.metrics import TokenizerMetrics
from services.tokenizer.service import TokenizerService
from services.tokenizer.tokenizer import Tokenizer

_T = TypeVar("_T")

#: Hard cases for incremental detokenization: multi-codepoint emoji (ZWJ
#: families, skin tones, flags, a variation selector), CJK, combining marks,
#: right-to-left scripts, characters outside the BMP that SentencePiece
#: encodes as byte-fallback tokens, and runs of unusual spaces.
HARD_FRAGMENTS = (
    "👨‍👩‍👧‍👦", "🏳️‍🌈", "👩🏽‍💻", "🇯🇵", "🇺🇸🇫🇷", "❤️", "😀",
    "日本語のテキスト", "中文", "한국어", "漢字",
    "e\u0301", "n\u0303", "a\u0308\u0323", "Zalgo\u0336\u0337",
    "مرحبا بالعالم", "שלום", "Ελληνικά", "हिन्दी", "ไทย",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "𐍈", "𓀀",
    " ", "  ", "   ", "\t", "\n", "\r\n", "\u00a0", "\u3000", "\u200b",
    "hello", "world", "Hello,", "x", ".", "1234", "<not special>",
)

#: A sample that holds one of each kind above.
HARD_TEXT = "Hi 👨‍👩‍👧‍👦 🏳️‍🌈 🇯🇵🇫🇷 日本語 e\u0301 مرحبا   𝔘𐍈\t한국어\u00a0ไทย!"

#: A ChatML template with a tool section in Qwen2.5's shape (SmolLM2 served
#: with it exercises the ``template`` tool format).
TOOLS_TEMPLATE = Path(__file__).resolve().parents[1] / "fixtures" / "chatml_tools.jinja"


class ServerThread:
    """A TokenizerService on a loopback port chosen by the OS, served by its own
    event loop in a background thread, so that synchronous tests (hypothesis)
    and asyncio tests can both call it."""

    def __init__(self, service: TokenizerService, start_service: bool = True,
                 port: int = 0) -> None:
        self.service = service
        self._start_service = start_service
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self.port = port
        self._thread = threading.Thread(target=self._run, name="tokenizer-server", daemon=True)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> ServerThread:
        self._thread.start()
        if not self._ready.wait(120):
            raise TimeoutError("tokenizer test server did not start")
        if self._error is not None:
            raise self._error
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        server = grpc.aio.server(options=SERVER_OPTIONS)
        self.service.register(server)
        self.port = server.add_insecure_port(f"127.0.0.1:{self.port}")
        try:
            await server.start()
            if self._start_service:
                await self.service.start()
        except BaseException as err:  # surfaced by start()
            self._error = err
        self._ready.set()
        await self._stop.wait()
        await server.stop(grace=1.0)
        await self.service.close()

    def call(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Runs ``coro`` on the server's loop (e.g. ``service.drain()``)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)

    def stop(self) -> None:
        assert self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


class Client:
    """A synchronous stub on one long-lived channel to a ServerThread."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target)
        self.stub = tokenizer_pb2_grpc.TokenizerServiceStub(self.channel)

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        reply = self.stub.Tokenize(
            tokenizer_pb2.TokenizeRequest(text=text, add_special_tokens=add_special_tokens),
            timeout=30)
        return list(reply.token_ids)

    def chat(self, messages: Sequence[tuple[str, str]], add_generation_prompt: bool = True,
             max_prompt_tokens: int = 0, allow_special_tokens: bool = False,
             ) -> tokenizer_pb2.ApplyChatTemplateResponse:
        return self.stub.ApplyChatTemplate(tokenizer_pb2.ApplyChatTemplateRequest(
            messages=[common_pb2.ChatMessage(role=r, content=c) for r, c in messages],
            add_generation_prompt=add_generation_prompt, max_prompt_tokens=max_prompt_tokens,
            allow_special_tokens=allow_special_tokens,
        ), timeout=30)

    def detokenize(self, chunks: Iterable[Sequence[int]], skip_special_tokens: bool = False,
                   flush: bool = True) -> list[str]:
        """Sends each chunk as one message (the last with ``flush``); returns every delta."""
        chunks = list(chunks)
        requests = [
            tokenizer_pb2.DetokenizeRequest(
                token_ids=list(chunk), skip_special_tokens=skip_special_tokens,
                flush=flush and i == len(chunks) - 1)
            for i, chunk in enumerate(chunks)
        ]
        return [r.text for r in self.stub.Detokenize(iter(requests), timeout=30)]

    def close(self) -> None:
        self.channel.close()


def start_server(tokenizer: Tokenizer, start_service: bool = True, port: int = 0,
                 **kwargs: Any) -> tuple[ServerThread, TokenizerMetrics]:
    """A started ServerThread around ``tokenizer`` with metrics in a fresh
    registry, on ``port`` (0: one the OS picks)."""
    metrics = TokenizerMetrics.create(CollectorRegistry())
    service = TokenizerService(tokenizer=tokenizer, metrics=metrics, **kwargs)
    return ServerThread(service, start_service, port).start(), metrics


def sample(metrics: TokenizerMetrics, name: str, **labels: str) -> float:
    """Current value of sample ``name`` in ``metrics``' registry (0 when absent)."""
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def split(ids: Sequence[int], cuts: Iterable[int]) -> list[list[int]]:
    """``ids`` cut at the given positions (sorted, deduplicated, 0 < cut < len)."""
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(ids)}), len(ids)]
    return [list(ids[a:b]) for a, b in zip(bounds, bounds[1:])]
