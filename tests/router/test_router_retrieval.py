"""Retrieval-augmented requests through the router (services/router/retrieval),
over real gRPC against the fake tokenizer / engine and a fake retriever that
speaks ``llmesh.v1.RetrieverService`` (tests/router/router_fakes.py). The real
retriever through Envoy: tests/e2e/test_mesh_retrieval.py."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import struct
import time

import aiohttp
import grpc
import pytest
from google.protobuf import struct_pb2

from llmesh.v1 import common_pb2, generation_pb2, retriever_pb2_grpc
from services.common.sampling import Priority
from services.router.admission import AdmissionConfig
from tests.router.router_fakes import FakeChunk, FakeRetriever, decode, serve, template
from tests.router.test_router_service import (
    REPLY,
    collect,
    greedy,
    make_mesh,
    text_of,
    wait_for,
)

DOCS = [FakeChunk("paris#0", "Paris is the capital of France.", {"lang": "en"}),
        FakeChunk("paris#1", "Paris lies on the Seine.", {"lang": "en"}),
        FakeChunk("lyon#0", "Lyon est une ville.", {"lang": "fr"})]
SYSTEM = common_pb2.ChatMessage(role="system", content="Answer briefly.")


def chat(*turns: tuple[str, str], **retrieval) -> generation_pb2.GenerateRequest:
    """A chat request of (role, content) turns after SYSTEM, with ``retrieval``."""
    pb = generation_pb2.GenerateRequest(
        chat=generation_pb2.Chat(messages=[SYSTEM, *(common_pb2.ChatMessage(
            role=role, content=content) for role, content in turns)]),
        sampling=greedy(max_tokens=64))
    if retrieval:
        flt = retrieval.pop("filter", None)
        pb.retrieval.CopyFrom(generation_pb2.Retrieval(**retrieval))
        if flt is not None:
            pb.retrieval.filter.update(flt)
    return pb


@contextlib.asynccontextmanager
async def rag_mesh(**config):
    """The fake mesh with a fake retriever; yields (mesh, retriever, its server)."""
    retriever = FakeRetriever({"docs": list(DOCS)})
    server, target = await serve(retriever_pb2_grpc.add_RetrieverServiceServicer_to_server,
                                 retriever)
    try:
        async with make_mesh(max_model_len=1024, retriever=target, **config) as mesh:
            yield mesh, retriever, server
    finally:
        await server.stop(None)


def prompt_of(mesh) -> str:
    return decode(mesh.engines[0].log.starts[-1].prompt_token_ids)


async def test_passages_go_just_before_the_last_user_turn_and_the_last_message_lists_them():
    async with rag_mesh() as (mesh, retriever, _):
        responses = await collect(mesh.stub.Generate(chat(
            ("user", "Hi"), ("assistant", "Hello."), ("user", "Capital of France?"),
            collection="docs", top_k=2, filter={"lang": "en"})))
        query = retriever.queries[-1]
        assert (query.collection, query.query, query.top_k) == ("docs", "Capital of France?", 2)
        assert dict(query.filter) == {"lang": "en"}
        final = responses[-1]
        used = final.retrieval
        assert [(c.chunk_id, c.document_id) for c in used.chunks] == [
            ("paris#0", "paris"), ("paris#1", "paris")]
        assert used.chunks[0].score == pytest.approx(0.9)
        assert used.collection_version == 7 and not used.degraded
        assert used.passages_message == (
            'Passages retrieved for the next message (collection "docs"):\n\n'
            "[1] paris#0\nParis is the capital of France.\n\n[2] paris#1\nParis lies on "
            "the Seine.")
        # system prompt and earlier turns first, the passages, then the question
        assert prompt_of(mesh) == template([
            SYSTEM, common_pb2.ChatMessage(role="user", content="Hi"),
            common_pb2.ChatMessage(role="assistant", content="Hello."),
            common_pb2.ChatMessage(role="user", content=used.passages_message),
            common_pb2.ChatMessage(role="user", content="Capital of France?")])
        latency = final.retrieval_latency
        assert latency.embed_ms == 1.5 and not latency.cache_hit
        assert 0 <= latency.wait_ms <= latency.call_ms
        assert latency.overlap_ms == pytest.approx(latency.call_ms - latency.wait_ms)
        assert all(not r.HasField("retrieval") for r in responses[:-1])
        # the same query again: the retriever's top-k cache, counted as a hit
        again = await collect(mesh.stub.Generate(chat(
            ("user", "Capital of France?"), collection="docs", top_k=2, filter={"lang": "en"})))
        assert again[-1].retrieval_latency.cache_hit
        assert mesh.metric("llmesh:retrieval_requests_total", model_name="fake-model",
                           outcome="miss") == 1
        assert mesh.metric("llmesh:retrieval_requests_total", model_name="fake-model",
                           outcome="hit") == 1
        assert mesh.metric("llmesh:retrieval_wait_seconds_count", model_name="fake-model") == 2


async def test_the_retrievers_caches_are_asked_in_the_requests_tenant_scope():
    async with rag_mesh() as (mesh, retriever, _):
        async def hit(tenant: str) -> bool:
            responses = await collect(mesh.stub.Generate(
                chat(("user", "Capital of France?"), collection="docs", top_k=2),
                metadata=(("x-tenant-id", tenant),)))
            return responses[-1].retrieval_latency.cache_hit

        assert not await hit("acme")
        assert not await hit("globex")  # another tenant's identical query: a miss
        assert await hit("acme")  # the same tenant's: a hit
        scopes = [query.cache_scope for query in retriever.queries]
        assert scopes[0] == scopes[2] != scopes[1] and all(scopes)


async def test_a_conversation_that_sends_its_passages_back_keeps_each_prompt_as_a_prefix():
    async with rag_mesh() as (mesh, _, _server):
        first = await collect(mesh.stub.Generate(chat(("user", "Where is Paris?"),
                                                      collection="docs")))
        prompt_1 = prompt_of(mesh)
        passages_1 = first[-1].retrieval.passages_message
        assert passages_1
        await collect(mesh.stub.Generate(chat(
            ("user", passages_1), ("user", "Where is Paris?"), ("assistant", REPLY),
            ("user", "And its river?"), collection="docs", top_k=1)))
        prompt_2 = prompt_of(mesh)
        assert prompt_2.startswith(prompt_1 + REPLY)  # the whole first turn is a prefix
        # a turn that does not ask inserts nothing: still the same prefix
        await collect(mesh.stub.Generate(chat(
            ("user", passages_1), ("user", "Where is Paris?"), ("assistant", REPLY),
            ("user", "Thanks."))))
        assert prompt_of(mesh).startswith(prompt_1 + REPLY)
        assert "Thanks." in prompt_of(mesh) and prompt_of(mesh).count("Passages") == 1


async def test_a_stopped_retriever_fails_fast_or_degrades_as_the_request_allows():
    async with rag_mesh() as (mesh, _, server):
        await server.stop(None)
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(mesh.stub.Generate(chat(("user", "Capital?"), collection="docs"),
                                             timeout=20))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert err.value.details().startswith("the retriever is unavailable")
        assert "127.0.0.1" not in err.value.details()  # the address goes to the log only
        assert time.monotonic() - started < 5  # never waits for the call's deadline
        degraded = await collect(mesh.stub.Generate(chat(
            ("user", "Capital?"), collection="docs",
            on_failure=generation_pb2.RETRIEVAL_FAILURE_POLICY_DEGRADE)))
        assert "".join(r.text for r in degraded) == REPLY
        assert degraded[-1].retrieval.degraded and not degraded[-1].retrieval.chunks
        assert "UNAVAILABLE" in degraded[-1].retrieval.degraded_reason
        assert "127.0.0.1" not in degraded[-1].retrieval.degraded_reason
        assert "Passages" not in prompt_of(mesh)
        assert mesh.metric("llmesh:retrieval_requests_total", model_name="fake-model",
                           outcome="degraded") == 1
        assert mesh.metric("llmesh:retrieval_requests_total", model_name="fake-model",
                           outcome="failed") == 1


async def test_a_slow_retriever_is_cut_by_the_timeout_cap_and_by_the_call_deadline():
    async with rag_mesh(retrieval_timeout_s=1.0) as (mesh, retriever, _):
        retriever.delay = 3.0
        for timeout in (20.0, 0.5):  # the router's cap, then the client's deadline
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(mesh.stub.Generate(chat(("user", "Capital?"),
                                                      collection="docs"), timeout=timeout))
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            if timeout == 20.0:  # QA: the router's cap told the client to allow a longer deadline
                assert "retriever" in err.value.details()
                assert "--retrieval-timeout-ms" in err.value.details()
                assert "longer deadline" not in err.value.details()
            assert time.monotonic() - started < 2.5
        assert mesh.engines[0].log.starts == []


# --------------------------------------------------------------------------- #
# Retrieval beside the admission wait

#: The retriever's delay and how long other requests hold the engine's one slot (s).
D = Q = 1.2
#: The fake engine's time per token: a request of ``HOLD_TOKENS`` holds its slot Q.
STEP_S = 0.05
HOLD_TOKENS = round(Q / STEP_S)


def one_slot_rag_mesh():
    """:func:`rag_mesh` whose engine runs one request at a time (admission
    queues the others) and whose Query may take 5 s."""
    return rag_mesh(admission=AdmissionConfig(max_running_per_replica=1),
                    retrieval_timeout_s=5.0)


def held_slot(mesh, prompt: str) -> asyncio.Future:
    """A plain request that holds a running slot about Q once dispatched."""
    return asyncio.ensure_future(collect(mesh.stub.Generate(generation_pb2.GenerateRequest(
        prompt=prompt, sampling=greedy(max_tokens=HOLD_TOKENS, ignore_eos=True),
        bypass_cache=True))))


async def timed(call) -> tuple[float, list[generation_pb2.GenerateResponse]]:
    """(when the first response came, ``time.monotonic()``; all responses)."""
    responses, first_at = [], 0.0
    async for response in call:
        first_at = first_at or time.monotonic()
        responses.append(response)
    return first_at, responses


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "alone"])
async def test_a_rag_request_queues_for_its_slot_while_its_passages_are_retrieved(shared):
    """One engine slot, held for Q by a running request; a RAG request whose
    Query takes D; a plain request that arrives during the Query. The RAG
    request queued at arrival, ahead of the later one: its TTFT is about
    max(D, Q), not D + Q (before: it queued only after its passages came, behind
    the later request, and waited for it too). ``shared``: greedy, so a shared
    generation (single flight) takes its place over; else ``bypass_cache``."""
    async with one_slot_rag_mesh() as (mesh, retriever, _):
        admission = mesh.router.admission["fake-model"]
        mesh.engines[0].step_delay = STEP_S
        retriever.delay = D
        running = held_slot(mesh, "first")
        await wait_for(lambda: admission.num_running == 1 and mesh.engines[0].log.starts)
        sent = time.monotonic()
        request = chat(("user", "Capital of France?"), collection="docs")
        request.bypass_cache = not shared
        rag = asyncio.ensure_future(timed(mesh.stub.Generate(request)))
        await wait_for(lambda: retriever.queries)
        later = held_slot(mesh, "later")  # arrives while the Query runs
        first_at, rest = await rag
        ttft = first_at - sent
        assert ttft < 0.8 * (D + Q), f"TTFT {ttft:.2f} s: retrieval and queue in series"
        assert ttft >= D * 0.9  # it did wait for its passages
        assert "".join(r.text for r in rest) == REPLY
        assert [c.chunk_id for c in rest[-1].retrieval.chunks] == ["paris#0", "paris#1"]
        assert "Passages retrieved" in decode(mesh.engines[0].log.starts[1].prompt_token_ids)
        # Queued for its slot meanwhile: most of the Query added nothing to TTFT
        # (QA: wait_ms was the whole call, overlap_ms 0).
        latency = rest[-1].retrieval_latency
        assert latency.overlap_ms > 0.5 * D * 1e3 and latency.wait_ms < 0.5 * D * 1e3, latency
        await running
        later.cancel()
        await wait_for(lambda: admission.num_running == 0)
        assert admission.queue_depth(Priority.INTERACTIVE) == 0


async def test_a_rag_request_gives_its_slot_or_place_up_at_once_when_it_fails_or_leaves():
    """The place taken beside the Query: a free slot is not held idle while
    the Query runs, and nothing is left held when the retriever refuses or
    the deadline passes during the Query (the retriever's
    DEADLINE_EXCEEDED); a deadline the queue cannot meet is refused before
    the Query; a queued place leaves the queue when the client cancels."""
    async with one_slot_rag_mesh() as (mesh, retriever, _):
        admission = mesh.router.admission["fake-model"]
        queued = lambda: admission.queue_depth(Priority.INTERACTIVE)
        retriever.delay = 0.4
        refused = asyncio.ensure_future(collect(mesh.stub.Generate(
            chat(("user", "Capital?"), collection="nope"))))
        await wait_for(lambda: retriever.queries)
        assert admission.num_running == 0  # a free slot: taken once the prompt is ready
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await refused
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert admission.num_running == 0
        retriever.delay = 3.0
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(mesh.stub.Generate(chat(("user", "Capital?"), collection="docs"),
                                             timeout=0.4))
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "retriever" in err.value.details()
        assert admission.num_running == 0
        mesh.engines[0].step_delay = STEP_S
        running = held_slot(mesh, "first")
        await wait_for(lambda: admission.num_running == 1 and mesh.engines[0].log.starts)
        asked = len(retriever.queries)
        # a deadline the queue cannot meet: refused at once, before its Query
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(mesh.stub.Generate(chat(("user", "Capital?"), collection="docs"),
                                             timeout=0.3))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "deadline" in err.value.details() and len(retriever.queries) == asked
        call = mesh.stub.Generate(chat(("user", "Capital?"), collection="docs"))
        waiting = asyncio.ensure_future(collect(call))
        await wait_for(lambda: queued() == 1)
        call.cancel()
        await wait_for(lambda: queued() == 0, timeout=1.0)
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await running
        assert admission.num_running == 0 and len(mesh.engines[0].log.starts) == 1
        # a place given up by a request that joins an identical one, or is a cache hit
        mesh.engines[0].step_delay, retriever.delay = 0.0, 0.2
        same = chat(("user", "Capital?"), collection="docs")
        together = await asyncio.gather(*(collect(mesh.stub.Generate(same)) for _ in "ab"))
        again = await collect(mesh.stub.Generate(same))
        assert [text_of(r) for r in (*together, again)] == [REPLY] * 3
        assert again[-1].cached and len(mesh.engines[0].log.starts) == 2
        assert admission.num_running == 0 and queued() == 0


async def test_a_batch_rag_request_holds_no_free_slot_through_its_query():
    """QA: a BATCH request always waits its batch window, so a BATCH RAG
    request claimed its place early, was granted the free slot 10 ms later
    and held it idle through its Query (plain batch requests waited for the
    Query's timeout on an idle engine). A free slot is taken once the prompt
    is ready, at any priority."""
    async with one_slot_rag_mesh() as (mesh, retriever, _):
        admission = mesh.router.admission["fake-model"]
        retriever.delay = 1.0
        rag_request = chat(("user", "Capital?"), collection="docs")
        rag_request.priority = common_pb2.PRIORITY_BATCH
        rag = asyncio.ensure_future(collect(mesh.stub.Generate(rag_request)))
        await wait_for(lambda: retriever.queries)
        await asyncio.sleep(0.1)  # well past the batch window
        assert admission.num_running == 0
        plain = generation_pb2.GenerateRequest(
            prompt="plain", sampling=greedy(max_tokens=4), bypass_cache=True,
            priority=common_pb2.PRIORITY_BATCH)
        started = time.monotonic()
        await collect(mesh.stub.Generate(plain))
        assert time.monotonic() - started < 0.8  # not after the RAG request's Query
        assert "".join(r.text for r in await rag) == REPLY
        await wait_for(lambda: admission.num_running == 0)


@pytest.mark.parametrize("request_pb, code, field", [
    (chat(("user", "Capital?"), collection="nope"), grpc.StatusCode.NOT_FOUND,
     "retrieval.collection: collection 'nope' does not exist"),
    (chat(("user", "Capital?"), collection="docs", filter={"year": 1900}),
     grpc.StatusCode.INVALID_ARGUMENT, "retrieval.filter: no document of 'docs' has field"),
    (chat(("user", "Capital?"), ("user", "  "), collection="docs"),
     grpc.StatusCode.INVALID_ARGUMENT, "chat.messages[2].content: the last user turn"),
    (chat(("user", "Capital?"), collection="docs", top_k=33),
     grpc.StatusCode.INVALID_ARGUMENT, "retrieval.top_k: at most 32"),
    (chat(("user", "Capital?"), collection="no spaces"),
     grpc.StatusCode.INVALID_ARGUMENT, "retrieval.collection: must name"),
    (chat(("user", "Capital?"), collection="docs", filter={"lang": ["en"]}),
     grpc.StatusCode.INVALID_ARGUMENT, "retrieval.filter.lang: must be a string"),
    (generation_pb2.GenerateRequest(prompt="Capital?", retrieval=generation_pb2.Retrieval(
        collection="docs")), grpc.StatusCode.INVALID_ARGUMENT, "retrieval: needs `chat`"),
])
async def test_bad_retrieval_input_is_a_precise_status_naming_the_field(request_pb, code,
                                                                         field):
    async with rag_mesh() as (mesh, _, _server):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(mesh.stub.Generate(request_pb))
        assert err.value.code() == code
        assert err.value.details().startswith(field), err.value.details()
        assert mesh.engines[0].log.starts == []
        # nothing else affected: the next request is answered
        ok = await collect(mesh.stub.Generate(chat(("user", "Capital?"), collection="docs")))
        assert "".join(r.text for r in ok) == REPLY


async def test_a_router_without_a_retriever_refuses_retrieval_as_a_precondition():
    async with make_mesh(max_model_len=1024) as mesh:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(mesh.stub.Generate(chat(("user", "Capital?"), collection="docs")))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert err.value.details().startswith("retrieval: this router has no retriever")


# --------------------------------------------------------------------------- #
# OpenAI edge


@contextlib.asynccontextmanager
async def rag_http(**config):
    async with rag_mesh(openai_port=0, **config) as (mesh, retriever, server):
        ports = await mesh.router.listen_extra("127.0.0.1")
        async with aiohttp.ClientSession(f"http://127.0.0.1:{ports['openai_port']}") as http:
            yield mesh, retriever, server, http


async def test_openai_chat_takes_the_retrieval_extension_and_reports_the_chunks():
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "Capital?"}],
            "retrieval": {"collection": "docs", "top_k": 1, "filter": {"lang": "en"}}}
    async with rag_http() as (mesh, retriever, _, http):
        async with http.post("/v1/chat/completions", json=body) as response:
            answer = await response.json()
            assert response.status == 200, answer
            assert float(response.headers["x-llmesh-retrieval-ms"]) >= float(
                response.headers["x-llmesh-retrieval-wait-ms"]) >= 0
        rag = answer["llmesh_retrieval"]
        assert [c["chunk_id"] for c in rag["chunks"]] == ["paris#0"]
        assert rag["passages_message"].startswith("Passages retrieved") and not rag["degraded"]
        assert set(rag["latency_ms"]) == {"embed", "search", "cache_hit", "call", "wait",
                                          "overlap"}
        async with http.post("/v1/chat/completions", json={**body, "stream": True}) as resp:
            chunks = [line for line in (await resp.text()).splitlines() if line]
        finals = [c for c in chunks if "llmesh_retrieval" in c]
        assert len(finals) == 1 and '"finish_reason":"stop"' in finals[0]
        for bad, param in (({"collection": "docs", "k": 1}, "retrieval.k"),
                           ({"collection": "nope"}, "retrieval.collection"),
                           ({"collection": "docs", "on_failure": "maybe"},
                            "retrieval.on_failure")):
            async with http.post("/v1/chat/completions",
                                 json={**body, "retrieval": bad}) as response:
                error = (await response.json())["error"]
                assert response.status == (404 if bad["collection"] == "nope" else 400)
                assert error["param"] == param, error
        assert len(retriever.queries) == 3


async def test_openai_embeddings_in_openai_shape_float_and_base64():
    async with rag_http() as (_, _retriever, server, http):
        async with http.post("/v1/embeddings", json={"input": ["a b", "c"],
                                                     "model": "fake-minilm"}) as response:
            answer = await response.json()
            assert response.status == 200, answer
        assert answer["object"] == "list" and answer["model"] == FakeRetriever.MODEL
        assert [d["index"] for d in answer["data"]] == [0, 1]
        vector = answer["data"][0]["embedding"]
        assert len(vector) == 4 and sum(v * v for v in vector) == pytest.approx(1.0)
        assert answer["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
        async with http.post("/v1/embeddings", json={"input": "a b",
                                                     "encoding_format": "base64"}) as response:
            encoded = (await response.json())["data"][0]["embedding"]
        assert list(struct.unpack("<4f", base64.b64decode(encoded))) == pytest.approx(vector)
        for body, status, param in (({"input": []}, 400, "input"),
                                    ({"input": ["x", 3]}, 400, "input[1]"),
                                    ({"input": "x", "dimensions": 2}, 400, "dimensions"),
                                    ({"input": "x", "model": "gpt"}, 404, "model")):
            async with http.post("/v1/embeddings", json=body) as response:
                error = (await response.json())["error"]
                assert (response.status, error["param"]) == (status, param), error
        await server.stop(None)
        async with http.post("/v1/embeddings", json={"input": "x"}) as response:
            assert response.status == 503
            assert "retriever" in (await response.json())["error"]["message"]


async def test_the_json_edge_reads_retrieval_from_the_proto():
    from services.router.json_request import parse_generate_json

    parsed = parse_generate_json(b'{"chat": {"messages": [{"role": "user", "content": "x"}]},'
                                 b' "retrieval": {"collection": "docs", "topK": 3, "filter": '
                                 b'{"lang": "en"}, "onFailure": '
                                 b'"RETRIEVAL_FAILURE_POLICY_DEGRADE"}}')
    assert parsed.retrieval.top_k == 3 and parsed.retrieval.collection == "docs"
    assert parsed.retrieval.filter == struct_pb2.Struct(fields={
        "lang": struct_pb2.Value(string_value="en")})
    assert parsed.retrieval.on_failure == generation_pb2.RETRIEVAL_FAILURE_POLICY_DEGRADE
