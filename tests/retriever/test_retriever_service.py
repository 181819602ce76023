"""The retriever as a real process (real model, real gRPC): ingest, query,
filter, replace, persistence across a restart, bad input, health, reflection."""

from __future__ import annotations

import subprocess
import time

import grpc
import pytest
from google.protobuf import struct_pb2
from llmesh.v1 import retriever_pb2 as pb
from llmesh.v1 import retriever_pb2_grpc

from services.cli.envoy_config import DESCRIPTOR_RELATIVE, REPO_ROOT, EnvoySettings
from services.cli.mesh import EnvoyProcess
from tests.poller_reads import MAX_POLLER_WAKEUPS_PER_CALL, wakeups_per_call
from tests.retriever.conftest import Retriever

PSALM = ("The LORD is my shepherd; I shall not want. He maketh me to lie down in green "
         "pastures: he leadeth me beside the still waters.")
GENESIS = ("In the beginning God created the heaven and the earth. And the earth was without "
           "form, and void; and darkness was upon the face of the deep.")
EXODUS = "Thou shalt not kill. Thou shalt not commit adultery. Thou shalt not steal."


def _struct(**fields: object) -> struct_pb2.Struct:
    struct = struct_pb2.Struct()
    struct.update(fields)
    return struct


def _documents() -> list[pb.Document]:
    return [pb.Document(id="ps23", text=PSALM, metadata=_struct(book="psalms", verse=1.0)),
            pb.Document(id="gen1", text=GENESIS, metadata=_struct(book="genesis")),
            pb.Document(id="ex20", text=EXODUS, metadata=_struct(book="exodus"))]


def _create(stub, name: str, tokens: int = 16, overlap: int = 4) -> pb.CollectionInfo:
    return stub.CreateCollection(pb.CreateCollectionRequest(
        name=name, chunking=pb.ChunkingOptions(chunk_tokens=tokens,
                                               overlap_tokens=overlap))).collection


def _refused(call, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        call(request)
    return refused.value


def test_ingest_then_query_finds_the_relevant_chunk_and_caches_the_answer(
        retriever: Retriever) -> None:
    stub = retriever.stub
    info = _create(stub, "bible")
    assert (info.version, info.dimension, info.chunking.chunk_tokens) == (0, 384, 16)
    assert info.embedding_model == "sentence-transformers/all-MiniLM-L6-v2"
    ingested = stub.Ingest(pb.IngestRequest(collection="bible", documents=_documents()))
    assert ingested.documents == 3 and ingested.version == 1
    assert ingested.chunks == ingested.chunks_embedded > 3  # 16-token windows: several each
    first = stub.Query(pb.QueryRequest(collection="bible", query="sheep in a green meadow",
                                       top_k=2))
    assert first.chunks[0].document_id == "ps23" and first.chunks[0].chunk_id.startswith("ps23#")
    assert first.chunks[0].metadata == _struct(book="psalms", verse=1.0)
    assert 0.2 < first.chunks[0].score <= 1.0 and first.chunks[0].score >= first.chunks[1].score
    assert not first.timing.cache_hit and first.timing.embed_ms > 0 and first.version == 1
    again = stub.Query(pb.QueryRequest(collection="bible", query="  sheep in a green\tmeadow ",
                                       top_k=2))
    assert again.timing.cache_hit and again.timing.embed_ms == again.timing.search_ms == 0
    assert list(again.chunks) == list(first.chunks)
    listed = stub.ListCollections(pb.ListCollectionsRequest()).collections
    assert [(c.name, c.documents, c.chunks) for c in listed if c.name == "bible"] == [
        ("bible", 3, ingested.chunks)]


def test_query_caches_are_scoped_so_one_tenant_never_hits_anothers_work(
        retriever: Retriever) -> None:
    stub = retriever.stub
    _create(stub, "scoped")
    stub.Ingest(pb.IngestRequest(collection="scoped", documents=_documents()))

    def ask(scope: str) -> pb.RetrievalTiming:
        return stub.Query(pb.QueryRequest(collection="scoped", query="who made the earth",
                                          cache_scope=scope)).timing

    assert not ask("tenant-a").cache_hit
    other = ask("tenant-b")  # the same query in another scope: top-k and embedding miss
    assert not other.cache_hit and other.embed_ms > 0
    assert ask("tenant-a").cache_hit
    assert not ask("").cache_hit  # the shared scope is a scope of its own
    assert ask("tenant-b").cache_hit


def test_filter_keeps_k_results_of_the_matching_documents(retriever: Retriever) -> None:
    stub = retriever.stub
    _create(stub, "filtered", tokens=8, overlap=0)
    stub.Ingest(pb.IngestRequest(collection="filtered", documents=_documents()))
    answer = stub.Query(pb.QueryRequest(collection="filtered", query="sheep", top_k=3,
                                        filter=_struct(book="genesis")))
    assert len(answer.chunks) == 3 and {c.document_id for c in answer.chunks} == {"gen1"}
    none = stub.Query(pb.QueryRequest(collection="filtered", query="sheep",
                                      filter=_struct(book="numbers")))
    assert list(none.chunks) == []


def test_replacing_a_document_bumps_the_version_and_reingesting_embeds_nothing(
        retriever: Retriever) -> None:
    stub = retriever.stub
    _create(stub, "replace")
    stub.Ingest(pb.IngestRequest(collection="replace", documents=_documents()))
    before = stub.Query(pb.QueryRequest(collection="replace", query="darkness upon the deep"))
    assert before.chunks[0].document_id == "gen1"
    same = stub.Ingest(pb.IngestRequest(collection="replace", documents=_documents()))
    assert same.chunks_embedded == 0 and same.version == 2
    replaced = stub.Ingest(pb.IngestRequest(collection="replace", documents=[
        pb.Document(id="gen1", text="Shepherds watched their flocks by night.")]))
    assert replaced.chunks == replaced.chunks_embedded == 1 and replaced.version == 3
    after = stub.Query(pb.QueryRequest(collection="replace", query="darkness upon the deep"))
    assert not after.timing.cache_hit and after.version == 3  # the new version misses
    assert "darkness" not in " ".join(c.text for c in after.chunks)
    assert [c.chunk_id for c in after.chunks if c.document_id == "gen1"] == ["gen1#0"]
    stub.DeleteCollection(pb.DeleteCollectionRequest(name="replace"))
    gone = _refused(stub.Query, pb.QueryRequest(collection="replace", query="x"))
    assert gone.code() == grpc.StatusCode.NOT_FOUND and "collection" in gone.details()


def test_deleting_a_document_drops_its_chunks_and_the_cached_answers_that_held_them(
        retriever: Retriever) -> None:
    stub = retriever.stub
    _create(stub, "prune")
    ingested = stub.Ingest(pb.IngestRequest(collection="prune", documents=_documents()))
    ask = pb.QueryRequest(collection="prune", query="darkness upon the deep", top_k=3)
    assert stub.Query(ask).chunks[0].document_id == "gen1"
    assert stub.Query(ask).timing.cache_hit
    deleted = stub.DeleteDocuments(pb.DeleteDocumentsRequest(collection="prune",
                                                             document_ids=["nope", "gen1"]))
    assert (deleted.documents, list(deleted.not_found), deleted.version) == (1, ["nope"], 2)
    after = stub.Query(ask)
    assert not after.timing.cache_hit and after.version == 2 and len(after.chunks) == 3
    assert "gen1" not in {c.document_id for c in after.chunks}
    assert not stub.Query(pb.QueryRequest(collection="prune", query="darkness",
                                          filter=_struct(book="genesis"))).chunks
    info = next(c for c in stub.ListCollections(pb.ListCollectionsRequest()).collections
                if c.name == "prune")
    assert (info.documents, info.chunks) == (2, ingested.chunks - deleted.chunks)
    again = stub.DeleteDocuments(pb.DeleteDocumentsRequest(collection="prune",
                                                           document_ids=["gen1"]))
    assert (again.documents, list(again.not_found), again.version) == (0, ["gen1"], 2)


def test_qdrant_index_serves_ingest_filter_replace_and_delete(tmp_path) -> None:
    """``--index qdrant`` in qdrant-client's local mode (a directory): the same
    answers through the service. One process start (a model load): the reload
    from Qdrant is checked on the store (test_retriever_units.py)."""
    pytest.importorskip("qdrant_client", reason="qdrant-client not installed "
                        "(pip install -e '.[retriever-qdrant]')")
    service = Retriever(tmp_path, "--index", "qdrant", "--qdrant-url", str(tmp_path / "qdrant"),
                        "--save-interval-seconds", "0.2")
    service.start()
    try:
        _create(service.stub, "q", tokens=8, overlap=0)
        service.stub.Ingest(pb.IngestRequest(collection="q", documents=_documents()))
        service.stub.Ingest(pb.IngestRequest(collection="q", documents=[pb.Document(
            id="gen1", text=GENESIS + " Shepherds watched their flocks by night.",
            metadata=_struct(book="genesis"))]))
        sheep = service.stub.Query(pb.QueryRequest(collection="q", query="sheep in a green "
                                                   "meadow", top_k=3))
        assert sheep.chunks[0].document_id == "ps23" and sheep.version == 2
        night = service.stub.Query(pb.QueryRequest(collection="q", query="flocks at night",
                                                   top_k=1)).chunks[0]
        assert night.document_id == "gen1" and "night" in night.text  # the replaced text
        filtered = service.stub.Query(pb.QueryRequest(collection="q", query="sheep", top_k=3,
                                                      filter=_struct(book="genesis")))
        assert len(filtered.chunks) == 3 and {c.document_id for c in filtered.chunks} == {"gen1"}
        deleted = service.stub.DeleteDocuments(pb.DeleteDocumentsRequest(
            collection="q", document_ids=["gen1"]))
        assert (deleted.documents, deleted.version) == (1, 3)
        pruned = service.stub.Query(pb.QueryRequest(collection="q", query="flocks at night"))
        assert pruned.chunks and "gen1" not in {c.document_id for c in pruned.chunks}
        service.stub.DeleteCollection(pb.DeleteCollectionRequest(name="q"))
        assert list(service.stub.ListCollections(pb.ListCollectionsRequest()).collections) == []
    finally:
        service.stop()


@pytest.mark.parametrize(("method", "request_", "code", "field"), [
    ("Query", pb.QueryRequest(collection="nope", query="x"), "NOT_FOUND", "collection"),
    ("Query", pb.QueryRequest(collection="bad", query=" \t"), "INVALID_ARGUMENT", "query"),
    ("Query", pb.QueryRequest(collection="bad", query="x", top_k=101), "INVALID_ARGUMENT",
     "top_k"),
    ("Query", pb.QueryRequest(collection="bad", query="x", filter=_struct(author="moses")),
     "INVALID_ARGUMENT", "filter.author"),
    ("Ingest", pb.IngestRequest(collection="bad", documents=[
        pb.Document(id="ok", text="fine"), pb.Document(id="big", text="a" * (10 << 20))]),
     "INVALID_ARGUMENT", "documents[1].text"),
    ("Ingest", pb.IngestRequest(collection="nope", documents=[pb.Document(id="a", text="b")]),
     "NOT_FOUND", "collection"),
    ("CreateCollection", pb.CreateCollectionRequest(name="../etc"), "INVALID_ARGUMENT", "name"),
    ("CreateCollection", pb.CreateCollectionRequest(name="bad"), "ALREADY_EXISTS", "name"),
    ("CreateCollection", pb.CreateCollectionRequest(
        name="c2", chunking=pb.ChunkingOptions(chunk_tokens=300)), "INVALID_ARGUMENT",
     "chunking"),
    ("DeleteCollection", pb.DeleteCollectionRequest(name="nope"), "NOT_FOUND", "name"),
    ("DeleteDocuments", pb.DeleteDocumentsRequest(collection="nope", document_ids=["ps23"]),
     "NOT_FOUND", "collection"),
    ("DeleteDocuments", pb.DeleteDocumentsRequest(collection="bad"), "INVALID_ARGUMENT",
     "document_ids"),
    ("DeleteDocuments", pb.DeleteDocumentsRequest(collection="bad", document_ids=["ps23", ""]),
     "INVALID_ARGUMENT", "document_ids[1]"),
    ("Embed", pb.EmbedRequest(texts=["ok", ""]), "INVALID_ARGUMENT", "texts[1]"),
])
def test_bad_input_is_a_precise_status_naming_the_field_and_harms_nothing(
        retriever: Retriever, method: str, request_, code: str, field: str) -> None:
    stub = retriever.stub
    if "bad" not in {c.name for c in stub.ListCollections(pb.ListCollectionsRequest()).collections}:
        _create(stub, "bad")
        stub.Ingest(pb.IngestRequest(collection="bad", documents=_documents()))
    refused = _refused(getattr(stub, method), request_)
    assert refused.code().name == code and refused.details().startswith(field)
    if field.endswith(".text"):
        assert "1048576 bytes" in refused.details()  # the limit is in the message
    info = next(c for c in stub.ListCollections(pb.ListCollectionsRequest()).collections
                if c.name == "bad")
    assert (info.documents, info.version) == (3, 1)
    assert stub.Query(pb.QueryRequest(collection="bad", query="thou shalt not steal")
                      ).chunks[0].document_id == "ex20"


def test_through_envoy_a_10_mb_document_gets_the_services_own_message(
        retriever: Retriever, tmp_path) -> None:
    """Envoy's 4 MiB buffer limit answered "Payload Too Large" (RESOURCE_EXHAUSTED)
    before the retriever could say which field is too large and what its limit is."""
    assert retriever.process is not None and retriever.process.grpc_port is not None
    envoy = EnvoyProcess(tmp_path / "envoy", EnvoySettings(
        ingress_port=0, admin_port=0, openai_port=None,
        router_port=retriever.process.grpc_port,  # unused: only the retriever is called
        retriever_port=retriever.process.grpc_port,
        descriptor_path=str(REPO_ROOT / DESCRIPTOR_RELATIVE)))
    envoy.start()
    try:
        with grpc.insecure_channel(envoy.ingress_address,
                                   options=[("grpc.max_send_message_length", 64 << 20)]
                                   ) as channel:
            stub = retriever_pb2_grpc.RetrieverServiceStub(channel)
            _create(stub, "via-envoy")
            big = pb.Document(id="big", text="word " * (2 << 20))  # 10 MiB
            refused = _refused(lambda r: stub.Ingest(r, timeout=60),
                               pb.IngestRequest(collection="via-envoy", documents=[big]))
            assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.details()
            assert refused.details() == (
                "documents[0].text: is 10485760 bytes, over the service's document size "
                "limit of 1048576 bytes")
            stub.Ingest(pb.IngestRequest(collection="via-envoy", documents=_documents()[:1]),
                        timeout=60)
    finally:
        envoy.stop()


def test_a_query_does_not_wait_behind_an_ingest(retriever: Retriever) -> None:
    """Queries embed on their own thread: one asked while an ingest embeds
    ~160 chunks answers in a fraction of the ingest's time."""
    stub = retriever.stub
    _create(stub, "busy")
    stub.Ingest(pb.IngestRequest(collection="busy", documents=_documents()))
    long_text = " ".join(f"Line {i} tells of the number {i * 7}." for i in range(220))
    looked_up = 'cache="chunk_embedding"'
    before = retriever.metric("llmesh:retriever_cache_queries_total", looked_up)
    began = time.monotonic()
    ingest = stub.Ingest.future(pb.IngestRequest(collection="busy", documents=[
        pb.Document(id="scroll", text=long_text)]))
    # Chunked and looked up: its batch is going to the model now.
    deadline = began + 60
    while retriever.metric("llmesh:retriever_cache_queries_total", looked_up) < before + 100:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    asked = time.monotonic()
    answer = stub.Query(pb.QueryRequest(collection="busy", query="a question while it embeds"))
    query_s = time.monotonic() - asked
    assert ingest.result(timeout=300).chunks_embedded > 100
    ingest_s = time.monotonic() - began
    # One thread: the query waited for the whole batch (query_s ≈ ingest_s).
    assert answer.chunks and query_s * 3 < ingest_s, (query_s, ingest_s)


def test_embed_returns_unit_vectors_in_order(retriever: Retriever) -> None:
    answer = retriever.stub.Embed(pb.EmbedRequest(texts=["green pastures", "still waters"]))
    assert answer.model == "sentence-transformers/all-MiniLM-L6-v2"
    assert [len(e.values) for e in answer.embeddings] == [384, 384]
    assert sum(v * v for v in answer.embeddings[0].values) == pytest.approx(1.0, abs=1e-4)
    assert answer.embeddings[0].values != answer.embeddings[1].values
    assert answer.prompt_tokens == 4


def test_health_and_reflection_describe_the_service(retriever: Retriever) -> None:
    address = retriever.process.grpc_address
    listed = subprocess.run(["grpcurl", "-plaintext", address, "list"], capture_output=True,
                            text=True, timeout=30, check=True).stdout.split()
    assert "llmesh.v1.RetrieverService" in listed and "grpc.health.v1.Health" in listed
    assert retriever.metric("llmesh:retriever_collections") >= 1


def test_the_retriever_reads_its_sockets_on_the_poller_thread(retriever: Retriever) -> None:
    # read_on_poller() in its __main__: a call wakes no EventEngine pool thread
    # (gRPC's default: one or more a call; tests/poller_reads.py)
    process = retriever.process
    assert wakeups_per_call(process.pid, process.grpc_address) < MAX_POLLER_WAKEUPS_PER_CALL


def test_restart_brings_collections_back_without_embedding_again(retriever: Retriever) -> None:
    """Last in the module: it restarts the shared process (its second model load).
    Between bind and SERVING a query gets UNAVAILABLE (a client retries), never
    NOT_FOUND for a collection not loaded yet."""
    stub = retriever.stub
    _create(stub, "persisted")
    stub.Ingest(pb.IngestRequest(collection="persisted", documents=_documents()))
    before = stub.Query(pb.QueryRequest(collection="persisted", query="still waters", top_k=3))
    _create(stub, "pruned")  # a deleted document stays deleted across the restart
    stub.Ingest(pb.IngestRequest(collection="pruned", documents=_documents()))
    stub.DeleteDocuments(pb.DeleteDocumentsRequest(collection="pruned", document_ids=["gen1"]))
    deep = pb.QueryRequest(collection="pruned", query="darkness upon the deep", top_k=3)
    pruned = stub.Query(deep)
    retriever.stop()
    retriever.spawn()  # bound, the model still loading: a query is UNAVAILABLE, not NOT_FOUND
    loading = _refused(retriever.stub.Query, pb.QueryRequest(collection="persisted", query="x"))
    assert loading.code() == grpc.StatusCode.UNAVAILABLE and "starting" in loading.details()
    retriever.wait_serving()
    stub = retriever.stub
    info = next(c for c in stub.ListCollections(pb.ListCollectionsRequest()).collections
                if c.name == "persisted")
    assert (info.documents, info.version, info.chunking.chunk_tokens) == (3, 1, 16)
    after = stub.Query(pb.QueryRequest(collection="persisted", query="still waters", top_k=3))
    assert [(c.chunk_id, c.text) for c in after.chunks] == [
        (c.chunk_id, c.text) for c in before.chunks]
    info = next(c for c in stub.ListCollections(pb.ListCollectionsRequest()).collections
                if c.name == "pruned")
    assert (info.documents, info.version) == (2, 2)
    assert [c.chunk_id for c in stub.Query(deep).chunks] == [c.chunk_id for c in pruned.chunks]
    assert "gen1" not in {c.document_id for c in pruned.chunks}
    again = stub.Ingest(pb.IngestRequest(collection="persisted", documents=_documents()))
    assert again.chunks_embedded == 0 and again.version == 2
    assert retriever.metric("llmesh:retriever_embedded_texts_total", 'caller="ingest"') == 0
