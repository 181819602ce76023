"""In-process fake tokenizer, engine and cache services for router tests.

They speak the real protos over real gRPC (on 127.0.0.1, port 0) so the
router's clients, pipeline and servicer run exactly as in production, but need
no model.

* Tokenizer: one token per character (id = code point); id 0 is the special
  EOS token (text "", dropped with skip_special_tokens). The chat template is
  ``<role>content\\n`` per message plus ``<assistant>`` as generation prompt;
  the oldest non-system messages are dropped to fit ``max_prompt_tokens``.
  ``GetTokenizer`` hands out a real ``tokenizers`` definition of that code
  (a WordLevel vocabulary of the BMP and the emoji blocks, id = code point,
  fused on decode; id 0 the special EOS), which the router decodes with.
* Engine: generates ``reply`` (one token per character, ``tokens_per_step``
  per message, ``step_delay`` seconds apart), then EOS with FINISH_REASON_STOP,
  or stops with LENGTH at ``max_tokens``; honours ``cancel`` and stop token ids.
* Cache: a dict; ``fail`` makes every call UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
from dataclasses import dataclass, field

import tokenizers

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from llmesh.v1 import (
    cache_pb2,
    cache_pb2_grpc,
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    retriever_pb2,
    retriever_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)

EOS = 0
VOCAB = 0x110000
#: Prompt tokens the fake engine says it found in its prefix cache.
CACHED_PROMPT_TOKENS = 3


def encode(text: str) -> list[int]:
    return [ord(ch) for ch in text]


def decode(ids, skip_special: bool = True) -> str:
    return "".join("" if (i == EOS and skip_special) else chr(i) for i in ids)


def template(messages) -> str:
    return "".join(f"<{m.role}>{m.content}\n" for m in messages) + "<assistant>"


@functools.cache
def definition() -> str:
    """The fake code as a ``tokenizers`` JSON definition (~0.7 MB)."""
    vocab = {chr(EOS): EOS}
    for start, end in ((1, 0xD800), (0xE000, 0x10000), (0x1F000, 0x1FB00)):
        vocab.update((chr(i), i) for i in range(start, end))
    fake = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=chr(EOS)))
    fake.decoder = tokenizers.decoders.Fuse()
    fake.add_special_tokens([tokenizers.AddedToken(chr(EOS), special=True)])
    return fake.to_str()


#: The roles the fake tokenizer's template accepts (GetTokenizerInfo.chat_roles).
CHAT_ROLES = ("system", "user", "assistant", "tool")


class _Status(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        self.code, self.message = code, message


class _AnswerContext:
    """What a unary handler of the fake needs of its context, for a Multiplex answer."""

    async def abort(self, code: grpc.StatusCode, message: str) -> None:
        raise _Status(code, message)


class FakeTokenizer(tokenizer_pb2_grpc.TokenizerServiceServicer):
    def __init__(self, *, model: str = "fake-model", has_chat_template: bool = True) -> None:
        self.model = model
        self.has_chat_template = has_chat_template
        self.definition_requests = 0
        self.chat_requests: list[tokenizer_pb2.ApplyChatTemplateRequest] = []

    async def Tokenize(self, request, context):
        return tokenizer_pb2.TokenizeResponse(token_ids=encode(request.text))

    async def ApplyChatTemplate(self, request, context):
        self.chat_requests.append(request)
        messages = list(request.messages)
        dropped = 0
        budget = request.max_prompt_tokens
        while budget and len(template(messages)) > budget:
            droppable = [i for i, m in enumerate(messages[:-1]) if m.role != "system"]
            if not droppable:
                await context.abort(grpc.StatusCode.OUT_OF_RANGE,
                                    "the last message alone does not fit")
            del messages[droppable[0]]
            dropped += 1
        return tokenizer_pb2.ApplyChatTemplateResponse(
            token_ids=encode(template(messages)), num_dropped_messages=dropped)

    async def Multiplex(self, request_iterator, context):
        """The router's path: each message answered by the unary handler above."""
        async for message in request_iterator:
            answer = tokenizer_pb2.TokenizerServiceMultiplexResponse(call_id=message.call_id)
            kind = message.WhichOneof("request")
            handler = self.Tokenize if kind == "tokenize" else self.ApplyChatTemplate
            try:
                getattr(answer, kind).CopyFrom(
                    await handler(getattr(message, kind), _AnswerContext()))
            except _Status as status:
                answer.status_code, answer.status_message = status.code.value[0], status.message
            yield answer

    async def GetTokenizer(self, request, context):
        self.definition_requests += 1
        data = definition().encode()
        yield tokenizer_pb2.GetTokenizerResponse(
            format="huggingface-tokenizers-json", total_bytes=len(data),
            sha256=hashlib.sha256(data).hexdigest(), vocab_size=VOCAB,
            definition_chunk=data[:len(data) // 2])
        yield tokenizer_pb2.GetTokenizerResponse(definition_chunk=data[len(data) // 2:])

    async def GetTokenizerInfo(self, request, context):
        return tokenizer_pb2.GetTokenizerInfoResponse(
            model=self.model, vocab_size=VOCAB, eos_token_ids=[EOS],
            has_chat_template=self.has_chat_template, chat_roles=CHAT_ROLES)


@dataclass
class EngineLog:
    """What a fake engine saw."""

    starts: list[engine_pb2.EngineRequest] = field(default_factory=list)
    metadata: list[dict[str, str]] = field(default_factory=list)  # per call
    deadlines: list[float | None] = field(default_factory=list)  # per request
    cancel_messages: int = 0
    late_cancels: int = 0  # Multiplex cancels of requests already finished
    ended: list[str] = field(default_factory=list)  # "finished" | "cancel_msg" | "dropped"
    active: int = 0


class FakeEngine(engine_pb2_grpc.EngineServiceServicer):
    """Serves ``Multiplex``, what the router uses (each request: :meth:`respond`)."""

    def __init__(self, reply: str = "Paris is the capital of France.", *,
                 max_model_len: int = 256, model: str = "fake-model",
                 replica_id: str = "") -> None:
        self.reply = reply
        self.replica_id = replica_id
        self.max_model_len = max_model_len
        self.model = model
        self.tokens_per_step = 1
        self.step_delay = 0.0
        self.first_delay = 0.0
        self.fail_code: grpc.StatusCode | None = None
        self.fail_message = "fake engine refuses"
        self.log = EngineLog()
        self.finish_with_error = False
        # When set, each request is answered with these updates (stream ids
        # filled in) instead of :meth:`respond`: an engine's exact messages.
        self.script: list[engine_pb2.SequenceUpdate] | None = None
        self._call_ends: list[asyncio.Event] = []

    async def drop_calls(self) -> None:
        """Ends every open Multiplex call with UNAVAILABLE (an engine that restarts)."""
        for event in self._call_ends:
            event.set()
        await asyncio.sleep(0)

    async def Multiplex(self, request_iterator, context):
        self.log.metadata.append(dict(context.invocation_metadata() or ()))
        end_call = asyncio.Event()
        self._call_ends.append(end_call)
        out: asyncio.Queue[engine_pb2.MultiplexResponse] = asyncio.Queue()
        cancels: dict[int, asyncio.Event] = {}
        tasks: dict[int, asyncio.Task[None]] = {}
        finished: set[int] = set()

        async def run(stream_id: int, start: engine_pb2.EngineRequest) -> None:
            try:
                async for r in self.respond(start, cancels[stream_id]):
                    out.put_nowait(engine_pb2.MultiplexResponse(updates=[
                        engine_pb2.SequenceUpdate(
                            stream_id=stream_id, token_ids=r.token_ids,
                            finish_reason=r.finish_reason, usage=r.usage,
                            status_code=(grpc.StatusCode.INTERNAL.value[0]
                                         if r.finish_reason == common_pb2.FINISH_REASON_ERROR
                                         else 0))]))
            finally:
                finished.add(stream_id)
                tasks.pop(stream_id, None)

        async def read() -> None:
            async for message in request_iterator:
                for item in message.starts:
                    self.log.deadlines.append(item.timeout_ms / 1e3 if item.timeout_ms else None)
                    if self.fail_code is not None:
                        out.put_nowait(engine_pb2.MultiplexResponse(updates=[
                            engine_pb2.SequenceUpdate(
                                stream_id=item.stream_id, status_code=self.fail_code.value[0],
                                status_message=self.fail_message)]))
                        continue
                    if self.script is not None:
                        self.log.starts.append(item.request)
                        for update in self.script:
                            scripted = engine_pb2.SequenceUpdate()
                            scripted.CopyFrom(update)
                            scripted.stream_id = item.stream_id
                            out.put_nowait(engine_pb2.MultiplexResponse(updates=[scripted]))
                        continue
                    cancels[item.stream_id] = asyncio.Event()
                    tasks[item.stream_id] = asyncio.create_task(run(item.stream_id, item.request))
                for stream_id in message.cancels:
                    if stream_id in finished:
                        self.log.late_cancels += 1
                    elif stream_id in cancels:
                        cancels[stream_id].set()

        reader = asyncio.create_task(read())
        ending = asyncio.create_task(end_call.wait())
        try:
            while True:
                message = asyncio.create_task(out.get())
                await asyncio.wait([message, ending], return_when=asyncio.FIRST_COMPLETED)
                if not message.done():
                    message.cancel()
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "fake engine restarts")
                yield message.result()
        finally:
            ending.cancel()
            self._call_ends.remove(end_call)
            reader.cancel()
            for task in list(tasks.values()):
                task.cancel()

    async def respond(self, start: engine_pb2.EngineRequest, cancelled: asyncio.Event):
        """The messages of one request; ``cancelled`` set ends it with CANCELLED."""
        self.log.starts.append(start)
        self.log.active += 1
        ended = "dropped"
        try:
            ids = encode(self.reply) + [EOS]
            stops = set(start.sampling.stop_token_ids)
            limit = start.sampling.max_tokens
            done = 0
            await asyncio.sleep(self.first_delay)
            while True:
                if cancelled.is_set():
                    ended = "cancel_msg"
                    self.log.cancel_messages += 1
                    yield engine_pb2.EngineServiceGenerateResponse(
                        request_id=start.request_id,
                        finish_reason=common_pb2.FINISH_REASON_CANCELLED,
                        usage=common_pb2.Usage(prompt_tokens=len(start.prompt_token_ids),
                                               completion_tokens=done))
                    return
                step: list[int] = []
                reason = 0
                while len(step) < self.tokens_per_step:
                    token = ids[min(done, len(ids) - 1)]
                    step.append(token)
                    done += 1
                    if token == EOS and not start.sampling.ignore_eos or token in stops:
                        reason = common_pb2.FINISH_REASON_STOP
                        break
                    if done >= limit:
                        reason = common_pb2.FINISH_REASON_LENGTH
                        break
                if self.finish_with_error and reason:
                    reason = common_pb2.FINISH_REASON_ERROR
                # Running counts on every message, as the real engine sends them.
                response = engine_pb2.EngineServiceGenerateResponse(
                    request_id=start.request_id, token_ids=step, finish_reason=reason,
                    usage=common_pb2.Usage(prompt_tokens=len(start.prompt_token_ids),
                                           completion_tokens=done,
                                           cached_prompt_tokens=CACHED_PROMPT_TOKENS))
                if reason:
                    ended = "finished"
                    yield response
                    return
                yield response
                await asyncio.sleep(self.step_delay)
        finally:
            self.log.active -= 1
            self.log.ended.append(ended)

    async def GetLoad(self, request, context):
        return engine_pb2.GetLoadResponse(num_running=self.log.active)

    async def StreamLoad(self, request, context):
        """The load every 20 ms (the real engine sends it on change)."""
        while True:
            yield engine_pb2.StreamLoadResponse(
                load=engine_pb2.GetLoadResponse(num_running=self.log.active))
            await asyncio.sleep(0.02)

    async def GetModelInfo(self, request, context):
        return engine_pb2.GetModelInfoResponse(
            model=self.model, max_model_len=self.max_model_len, vocab_size=VOCAB,
            eos_token_ids=[EOS], backend="fake", replica_id=self.replica_id)


class FakeCache(cache_pb2_grpc.CacheServiceServicer):
    def __init__(self) -> None:
        self.store: dict[bytes, cache_pb2.CachedResponse] = {}
        self.fail = False
        self.gets = 0
        self.puts = 0
        #: PutCachedResponses messages read (each carries one batch of stores).
        self.put_messages = 0

    async def GetCachedResponse(self, request, context):
        self.gets += 1
        if self.fail:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "cache down")
        found = self.store.get(request.key.SerializeToString(deterministic=True))
        if found is None:
            return cache_pb2.GetCachedResponseResponse(found=False)
        return cache_pb2.GetCachedResponseResponse(found=True, response=found)

    async def GetCachedResponses(self, request_iterator, context):
        """Each message's lookups answered in one message; ``fail`` ends the call."""
        async for message in request_iterator:
            self.gets += len(message.lookups)
            if self.fail:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "cache down")
            results = []
            for lookup in message.lookups:
                found = self.store.get(lookup.key.SerializeToString(deterministic=True))
                results.append(cache_pb2.CachedResponseLookupResult(
                    lookup_id=lookup.lookup_id, found=found is not None, response=found))
            yield cache_pb2.GetCachedResponsesResponse(results=results)

    async def PutCachedResponse(self, request, context):
        self.puts += 1
        if self.fail:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "cache down")
        self.store[request.key.SerializeToString(deterministic=True)] = request.response
        return cache_pb2.PutCachedResponseResponse(stored=True)

    async def PutCachedResponses(self, request_iterator, context):
        """Each message's stores answered in one message; ``fail`` ends the call."""
        async for message in request_iterator:
            self.put_messages += 1
            self.puts += len(message.stores)
            if self.fail:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "cache down")
            for store in message.stores:
                self.store[store.put.key.SerializeToString(deterministic=True)] = (
                    store.put.response)
            yield cache_pb2.PutCachedResponsesResponse(results=[
                cache_pb2.CachedResponseStoreResult(store_id=store.store_id, stored=True)
                for store in message.stores])


async def serve(add, servicer) -> tuple[grpc.aio.Server, str]:
    """Starts ``servicer`` (with SERVING health) on a free port; returns (server, target)."""
    server = grpc.aio.server()
    add(servicer, server)
    health = health_aio.HealthServicer()
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@dataclass
class FakeChunk:
    chunk_id: str
    text: str
    metadata: dict = field(default_factory=dict)

    @property
    def document_id(self) -> str:
        return self.chunk_id.split("#", 1)[0]


class FakeRetriever(retriever_pb2_grpc.RetrieverServiceServicer):
    """Serves Query and Embed over ``collections`` (name → chunks, best first).

    Query refuses as the real retriever's contract says (NOT_FOUND naming the
    collection, INVALID_ARGUMENT naming ``filter`` / ``query``); ``delay``
    seconds before each answer; a repeated query is a cache hit. Embed gives
    4-dimensional unit vectors and one token per word.
    """

    MODEL = "sentence-transformers/fake-minilm"

    def __init__(self, collections: dict[str, list[FakeChunk]]) -> None:
        self.collections = collections
        self.delay = 0.0
        self.queries: list[retriever_pb2.QueryRequest] = []
        self.query_times: list[float] = []
        self._seen: set[bytes] = set()

    async def Query(self, request, context):
        self.queries.append(request)
        self.query_times.append(asyncio.get_running_loop().time())
        if self.delay:
            await asyncio.sleep(self.delay)
        chunks = self.collections.get(request.collection)
        if chunks is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"collection {request.collection!r} does not exist")
        if not request.query.strip():
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "query: must hold text")
        wanted = dict(request.filter)
        fields = {key for c in chunks for key in c.metadata}
        for key in wanted:
            if key not in fields:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"filter: no document of {request.collection!r} has "
                                    f"field {key!r}")
        found = [c for c in chunks if all(c.metadata.get(k) == v for k, v in wanted.items())]
        found = found[:request.top_k or 2]
        key = request.SerializeToString(deterministic=True)
        hit = key in self._seen
        self._seen.add(key)
        return retriever_pb2.QueryResponse(
            chunks=[retriever_pb2.RetrievedChunk(
                chunk_id=c.chunk_id, document_id=c.document_id, text=c.text,
                score=0.9 - 0.1 * i) for i, c in enumerate(found)],
            timing=retriever_pb2.RetrievalTiming(
                embed_ms=0.0 if hit else 1.5, search_ms=0.0 if hit else 0.5, cache_hit=hit,
                total_ms=0.1 if hit else 2.0),
            version=7)

    async def Embed(self, request, context):
        if not request.texts:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "texts: must not be empty")
        vectors = []
        for i, text in enumerate(request.texts):
            if not text:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"texts[{i}]: must not be empty")
            raw = [float(b) + 1.0 for b in hashlib.sha256(text.encode()).digest()[:4]]
            norm = sum(v * v for v in raw) ** 0.5
            vectors.append(retriever_pb2.Embedding(values=[v / norm for v in raw]))
        return retriever_pb2.EmbedResponse(
            embeddings=vectors, model=self.MODEL,
            prompt_tokens=sum(len(t.split()) for t in request.texts))
