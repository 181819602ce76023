"""A stand-in llmesh service for the launcher and Envoy tests.

Runs on the real server kit (:func:`services.common.server.run_service`), so it
binds, writes its port file, serves health and reflection and drains on
SIGTERM exactly like a real service. With ``--role router`` it also serves
``llmesh.v1.GenerationService`` from the real proto:

* ``Generate`` streams the input's words back, one delta per word, with
  ``--delay`` seconds before each; the last message carries
  ``finish_reason`` (STOP, or LENGTH when ``sampling.max_tokens`` cut it) and
  ``usage``. ``request_id`` is the id the call arrived with (Envoy's
  ``x-request-id`` when it came through Envoy). A prompt starting with
  ``sleep:S`` waits S seconds between words instead. The prompt ``fail`` ends
  the call with INVALID_ARGUMENT. A prompt starting with ``cacheable:`` is
  remembered: asked again without ``bypass_cache``, it is replayed at once
  with ``cached: true`` on the final message (the router's response cache).
* ``GenerateJson`` (``POST /v1/generate`` through Envoy) parses the body with
  the router's own strict parser (``services.router.json_request``), then
  answers like ``Generate``; a refused body ends with its INVALID_ARGUMENT.
* ``ListModels`` returns one model, ``fake-model``.
* With ``--role retriever``, ``llmesh.v1.RetrieverService.ListCollections``
  lists one collection, ``fake-collection`` (the other methods: UNIMPLEMENTED).
* With ``--openai-port`` (the launcher passes ``0``), a stand-in of the
  router's OpenAI HTTP server on that port (aiohttp, port file key
  ``openai_port``): ``GET /v1/models`` lists ``fake-model``;
  ``POST /v1/chat/completions`` streams the last message's words back as
  Server-Sent Events chat chunks, then ``data: [DONE]``.

Every other flag it is given (``--tokenizer``, ``--engine``, ``--model-path``,
...) is accepted and written, with the whole argv, to ``<port-file>.argv.json``
so a test can check what the launcher passed. ``--load-seconds`` delays
SERVING (a model load); ``--fail-start`` makes the start fail (exit non-zero).

Run as a script: ``python tests/cli/fake_service.py --role router --port 0 ...``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import grpc

from llmesh.v1 import (
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    retriever_pb2,
    retriever_pb2_grpc,
)
from services.common.grpc_util import request_id_from
from services.common.sampling import InvalidRequestError
from services.common.server import add_server_arguments, run_service, server_config_from_args
from services.router.json_request import parse_generate_json

_SERVICE_NAMES = {
    "router": ("llmesh.v1.GenerationService",),
    "tokenizer": ("llmesh.v1.TokenizerService",),
    "cache": ("llmesh.v1.CacheService",),
    "retriever": ("llmesh.v1.RetrieverService",),
    "engine": ("llmesh.v1.EngineService",),
}


class FakeGeneration(generation_pb2_grpc.GenerationServiceServicer):
    """The test double of the router's public API."""

    def __init__(self, delay: float) -> None:
        self._delay = delay
        self._answered: set[str] = set()

    async def Generate(self, request, context):  # noqa: N802 (gRPC name)
        if request.WhichOneof("input") == "chat":
            text = " ".join(m.content for m in request.chat.messages)
        else:
            text = request.prompt
        if text == "fail":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt: fail was asked for")
        cacheable = text.startswith("cacheable:")
        replay = cacheable and text in self._answered and not request.bypass_cache
        if cacheable:
            self._answered.add(text)
        delay = 0.0 if replay else self._delay
        if text.startswith("sleep:"):
            head, _, text = text.partition(" ")
            delay = float(head.removeprefix("sleep:"))
        request_id = request_id_from(context, request.request_id)
        words = text.split()
        limit = request.sampling.max_tokens if request.sampling.HasField("max_tokens") else None
        emitted = words if limit is None else words[:limit]
        for index, word in enumerate(emitted):
            if delay:
                await asyncio.sleep(delay)
            yield generation_pb2.GenerateResponse(
                request_id=request_id, text=word + " ", token_ids=[index]
            )
        finish = (
            common_pb2.FINISH_REASON_LENGTH
            if limit is not None and len(words) > limit
            else common_pb2.FINISH_REASON_STOP
        )
        yield generation_pb2.GenerateResponse(
            request_id=request_id,
            finish_reason=finish,
            usage=common_pb2.Usage(prompt_tokens=len(words), completion_tokens=len(emitted)),
            cached=replay,
        )

    async def GenerateJson(self, request, context):  # noqa: N802 (gRPC name)
        try:
            parsed = parse_generate_json(request.body.data)
        except InvalidRequestError as err:
            await context.abort(err.code, str(err))
        async for response in self.Generate(parsed, context):
            yield response

    async def ListModels(self, request, context):  # noqa: N802
        return generation_pb2.ListModelsResponse(
            models=[
                generation_pb2.ModelCard(
                    id="fake-model", max_model_len=2048, max_tokens_cap=256, chat=True
                )
            ]
        )


async def _models(request):  # aiohttp imported lazily: only the router stand-in serves HTTP
    from aiohttp import web

    return web.json_response({"object": "list", "data": [
        {"id": "fake-model", "object": "model", "created": 0, "owned_by": "llmesh"}]})


async def _chat(request):
    from aiohttp import web

    body = await request.json()
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for word in body["messages"][-1]["content"].split():
        chunk = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0,
                 "model": "fake-model",
                 "choices": [{"index": 0, "delta": {"content": word + " "},
                              "finish_reason": None}]}
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    return response


class FakeRetriever(retriever_pb2_grpc.RetrieverServiceServicer):
    """The test double of the retriever: one collection, listed."""

    async def ListCollections(self, request: retriever_pb2.ListCollectionsRequest,
                              context: grpc.aio.ServicerContext
                              ) -> retriever_pb2.ListCollectionsResponse:
        return retriever_pb2.ListCollectionsResponse(
            collections=[retriever_pb2.CollectionInfo(name="fake-collection")])


class FakeService:
    """A :class:`services.common.server.Service` that only pretends to load."""

    def __init__(self, role: str, load_seconds: float, fail_start: bool, delay: float,
                 openai_port: int | None = None) -> None:
        self.service_names = _SERVICE_NAMES[role]
        self._openai_port = openai_port if role == "router" else None
        self._runner = None
        self._role = role
        self._load_seconds = load_seconds
        self._fail_start = fail_start
        self._delay = delay

    def register(self, server: grpc.aio.Server) -> None:
        if self._role == "retriever":
            retriever_pb2_grpc.add_RetrieverServiceServicer_to_server(FakeRetriever(), server)
        if self._role == "router":
            generation_pb2_grpc.add_GenerationServiceServicer_to_server(
                FakeGeneration(self._delay), server
            )

    async def listen_extra(self, host: str) -> dict[str, int]:
        if self._openai_port is None:
            return {}
        from aiohttp import web

        app = web.Application()
        app.router.add_get("/v1/models", _models)
        app.router.add_post("/v1/chat/completions", _chat)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, self._openai_port)
        await site.start()
        server = site._server  # aiohttp exposes the bound port only here
        return {"openai_port": server.sockets[0].getsockname()[1]}

    async def start(self) -> None:
        await asyncio.sleep(self._load_seconds)
        if self._fail_start:
            print("fake start failure: the model file is unreadable", file=sys.stderr)
            raise RuntimeError("fake start failure")

    async def drain(self) -> None:
        return None

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    parser.add_argument("--role", choices=sorted(_SERVICE_NAMES), required=True)
    parser.add_argument("--load-seconds", type=float, default=0.0)
    parser.add_argument("--fail-start", action="store_true")
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--openai-port", type=int, default=None)
    args, _unknown = parser.parse_known_args()
    if args.port_file is not None:
        Path(f"{args.port_file}.argv.json").write_text(json.dumps(sys.argv[1:]))
    service = FakeService(args.role, args.load_seconds, args.fail_start, args.delay,
                          args.openai_port)
    asyncio.run(run_service(server_config_from_args(args.role, args), service))


if __name__ == "__main__":
    main()
