"""Retrieval-augmented requests through Envoy on the real mesh: the session's
mesh, its router restarted with ``--retriever-address`` for this module, and a
real retriever (``python -m services.retriever``, all-MiniLM-L6-v2) holding a
small collection. The router's retrieval stage against fakes, statuses in
detail: tests/router/test_router_retrieval.py."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import grpc
import openai
import pytest

from llmesh.v1 import common_pb2, generation_pb2, generation_pb2_grpc, retriever_pb2
from services.cli.mesh import Mesh
from tests.retriever.conftest import Retriever

COLLECTION = "e2e-facts"
DOCUMENTS = {
    "paris": "Paris is the capital of France. The Seine flows through Paris.",
    "rome": "Rome is the capital of Italy. The Tiber flows through Rome.",
    "lisbon": "Lisbon is the capital of Portugal, on the estuary of the Tagus.",
    "bees": "Honey bees live in colonies with one queen and many workers.",
}
#: The start of a model load on a loaded 2-core machine (the retriever imports torch).
START_TIMEOUT_S = 240.0
#: The retriever's flags here: a short drain (a stop waits for it).
FLAGS = ("--drain-seconds", "1")


def ingest(retriever: Retriever) -> None:
    assert retriever.stub is not None
    retriever.stub.CreateCollection(retriever_pb2.CreateCollectionRequest(name=COLLECTION))
    documents = [retriever_pb2.Document(id=key, text=text) for key, text in DOCUMENTS.items()]
    for document in documents:
        document.metadata.update({"kind": "city" if document.id != "bees" else "nature"})
    retriever.stub.Ingest(retriever_pb2.IngestRequest(collection=COLLECTION,
                                                      documents=documents), timeout=60)


def restarted(retriever: Retriever) -> Retriever:
    """``retriever`` stopped and started again on its port and data directory."""
    assert retriever.process is not None and retriever.process.grpc_port is not None
    port = retriever.process.grpc_port
    retriever.stop()
    again = Retriever(retriever.run_dir, *FLAGS, "--port", str(port))
    again.start(START_TIMEOUT_S)
    return again


@pytest.fixture(scope="module")
def retriever(mesh: Mesh, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[list[Retriever]]:
    """The retriever with the module's collection (the last of the list: a
    test may restart it), the mesh's router pointed at it; the router put
    back as it was and the retriever stopped at the end."""
    holder = [Retriever(tmp_path_factory.mktemp("retriever"), *FLAGS)]
    old_args = tuple(mesh.router_args)
    try:
        holder[0].start(START_TIMEOUT_S)
        ingest(holder[0])
        assert holder[0].process is not None
        mesh.restart_router([*old_args, "--retriever-address",
                             holder[0].process.grpc_address, "--retrieval-timeout-ms", "3000"])
        yield holder
    finally:
        mesh.restart_router(old_args)
        holder[-1].stop()


@pytest.fixture(scope="module")
def stub(ingress_channel: grpc.Channel) -> generation_pb2_grpc.GenerationServiceStub:
    return generation_pb2_grpc.GenerationServiceStub(ingress_channel)


def ask(*turns: tuple[str, str], **retrieval) -> generation_pb2.GenerateRequest:
    pb = generation_pb2.GenerateRequest(
        chat=generation_pb2.Chat(messages=[common_pb2.ChatMessage(role=r, content=c)
                                           for r, c in turns]),
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=6))
    flt = retrieval.pop("filter", None)
    pb.retrieval.CopyFrom(generation_pb2.Retrieval(**retrieval))
    if flt is not None:
        pb.retrieval.filter.update(flt)
    return pb


def generate(stub, request, timeout: float = 60.0) -> list[generation_pb2.GenerateResponse]:
    return list(stub.Generate(request, timeout=timeout))


def test_the_answer_lists_the_chunks_it_was_given(retriever: list[Retriever], stub,
                                                  client: openai.OpenAI, model: str) -> None:
    final = generate(stub, ask(("user", "Which river flows through Paris?"),
                               collection=COLLECTION, top_k=2, filter={"kind": "city"}))[-1]
    assert [c.document_id for c in final.retrieval.chunks][0] == "paris"
    assert len(final.retrieval.chunks) == 2 and "Seine" in final.retrieval.passages_message
    assert final.retrieval_latency.call_ms > 0
    assert final.retrieval_latency.wait_ms <= final.retrieval_latency.call_ms
    answer = client.chat.completions.create(
        model=model, max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": "What is the capital of Portugal?"}],
        extra_body={"retrieval": {"collection": COLLECTION, "top_k": 1}})
    assert answer.model_extra["llmesh_retrieval"]["chunks"][0]["document_id"] == "lisbon"
    # the official client asks for base64 and decodes it
    vectors = client.embeddings.create(model="all-MiniLM-L6-v2",
                                       input=["honey bees", "capital cities"])
    assert [len(d.embedding) for d in vectors.data] == [384, 384]
    assert sum(v * v for v in vectors.data[0].embedding) == pytest.approx(1.0, rel=1e-3)
    assert vectors.usage.prompt_tokens > 0


def test_a_rag_conversation_keeps_its_earlier_turns_in_the_prefix_cache(
        retriever: list[Retriever], client: openai.OpenAI, model: str) -> None:
    tag = uuid.uuid4().hex[:8]  # no earlier request shares a block of this conversation
    messages = [{"role": "system", "content": f"[{tag}] You answer questions about "
                 "geography in one short sentence, using the passages you are given "
                 "when they help, and say so when they do not."}]
    cached = []
    for question in ("Which river flows through Rome?", "And through Paris?",
                     "What is the capital of Portugal?"):
        messages.append({"role": "user", "content": question})
        answer = client.chat.completions.create(
            model=model, messages=messages, max_tokens=6, temperature=0,
            extra_body={"retrieval": {"collection": COLLECTION, "top_k": 1}})
        rag = answer.model_extra["llmesh_retrieval"]
        cached.append(answer.usage.prompt_tokens_details.cached_tokens)
        # the history as the model saw it: passages before the question, then the answer
        messages.insert(-1, {"role": "user", "content": rag["passages_message"]})
        messages.append({"role": "assistant", "content": answer.choices[0].message.content})
    assert cached[0] < cached[1] < cached[2], cached


@pytest.mark.parametrize("request_pb, code, field", [
    (ask(("user", "Capital?"), collection="no-such-collection"), grpc.StatusCode.NOT_FOUND,
     "retrieval.collection: "),
    (ask(("user", "Capital?"), ("user", " "), collection=COLLECTION),
     grpc.StatusCode.INVALID_ARGUMENT, "chat.messages[1].content: "),
    (ask(("user", "Capital?"), collection=COLLECTION, filter={"year": 1900}),
     grpc.StatusCode.INVALID_ARGUMENT, "retrieval.filter.year: "),
])
def test_bad_retrieval_input_through_envoy_names_the_field(retriever: list[Retriever], stub,
                                                            request_pb, code, field) -> None:
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, request_pb)
    assert err.value.code() == code
    assert err.value.details().startswith(field), err.value.details()


def test_a_stopped_retriever_is_unavailable_or_degraded_then_serves_again(
        retriever: list[Retriever], stub) -> None:
    running = retriever[-1]
    running.stop()
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, ask(("user", "Capital of Italy?"), collection=COLLECTION))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "retriever" in err.value.details()
    assert time.monotonic() - started < 10  # bounded: never the call's deadline
    degraded = generate(stub, ask(("user", "Capital of Italy?"), collection=COLLECTION,
                                  on_failure=generation_pb2.RETRIEVAL_FAILURE_POLICY_DEGRADE))
    assert degraded[-1].retrieval.degraded and degraded[-1].usage.completion_tokens > 0
    retriever.append(restarted(running))  # same port; the collection reloaded from disk
    final = generate(stub, ask(("user", "Capital of Italy?"), collection=COLLECTION,
                               top_k=1))[-1]
    assert final.retrieval.chunks[0].document_id == "rome"


def test_a_compacted_rag_chat_never_summarises_its_passages(
        retriever: list[Retriever], mesh: Mesh, model: str) -> None:
    """Issue 34: with a history budget and retrieval on every turn, the
    passages the router inserts before the last user turn are not the
    client's history. A summary folded them in (keyed by messages the next
    turn does not send, so never found: every turn trimmed); now each
    summary covers the client's earlier turns only, later turns find it and
    start with it, and their passages still come in (router-level detail:
    tests/router/test_router_history.py)."""
    from tests.e2e.test_mesh_history import client_of, settle

    router = mesh.add_router("router-rag-history", [
        "--history-budget-tokens=256", "--history-summary-max-tokens=32"])
    try:
        messages = [{"role": "system", "content": f"[{uuid.uuid4().hex[:8]}] Answer in one "
                     "short sentence."}]
        summarized, chunks = [], []
        with client_of(router) as client:
            for question in ("Which river flows through Rome?", "And through Paris?",
                             "What is the capital of Portugal?", "Where do bees live?",
                             "Which city is on the Tagus?"):
                messages.append({"role": "user", "content": question})
                answer = client.chat.completions.create(
                    model=model, messages=messages, max_tokens=8, temperature=0,
                    extra_body={"retrieval": {"collection": COLLECTION, "top_k": 4}})
                messages.append({"role": "assistant",
                                 "content": answer.choices[0].message.content or ""})
                history = (answer.usage.model_extra or {}).get("history") or {}
                summarized.append(history.get("turns_summarized", 0))
                chunks.append(len(answer.model_extra["llmesh_retrieval"]["chunks"]))
                settle(router)
        assert all(c == 4 for c in chunks), chunks
        # a summary was found, covering whole exchanges of the client's own turns
        used = [s for s in summarized if s]
        assert used and all(s % 2 == 0 for s in used), summarized
    finally:
        mesh.remove_router(router.name)
