"""Units of the retriever without the model: chunker, caches, indexes, collection, requests."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from google.protobuf import struct_pb2
from llmesh.v1 import retriever_pb2

from services.retriever import index as index_module
from services.retriever.__main__ import build_parser, make_backend
from services.retriever.caches import (
    EmbeddingCache,
    LruCache,
    content_hash,
    normalise_query,
)
from services.retriever.chunker import Chunking, chunk_text
from services.retriever.collection import Collection, PreparedDocument, UnknownFilterField
from services.retriever.index import FILE_BACKENDS, IndexBackend, UsearchIndex, top_k
from services.retriever.requests import (
    InvalidField,
    Limits,
    parse_document_ids,
    parse_documents,
    parse_query,
)
from services.retriever.store import CollectionStore


class WordTokenizer:
    """Whitespace tokens with their character spans (the shape of a HF fast tokenizer's)."""

    def __call__(self, text: str, *, add_special_tokens: bool,
                 return_offsets_mapping: bool) -> dict[str, list]:
        spans, start = [], None
        for i, char in enumerate(text + " "):
            if char.isspace() and start is not None:
                spans.append((start, i))
                start = None
            elif not char.isspace() and start is None:
                start = i
        return {"input_ids": list(range(len(spans))), "offset_mapping": spans}


def _unit(rows: np.ndarray) -> np.ndarray:
    return (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float32)


# chunker ----------------------------------------------------------------------

@pytest.mark.parametrize(("text", "expected"), [
    ("a b c d e f g h i j", ["a b c d", "d e f g", "g h i j"]),
    ("a b c d", ["a b c d"]),
    ("a b c d e", ["a b c d", "d e"]),
    ("a", ["a"]),
    ("   ", []),
])
def test_chunks_are_token_windows_with_overlap(text: str, expected: list[str]) -> None:
    assert chunk_text(text, WordTokenizer(), Chunking(4, 1)) == expected


def test_chunk_keeps_the_documents_spelling_between_its_tokens() -> None:
    assert chunk_text("One  Two\nthree", WordTokenizer(), Chunking(2, 0)) == ["One  Two", "three"]


@pytest.mark.parametrize(("tokens", "overlap"), [(0, 0), (255, 0), (8, 8), (8, 9)])
def test_chunking_sizes_out_of_range_are_refused(tokens: int, overlap: int) -> None:
    with pytest.raises(ValueError):
        Chunking(tokens, overlap)


# caches -------------------------------------------------------------------------

def test_content_hash_covers_model_and_text() -> None:
    assert content_hash("m", "text") == content_hash("m", "text")
    assert content_hash("m", "text") != content_hash("n", "text")
    assert content_hash("m", "text") != content_hash("m", "text ")


def test_query_normalisation_trims_and_collapses_whitespace() -> None:
    assert normalise_query("  who   made\tthe\nworld ") == "who made the world"


def test_lru_evicts_least_recent_and_drops_by_predicate() -> None:
    cache: LruCache[str, int] = LruCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # "b" is now least recent
    cache.put("c", 3)
    assert (cache.get("a"), cache.get("b"), cache.get("c")) == (1, None, 3)
    assert cache.drop(lambda key: key == "a") == 1
    assert len(cache) == 1
    off: LruCache[str, int] = LruCache(0)
    off.put("a", 1)
    assert off.get("a") is None


def test_embedding_cache_keeps_pinned_vectors_and_moves_the_last_unpin_to_the_lru() -> None:
    cache = EmbeddingCache(capacity=1)
    vector = np.ones(3, dtype=np.float32)
    cache.pin("h", vector)
    cache.pin("h", vector)
    cache.unpin("h")
    cache.pin("other", vector)
    cache.unpin("other")  # loose: fills the LRU of 1
    assert cache.get("h") is vector  # still pinned once
    cache.unpin("h")  # loose now, evicts "other"
    assert cache.get("h") is vector and cache.get("other") is None


# indexes --------------------------------------------------------------------------

def _qdrant_backend() -> IndexBackend:
    """qdrant-client's embedded local mode (the same client API as a server's,
    exact search); skipped without the ``retriever-qdrant`` extra."""
    pytest.importorskip("qdrant_client", reason="qdrant-client not installed "
                        "(pip install -e '.[retriever-qdrant]')")
    from services.retriever.qdrant_index import QdrantBackend
    return QdrantBackend(":memory:")


@pytest.fixture(params=["exact", "usearch", "qdrant"])
def backend(request: pytest.FixtureRequest) -> IndexBackend:
    """Every index backend, behind the one interface the store uses."""
    return _qdrant_backend() if request.param == "qdrant" else FILE_BACKENDS[request.param]


def test_index_finds_the_exact_neighbours_and_forgets_removed_ones(backend: IndexBackend,
                                                                   tmp_path) -> None:
    rng = np.random.default_rng(0)
    vectors = _unit(rng.standard_normal((300, 16)))
    labels = np.arange(300, dtype=np.int64) * 7
    index = backend.create("c", 16)
    index.add(labels, vectors)
    query = vectors[5]
    exact = top_k(labels, vectors, query, 10)
    assert [label for label, _ in index.search(query, 10)] == [label for label, _ in exact]
    assert index.search(query, 1)[0][1] == pytest.approx(1.0, abs=1e-5)
    index.remove([35])
    assert 35 not in [label for label, _ in index.search(query, 10)]
    assert len(index) == 299
    allowed = {int(label) for label in labels[100:140]}
    filtered = index.search(query, 10, allowed)
    assert len(filtered) == 10 and {label for label, _ in filtered} <= allowed
    index.add(labels[:1], vectors[1:2])  # a label added again replaces its vector
    assert index.search(vectors[1], 2)[0][1] == pytest.approx(1.0, abs=1e-5)
    assert len(index) == 299 and index.labels() == {int(label) for label in labels} - {35}
    assert index.search(query, 10, set()) == [] and index.search(query, 0) == []
    index.save(tmp_path / "index")
    loaded = backend.load(tmp_path / "index", "c", 16)
    assert loaded.dimension == 16
    assert loaded.search(query, 10) == index.search(query, 10)
    np.testing.assert_allclose(loaded.vector(0), vectors[1], atol=1e-6)
    with pytest.raises(KeyError):
        loaded.vector(35)


def test_usearch_filtered_search_returns_k_when_the_filter_keeps_few_of_many(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Above the exact-scan size the ANN over-fetches until k allowed labels come back."""
    monkeypatch.setattr(index_module, "EXACT_FILTER_MAX", 16)
    rng = np.random.default_rng(1)
    vectors = _unit(rng.standard_normal((800, 8)))
    index = UsearchIndex(8)
    index.add(np.arange(800), vectors)
    allowed = set(range(0, 800, 8))  # 100 of 800: over-fetch, not the exact scan
    hits = index.search(vectors[1], 10, allowed)
    assert len(hits) == 10 and all(label % 8 == 0 for label, _ in hits)
    exact = top_k(np.arange(0, 800, 8), vectors[::8], vectors[1], 10)
    assert len({label for label, _ in hits} & {label for label, _ in exact}) >= 9


# collection ---------------------------------------------------------------------------

def _document(doc_id: str, rows: np.ndarray, **metadata: object) -> PreparedDocument:
    texts = [f"{doc_id} chunk {i}" for i in range(len(rows))]
    return PreparedDocument(doc_id, metadata, texts, [content_hash("m", t) for t in texts],
                            _unit(rows))


def test_collection_replaces_a_document_and_filters_by_metadata(backend: IndexBackend) -> None:
    collection = Collection("c", Chunking(4, 1), backend.create("c", 2))
    added, removed = collection.replace([
        _document("a", np.array([[1.0, 0.0], [0.9, 0.1]]), lang="en", year=1611.0),
        _document("b", np.array([[0.0, 1.0]]), lang="de", flag=True)])
    assert (len(added), removed, collection.version) == (3, [], 1)
    query = np.array([1.0, 0.0], dtype=np.float32)
    assert [hit.chunk.chunk_id for hit in collection.search(query, 3)] == ["a#0", "a#1", "b#0"]
    assert [h.chunk.chunk_id for h in collection.search(query, 3, {"lang": "de"})] == ["b#0"]
    assert collection.search(query, 3, {"flag": 1.0}) == []  # True is not 1
    added, removed = collection.replace([_document("a", np.array([[0.0, 1.0]]), lang="fr")])
    assert [c.chunk_id for c in removed] == ["a#0", "a#1"] and collection.version == 2
    assert [h.chunk.chunk_id for h in collection.search(query, 5)] == ["b#0", "a#0"]
    with pytest.raises(UnknownFilterField) as unknown:
        collection.search(query, 3, {"year": 1611.0})  # only the replaced "a" had it
    assert unknown.value.field == "year"


def test_deleting_documents_removes_their_vectors_postings_and_saved_state(
        backend: IndexBackend, tmp_path) -> None:
    """A delete takes the documents out of the index, the chunks and the
    metadata postings, bumps the version once, reports unknown ids; the saved
    collection reloads without them."""
    store = CollectionStore(tmp_path, backend, 2)
    collection = store.create("c", Chunking(4, 1))
    collection.replace([_document("a", np.array([[1.0, 0.0], [0.9, 0.1]]), lang="en"),
                        _document("b", np.array([[0.0, 1.0]]), lang="de")])
    deleted, removed, absent = collection.delete(["zz", "a"])
    assert (deleted, [c.chunk_id for c in removed], absent) == (["a"], ["a#0", "a#1"], ["zz"])
    assert collection.version == 2 and sorted(collection.documents) == ["b"]
    assert collection.index.labels() == {2} and sorted(collection.chunks) == [2]
    query = np.array([1.0, 0.0], dtype=np.float32)
    assert [hit.chunk.chunk_id for hit in collection.search(query, 5)] == ["b#0"]
    assert collection.search(query, 5, {"lang": "en"}) == []  # the posting went with "a"
    assert collection.delete(["a"]) == ([], [], ["a"]) and collection.version == 2
    store.mark_dirty("c")
    store.save_dirty()
    reloaded = CollectionStore(tmp_path, backend, 2).load_all()[0]
    assert sorted(reloaded.documents) == ["b"] and reloaded.index.labels() == {2}
    assert [hit.chunk.chunk_id for hit in reloaded.search(query, 5)] == ["b#0"]


def test_a_failing_index_leaves_the_collection_consistent_with_it(backend: IndexBackend,
                                                                 monkeypatch) -> None:
    """A remote index can fail mid-ingest: the collection changes its state only
    after the index did, and bumps the version when anything changed."""
    collection = Collection("c", Chunking(4, 1), backend.create("c", 2))
    collection.replace([_document("a", np.array([[1.0, 0.0]]), lang="en")])

    def unreachable(labels: np.ndarray, vectors: np.ndarray) -> None:
        raise ConnectionError("index down")

    monkeypatch.setattr(collection.index, "add", unreachable)
    with pytest.raises(ConnectionError):
        collection.replace([_document("a", np.array([[0.0, 1.0]]), lang="de")])
    assert collection.version == 2 and collection.documents == {}
    assert collection.index.labels() == set() and collection.chunks == {}
    with pytest.raises(UnknownFilterField):
        collection.search(np.array([1.0, 0.0], dtype=np.float32), 3, {"lang": "en"})


def test_qdrant_store_reconciles_the_server_with_the_saved_documents(tmp_path) -> None:
    """Qdrant is written as changes happen, the JSON every save interval: after a
    crash the load drops what the JSON does not list and the documents whose
    vectors the server no longer has. Creating a collection again empties it;
    deleting one deletes the Qdrant collection."""
    backend = _qdrant_backend()
    store = CollectionStore(tmp_path, backend, 2)
    collection = store.create("c", Chunking(4, 1))
    collection.replace([_document("a", np.array([[1.0, 0.0]])),
                        _document("b", np.array([[0.0, 1.0]]))])
    store.mark_dirty("c")
    store.save_dirty()
    # after the save, unsaved: "a" replaced (its saved vector deleted), "c" added
    collection.replace([_document("a", np.array([[0.6, 0.8]])),
                        _document("c", np.array([[0.8, 0.6]]))])
    restarted = CollectionStore(tmp_path, backend, 2)  # the crash's restart
    reloaded = restarted.load_all()[0]
    assert restarted.save_dirty() == ["c"]  # the JSON forgets "a" too
    assert sorted(reloaded.documents) == ["b"] and reloaded.index.labels() == {1}
    query = np.array([1.0, 0.0], dtype=np.float32)
    assert [hit.chunk.chunk_id for hit in reloaded.search(query, 5)] == ["b#0"]
    assert len(store.create("c", Chunking(4, 1)).index) == 0
    store.delete("c")
    assert not backend.client.collection_exists(backend.collection_name("c"))


@pytest.mark.parametrize("flags", [
    ["--index", "qdrant"], ["--qdrant-url", ":memory:"],
    ["--index", "qdrant", "--qdrant-url", ":memory:", "--data-dir", "d"]])
def test_qdrant_flags_come_together(flags: list[str]) -> None:
    with pytest.raises(ValueError, match="--qdrant-url"):
        make_backend(build_parser().parse_args(flags))


# requests -----------------------------------------------------------------------------

def test_query_validation_names_the_field() -> None:
    limits = Limits(max_top_k=10)
    for request, field in [
        (retriever_pb2.QueryRequest(collection="c", query=" \n "), "query"),
        (retriever_pb2.QueryRequest(collection="c", query="q", top_k=11), "top_k"),
        (retriever_pb2.QueryRequest(collection="no/slash", query="q"), "collection"),
        (retriever_pb2.QueryRequest(collection="c", query="q", filter=struct_pb2.Struct(
            fields={"tags": struct_pb2.Value(list_value=struct_pb2.ListValue())})),
         "filter.tags"),
        (retriever_pb2.QueryRequest(collection="c", query="q", cache_scope="s" * 129),
         "cache_scope"),
    ]:
        with pytest.raises(InvalidField) as refused:
            parse_query(request, limits)
        assert refused.value.field == field
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    spec = parse_query(retriever_pb2.QueryRequest(collection="c", query=" a  b "), limits)
    assert (spec.query, spec.top_k, spec.cache_scope) == ("a b", limits.default_top_k, "")


def test_ingest_validation_names_the_document() -> None:
    limits = Limits(max_document_bytes=10)
    for documents, field in [
        ([retriever_pb2.Document(id="a", text="x" * 11)], "documents[0].text"),
        ([retriever_pb2.Document(id="a", text="ok"),
          retriever_pb2.Document(id="", text="ok")], "documents[1].id"),
        ([retriever_pb2.Document(id="a", text="ok"),
          retriever_pb2.Document(id="a", text="ok")], "documents[1].id"),
        ([retriever_pb2.Document(id="a", text="  ")], "documents[0].text"),
    ]:
        with pytest.raises(InvalidField) as refused:
            parse_documents(retriever_pb2.IngestRequest(collection="c", documents=documents),
                            limits)
        assert refused.value.field == field


def test_delete_documents_validation_names_the_id() -> None:
    for ids, field in [([], "document_ids"), (["a", ""], "document_ids[1]"),
                       (["a", "b", "a"], "document_ids[2]"), (["x" * 513], "document_ids[0]")]:
        with pytest.raises(InvalidField) as refused:
            parse_document_ids(retriever_pb2.DeleteDocumentsRequest(collection="c",
                                                                    document_ids=ids))
        assert refused.value.field == field
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert parse_document_ids(retriever_pb2.DeleteDocumentsRequest(
        collection="c", document_ids=["b", "a"])) == ["b", "a"]
