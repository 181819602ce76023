"""Retrieval benchmark (issue 35): the retriever service on the KJV corpus at ~21k chunks.

One run starts ``python -m services.retriever`` on a persistent data
directory (``--data-dir``, default ``~/.cache/llmesh/retrieval-bench``), makes
sure the collection ``kjv`` holds the corpus (``benchmarks/data/kjv_chapters.jsonl.gz``,
1,189 chapters cut into 64-token chunks with 16 shared: 21,127 chunks; the
first run embeds all of it, which takes minutes on 2 cores; later runs find
it persisted and embed nothing), then runs the parts asked (``--parts``, in
order, each a function of :data:`PARTS`):

* ``ingest``: embedding throughput at ingestion: ``--ingest-chapters``
  chapters, each text prefixed with a fresh nonce (so the embedding cache
  misses), into a scratch collection; chunks/s and tokens/s from the
  service's ``Ingest`` wall time.
* ``ann``: recall@10 of each ANN library against exact search (numpy, the
  same vectors) for ``--queries`` query embeddings, and its search latency
  p50/p99 in process: usearch (the service's index, loaded from the data
  directory), hnswlib and faiss-cpu ``IndexHNSWFlat`` built with the same M=16,
  efConstruction=128, ef=128 (those two skipped when not installed:
  ``pip install '.[bench-ann]'``).
* ``query``: ``Query`` latency over gRPC, p50/p99, for ``--queries`` distinct
  queries never asked before (cold: query embedding + search) and the same
  queries again (cached top-k); client wall time and the service's own
  ``timing.total_ms`` and ``embed_ms``; then the cold answers' top-10
  agreement with the same index searched with fp32 query vectors (``Embed``)
  and their recall@10 against exact fp32 search (what ``--query-precision``,
  passed to the service, costs in quality).
* ``e2e``: TTFT through Envoy of a RAG chat request (``retrieval`` on
  ``kjv``, top_k 3) vs the same prompt with the passages pasted by the
  client, interleaved, ``--e2e-rounds`` rounds, p50/p99, on a mesh started
  for the part whose router queries this retriever
  (``benchmarks/retrieval_e2e.py``; ``--engine-arg`` passes engine flags).

Queries are 6-word phrases from random verses (seeded), asked with top_k 10.
Prints each part's numbers with the load average before and after. Usage::

    flock -x /tmp/llmesh-cpu.lock python benchmarks/retrieval.py [--parts ingest,ann,query]

Not a test: numbers depend on the machine (2 cores here).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from llmesh.v1 import retriever_pb2 as pb
from llmesh.v1 import retriever_pb2_grpc

from services.cli.mesh import REPO_ROOT, ServiceProcess, child_env, stop_processes
from services.retriever.collection import Collection
from services.retriever.index import FILE_BACKENDS, top_k
from services.retriever.store import CollectionStore

CORPUS = REPO_ROOT / "benchmarks" / "data" / "kjv_chapters.jsonl.gz"
COLLECTION = "kjv"
CHUNKING = pb.ChunkingOptions(chunk_tokens=64, overlap_tokens=16)
DIMENSION = 384
K = 10
#: Longer than the service's --save-interval-seconds (2).
SAVE_WAIT_S = 4.0
#: HNSW parameters given to every library (usearch's are the service's defaults).
HNSW_M, HNSW_EF_CONSTRUCTION, HNSW_EF_SEARCH = 16, 128, 128


@dataclass
class Bench:
    """What the parts share: the flags, the running service, the corpus, the queries."""

    args: argparse.Namespace
    stub: retriever_pb2_grpc.RetrieverServiceStub
    chapters: list[dict]
    queries: list[str] = field(default_factory=list)
    #: ``host:port`` of the retriever (the e2e part's router calls it).
    address: str = ""


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summary(values_ms: list[float]) -> str:
    return (f"p50 {percentile(values_ms, 0.5):.3f} ms, p99 {percentile(values_ms, 0.99):.3f} ms "
            f"(n={len(values_ms)})")


def load() -> str:
    return "load average " + " ".join(f"{value:.2f}" for value in os.getloadavg())


def read_corpus() -> list[dict]:
    with gzip.open(CORPUS, "rt") as source:
        return [json.loads(line) for line in source]


def make_queries(chapters: list[dict], count: int, seed: int) -> list[str]:
    """``count`` distinct 6-word phrases from random places of the corpus."""
    rng = random.Random(seed)
    queries: dict[str, None] = {}
    while len(queries) < count:
        words = rng.choice(chapters)["text"].split()
        start = rng.randrange(max(1, len(words) - 6))
        queries[" ".join(words[start:start + 6])] = None
    return list(queries)


def documents(chapters: list[dict], prefix: str = "") -> list[pb.Document]:
    out = []
    for chapter in chapters:
        metadata = pb.Document().metadata
        metadata.update({"book": chapter["book"], "testament": chapter["testament"],
                         "chapter": float(chapter["chapter"])})
        out.append(pb.Document(id=chapter["id"], text=prefix + chapter["text"],
                               metadata=metadata))
    return out


def ensure_corpus(bench: Bench) -> None:
    """Creates and fills ``kjv`` unless it holds the whole corpus already."""
    listed = {c.name: c for c in
              bench.stub.ListCollections(pb.ListCollectionsRequest()).collections}
    if COLLECTION in listed and listed[COLLECTION].documents >= len(bench.chapters):
        print(f"corpus: {listed[COLLECTION].chunks} chunks in {COLLECTION!r} (persisted)")
        return
    if COLLECTION not in listed:
        bench.stub.CreateCollection(pb.CreateCollectionRequest(name=COLLECTION, chunking=CHUNKING))
    began, embedded, chunks = time.perf_counter(), 0, 0
    for start in range(0, len(bench.chapters), 40):
        done = bench.stub.Ingest(pb.IngestRequest(
            collection=COLLECTION, documents=documents(bench.chapters[start:start + 40])))
        embedded += done.chunks_embedded
        chunks += done.chunks
        print(f"  ingested {start + 40}/{len(bench.chapters)} chapters, {chunks} chunks "
              f"({embedded} embedded), {time.perf_counter() - began:.0f} s", flush=True)
    print(f"corpus: {chunks} chunks ingested in {time.perf_counter() - began:.0f} s")
    time.sleep(SAVE_WAIT_S)  # the service saves changed collections every 2 s (part ann reads them)


def part_ingest(bench: Bench) -> None:
    """Embedding throughput at ingestion (cache misses forced by a nonce)."""
    name = f"scratch-{uuid.uuid4().hex[:8]}"
    bench.stub.CreateCollection(pb.CreateCollectionRequest(name=name, chunking=CHUNKING))
    sample = random.Random(1).sample(bench.chapters, bench.args.ingest_chapters)
    try:
        began = time.perf_counter()
        done = bench.stub.Ingest(pb.IngestRequest(
            collection=name, documents=documents(sample, f"{uuid.uuid4().hex} ")))
        seconds = time.perf_counter() - began
    finally:
        bench.stub.DeleteCollection(pb.DeleteCollectionRequest(name=name))
    tokens = done.chunks_embedded * CHUNKING.chunk_tokens  # at most; the tails are shorter
    print(f"ingest: {done.documents} chapters, {done.chunks_embedded} chunks embedded in "
          f"{seconds:.1f} s: {done.chunks_embedded / seconds:.1f} chunks/s "
          f"(≤ {tokens / seconds:.0f} tokens/s)")


def _fp32_setting(bench: Bench) -> tuple[Collection, np.ndarray, np.ndarray, np.ndarray]:
    """The collection as persisted (its usearch index), its labels ``[n]`` and vectors
    ``[n, 384]``, and the queries' fp32 embeddings (``Embed``) ``[queries, 384]``."""
    store = CollectionStore(bench.args.data_dir, FILE_BACKENDS["usearch"], DIMENSION)
    collection = {c.name: c for c in store.load_all()}[COLLECTION]
    labels = np.array(sorted(collection.chunks), dtype=np.int64)
    vectors = np.stack([collection.index.vector(int(label)) for label in labels])
    answer = bench.stub.Embed(pb.EmbedRequest(texts=bench.queries))
    queries = np.array([list(e.values) for e in answer.embeddings], dtype=np.float32)
    return collection, labels, vectors, queries


def part_ann(bench: Bench) -> None:
    """Recall@10 against exact search and search latency, per ANN library."""
    collection, labels, vectors, queries = _fp32_setting(bench)
    exact = [{label for label, _ in top_k(labels, vectors, q, K)} for q in queries]
    print(f"ann: {len(labels)} vectors of {DIMENSION}, {len(queries)} queries, k={K}, "
          f"M={HNSW_M} efConstruction={HNSW_EF_CONSTRUCTION} ef={HNSW_EF_SEARCH}")
    searchers: dict[str, Callable[[np.ndarray], list[int]]] = {
        "exact (numpy)": lambda q: [label for label, _ in top_k(labels, vectors, q, K)],
        "usearch": lambda q: [label for label, _ in collection.index.search(q, K)],
    }
    searchers.update(_other_libraries(labels, vectors))
    recalls: dict[str, list[float]] = {name: [] for name in searchers}
    times: dict[str, list[float]] = {name: [] for name in searchers}
    names = list(searchers)
    for turn, (query, truth) in enumerate(zip(queries, exact, strict=True)):
        # Interleaved: every library answers each query, the order rotating.
        for name in names[turn % len(names):] + names[:turn % len(names)]:
            began = time.perf_counter()
            found = searchers[name](query)
            times[name].append((time.perf_counter() - began) * 1e3)
            recalls[name].append(len(truth & set(found)) / K)
    for name in names:
        print(f"  {name:14s} recall@10 {statistics.mean(recalls[name]):.4f}, "
              f"search {summary(times[name])}")


def _other_libraries(labels: np.ndarray, vectors: np.ndarray
                     ) -> dict[str, Callable[[np.ndarray], list[int]]]:
    """hnswlib and faiss HNSW on the same vectors, where installed (build time printed)."""
    built: dict[str, Callable[[np.ndarray], list[int]]] = {}
    try:
        import hnswlib
        began = time.perf_counter()
        hnsw = hnswlib.Index(space="ip", dim=DIMENSION)
        hnsw.init_index(max_elements=len(labels), M=HNSW_M, ef_construction=HNSW_EF_CONSTRUCTION)
        hnsw.add_items(vectors, labels, num_threads=1)
        hnsw.set_ef(HNSW_EF_SEARCH)
        print(f"  hnswlib built in {time.perf_counter() - began:.1f} s")
        built["hnswlib"] = lambda q: [int(x) for x in hnsw.knn_query(q, k=K)[0][0]]
    except ImportError:
        print("  hnswlib: not installed")
    try:
        import faiss
        began = time.perf_counter()
        faiss.omp_set_num_threads(1)
        flat = faiss.IndexHNSWFlat(DIMENSION, HNSW_M, faiss.METRIC_INNER_PRODUCT)
        flat.hnsw.efConstruction = HNSW_EF_CONSTRUCTION
        flat.add(vectors)
        flat.hnsw.efSearch = HNSW_EF_SEARCH
        print(f"  faiss built in {time.perf_counter() - began:.1f} s")
        built["faiss HNSWFlat"] = lambda q: [int(labels[i]) for i in flat.search(q[None], K)[1][0]]
    except ImportError:
        print("  faiss-cpu: not installed")
    return built


def part_query(bench: Bench) -> None:
    """Query latency over gRPC: cold (embedding + search), then cached; then how the
    cold answers (the service's query encoder, ``--query-precision``) agree with
    the same index searched with fp32 query vectors (``Embed``), and their
    recall@10 against exact search with fp32 vectors."""
    found: list[list[str]] = []
    for label in ("cold", "cached"):
        wall, served, embed, hits = [], [], [], 0
        for query in bench.queries:
            began = time.perf_counter()
            answer = bench.stub.Query(pb.QueryRequest(collection=COLLECTION, query=query, top_k=K))
            wall.append((time.perf_counter() - began) * 1e3)
            served.append(answer.timing.total_ms)
            embed.append(answer.timing.embed_ms)
            hits += answer.timing.cache_hit
            if label == "cold":
                found.append([chunk.chunk_id for chunk in answer.chunks])
        print(f"query {label}: client {summary(wall)}; service {summary(served)}; "
              f"embed {summary(embed)}; cache hits {hits}/{len(bench.queries)}")
    _query_agreement(bench, found)


def _query_agreement(bench: Bench, found: list[list[str]]) -> None:
    collection, labels, vectors, queries = _fp32_setting(bench)
    agree, recall, recall_fp32 = [], [], []
    for ids, query in zip(found, queries, strict=True):
        fp32 = {hit.chunk.chunk_id for hit in collection.search(query, K, {})}
        exact = {collection.chunks[int(label)].chunk_id
                 for label, _ in top_k(labels, vectors, query, K)}
        agree.append(len(fp32 & set(ids)) / K)
        recall.append(len(exact & set(ids)) / K)
        recall_fp32.append(len(exact & fp32) / K)
    print(f"query encoder vs fp32 query vectors: top-{K} agreement "
          f"{statistics.mean(agree):.4f} (same index); recall@{K} against exact fp32 search "
          f"{statistics.mean(recall):.4f} (fp32 queries through the index: "
          f"{statistics.mean(recall_fp32):.4f})")


def part_e2e(bench: Bench) -> None:
    """TTFT with retrieval vs the passages pasted, through Envoy (retrieval_e2e.py)."""
    from retrieval_e2e import e2e_part  # beside this file (on sys.path when run as a script)

    e2e_part(bench.address, [f"What does the text say about {q}?" for q in bench.queries],
             collection=COLLECTION, rounds=bench.args.e2e_rounds,
             engine_args=bench.args.engine_arg)


#: The parts, in the order ``--parts`` runs them by default.
PARTS: dict[str, Callable[[Bench], None]] = {
    "ingest": part_ingest,
    "ann": part_ann,
    "query": part_query,
    "e2e": part_e2e,
}


def start_retriever(data_dir: Path, run_dir: Path, *flags: str) -> ServiceProcess:
    """The retriever on ``data_dir`` with ``flags``, SERVING (waits for the model and
    the load)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    port_file = run_dir / "retriever.json"
    service = ServiceProcess("retriever", [
        sys.executable, "-m", "services.retriever", "--port", "0", "--metrics-port", "0",
        "--port-file", str(port_file), "--data-dir", str(data_dir), *flags],
        "127.0.0.1", run_dir / "retriever.log", port_file)
    service.spawn(child_env(), REPO_ROOT)
    deadline = time.monotonic() + 600
    while not service.read_port_file():
        if service.exit_code() is not None or time.monotonic() > deadline:
            raise service.failure("did not start")
        time.sleep(0.2)
    with grpc.insecure_channel(service.grpc_address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while health.Check(health_pb2.HealthCheckRequest(), timeout=10).status \
                != health_pb2.HealthCheckResponse.SERVING:
            if service.exit_code() is not None or time.monotonic() > deadline:
                raise service.failure("did not serve")
            time.sleep(0.2)
    return service


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated, from {', '.join(PARTS)}")
    parser.add_argument("--data-dir", type=Path,
                        default=Path.home() / ".cache" / "llmesh" / "retrieval-bench")
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--ingest-chapters", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--e2e-rounds", type=int, default=30)
    parser.add_argument("--engine-arg", action="append", default=[],
                        help="e2e: an engine flag (repeat), e.g. --engine-arg=--kv-cache-bytes "
                             "--engine-arg=268435456 where memory is short")
    parser.add_argument("--query-precision", default="bf16",
                        help="the retriever's --query-precision (fp32, bf16, int8-weights, int8)")
    parser.add_argument("--chapters", type=int, default=None,
                        help="use the first N chapters only (default: all 1,189, ~21k chunks)")
    args = parser.parse_args()
    parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    unknown = [part for part in parts if part not in PARTS]
    if unknown:
        parser.error(f"unknown parts {unknown}; choose from {list(PARTS)}")
    print(f"started {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, {load()}", flush=True)
    service = start_retriever(args.data_dir, args.data_dir.parent / "retrieval-bench-run",
                              "--query-precision", args.query_precision)
    print(f"retriever --query-precision {args.query_precision}", flush=True)
    try:
        with grpc.insecure_channel(service.grpc_address) as channel:
            chapters = read_corpus()[:args.chapters]
            bench = Bench(args, retriever_pb2_grpc.RetrieverServiceStub(channel), chapters,
                          make_queries(chapters, args.queries, args.seed),
                          service.grpc_address)
            ensure_corpus(bench)
            for part in parts:
                print(f"-- {part} ({load()})", flush=True)
                PARTS[part](bench)
    finally:
        assert service.process is not None
        stop_processes([service.process], 30.0)
    print(f"finished, {load()}")


if __name__ == "__main__":
    main()
