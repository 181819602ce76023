"""What retrieval adds to TTFT: a RAG request through Envoy vs the same prompt
with the passages pasted by the client.

The end-to-end part of the retrieval benchmark: ``benchmarks/retrieval.py
--parts e2e`` calls :func:`e2e_part` with its retriever (the KJV collection,
~21k chunks) and its queries, on a mesh started here whose router points at
that retriever. This file also runs alone: a mesh with the retriever
(``llmesh up --retrieval``, free ports, one engine) and a collection
ingested from ``--corpus`` (a JSON list of ``{"prompt": text}`` or a JSONL
file of ``{"id", "text"}``; default ``benchmarks/data/spec_passages.json``).
Each round asks one question (unique per round, so the retriever has not
seen it) three ways, greedy,
``--max-tokens`` tokens, each with its own ``cache_salt`` (no prefix-cache or
response-cache hit between them: every prompt is prefilled whole):

* **rag-cold**: ``retrieval`` with a query the retriever has not seen
  (embedding + ANN search + the router's placement);
* then, in an order that flips every round:
  **rag-cached**: the same request again, its top-k put in the retriever's
  cache just before by a direct ``Query`` in the request's cache scope (the
  retriever's caches are scoped by tenant and ``cache_salt``, and each way
  has its own salt);
  **pasted**: the same prompt with the passages message the rag-cold
  answer returned (``retrieval.passages_message``) pasted by the client, no
  ``retrieval``: byte-for-byte the prompt the router built.

TTFT is seconds from sending ``Generate`` through Envoy's ingress to the
first message with tokens. Prints p50/p99 per way, the medians of the
router's ``retrieval_latency`` (``call_ms``, ``wait_ms``), TTFT(rag) −
TTFT(pasted) at p50 against the target (≤ 15 ms), and the load average
before and after.

**Under load** (``--load K``): the router runs ``--slots`` requests at a
time (``--max-running-per-replica``) and K client threads keep its queue
full with plain requests (a short prompt, ``--load-tokens`` tokens each,
``bypass_cache``); each round then sends ``--concurrent`` rag-cold requests
at once. Prints their TTFT p50/p99, the router's retrieval call and wait
medians, and the load average. This is where the router's overlap shows: a
RAG request queues for its slot while its Query runs (TTFT about
max(queue wait, retrieval), not the sum).

Usage: ``flock -x /tmp/llmesh-cpu.lock python benchmarks/retrieval_e2e.py
[--rounds 30] [--top-k 3] [--max-tokens 2] [--corpus FILE] [--engine-arg=...]
[--load K [--slots 2] [--concurrent 4] [--load-tokens 16]]``. Not a test:
numbers depend on the machine (2 cores here).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]

from llmesh.v1 import (  # noqa: E402
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    retriever_pb2,
    retriever_pb2_grpc,
)
from services.cli.mesh import Mesh  # noqa: E402
from services.common.cache_scope import resolve  # noqa: E402

DEFAULT_CORPUS = Path(__file__).resolve().parent / "data" / "spec_passages.json"
COLLECTION = "bench-e2e"
SYSTEM = ("You answer questions about the passages you are given, in one short sentence. "
          "If the passages do not hold the answer, say so.")
#: Target: what retrieval may add to TTFT (issue 35), milliseconds.
TARGET_MS = 15.0


@dataclass
class Samples:
    """TTFTs (ms) of one way, and the router's retrieval latency of each."""

    ttft_ms: list[float] = field(default_factory=list)
    call_ms: list[float] = field(default_factory=list)
    wait_ms: list[float] = field(default_factory=list)


def load_corpus(path: Path) -> list[retriever_pb2.Document]:
    """Documents from a JSON list of ``{"prompt"}`` or a JSONL of ``{"id", "text"}``."""
    text = path.read_text()
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        return [retriever_pb2.Document(id=str(r["id"]), text=r["text"]) for r in rows]
    return [retriever_pb2.Document(id=f"doc-{i}", text=r["prompt"])
            for i, r in enumerate(json.loads(text))]


def questions(documents: Sequence[retriever_pb2.Document]) -> list[str]:
    """One question per sentence of 8..30 words in the corpus."""
    out = []
    for document in documents:
        for sentence in re.split(r"(?<=[.!?])\s+", document.text):
            if 8 <= len(sentence.split()) <= 30:
                out.append(f"What do the passages say about this: {sentence}")
    return out


def ingest(channel: grpc.Channel, documents: Sequence[retriever_pb2.Document]) -> None:
    stub = retriever_pb2_grpc.RetrieverServiceStub(channel)
    try:
        stub.CreateCollection(retriever_pb2.CreateCollectionRequest(name=COLLECTION))
    except grpc.RpcError as err:
        if err.code() != grpc.StatusCode.ALREADY_EXISTS:
            raise
    stub.Ingest(retriever_pb2.IngestRequest(collection=COLLECTION, documents=documents),
                timeout=600)


def _request(turns: Sequence[str], *, max_tokens: int, top_k: int | None,
             collection: str = COLLECTION) -> generation_pb2.GenerateRequest:
    """A chat of SYSTEM then user ``turns``, with retrieval when ``top_k`` is set."""
    pb = generation_pb2.GenerateRequest(
        chat=generation_pb2.Chat(messages=[
            common_pb2.ChatMessage(role="system", content=SYSTEM),
            *(common_pb2.ChatMessage(role="user", content=t) for t in turns)]),
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                           ignore_eos=True),
        cache_salt=uuid.uuid4().hex)
    if top_k is not None:
        pb.retrieval.CopyFrom(generation_pb2.Retrieval(collection=collection, top_k=top_k))
    return pb


def _timed(stub: generation_pb2_grpc.GenerationServiceStub,
           request: generation_pb2.GenerateRequest) -> tuple[float, generation_pb2.GenerateResponse]:
    """(TTFT ms, the last message)."""
    started = time.perf_counter()
    ttft = None
    last = None
    for message in stub.Generate(request, timeout=120):
        if ttft is None and message.token_ids:
            ttft = (time.perf_counter() - started) * 1e3
        last = message
    assert ttft is not None and last is not None
    return ttft, last


def _record(samples: Samples, ttft: float, last: generation_pb2.GenerateResponse) -> None:
    samples.ttft_ms.append(ttft)
    if last.HasField("retrieval_latency"):
        samples.call_ms.append(last.retrieval_latency.call_ms)
        samples.wait_ms.append(last.retrieval_latency.wait_ms)


def run_e2e(ingress: str, qs: Sequence[str], *, collection: str, rounds: int, top_k: int,
            max_tokens: int) -> dict[str, Samples]:
    """The interleaved rounds (module doc) through Envoy at ``ingress`` over
    ``collection`` (ingested)."""
    ways = {name: Samples() for name in ("rag-cold", "rag-cached", "pasted")}
    with grpc.insecure_channel(ingress) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        retriever = retriever_pb2_grpc.RetrieverServiceStub(channel)
        def rag(question: str) -> generation_pb2.GenerateRequest:
            return _request([question], max_tokens=max_tokens, top_k=top_k,
                            collection=collection)

        _timed(stub, rag(qs[0]))  # warm-up
        for i in range(rounds):
            question = f"{qs[(i + 1) % len(qs)]} (round {i} {uuid.uuid4().hex[:6]})"
            ttft, last = _timed(stub, rag(question))
            _record(ways["rag-cold"], ttft, last)
            pasted = [last.retrieval.passages_message, question]
            order = ["rag-cached", "pasted"] if i % 2 == 0 else ["pasted", "rag-cached"]
            for way in order:
                request = (rag(question) if way == "rag-cached"
                           else _request(pasted, max_tokens=max_tokens, top_k=None))
                if way == "rag-cached":
                    _warm_top_k(retriever, request)
                _record(ways[way], *_timed(stub, request))
    return ways


@dataclass(frozen=True)
class Load:
    """The ``--load`` mode's shape (module doc)."""

    clients: int
    slots: int = 2
    concurrent: int = 4
    tokens: int = 16


def run_loaded(ingress: str, qs: Sequence[str], *, collection: str, rounds: int, top_k: int,
               max_tokens: int, load: Load) -> Samples:
    """``rounds`` of ``load.concurrent`` rag-cold requests at once, while
    ``load.clients`` threads keep the router's slots and queue busy (module doc)."""
    stop = threading.Event()
    samples = Samples()
    with grpc.insecure_channel(ingress) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)

        def hog(worker: int) -> None:
            while not stop.is_set():
                request = _request([f"Count to ten, worker {worker}."],
                                   max_tokens=load.tokens, top_k=None)
                request.bypass_cache = True
                for _ in stub.Generate(request, timeout=120):
                    pass

        def rag(question: str) -> tuple[float, generation_pb2.GenerateResponse]:
            return _timed(stub, _request([question], max_tokens=max_tokens, top_k=top_k,
                                         collection=collection))

        _timed(stub, _request([qs[0]], max_tokens=max_tokens, top_k=top_k,
                              collection=collection))  # warm-up
        hogs = [threading.Thread(target=hog, args=(w,), daemon=True)
                for w in range(load.clients)]
        for thread in hogs:
            thread.start()
        time.sleep(2.0)  # the slots fill and the queue forms
        try:
            with ThreadPoolExecutor(load.concurrent) as pool:
                for i in range(rounds):
                    batch = [f"{qs[(i * load.concurrent + j + 1) % len(qs)]} (round {i}.{j} "
                             f"{uuid.uuid4().hex[:6]})" for j in range(load.concurrent)]
                    for ttft, last in pool.map(rag, batch):
                        _record(samples, ttft, last)
        finally:
            stop.set()
            for thread in hogs:
                thread.join(timeout=120)
    return samples


def report_loaded(samples: Samples, load: Load) -> None:
    print(f"loaded ({load.clients} clients, {load.slots} slots, {load.concurrent} RAG at once):"
          f" n={len(samples.ttft_ms)} TTFT p50 {_pct(samples.ttft_ms, 0.5):.1f} ms, "
          f"p99 {_pct(samples.ttft_ms, 0.99):.1f} ms; retrieval call p50 "
          f"{statistics.median(samples.call_ms):.2f} ms, wait p50 "
          f"{statistics.median(samples.wait_ms):.2f} ms")


def _pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def report(ways: dict[str, Samples]) -> dict[str, float]:
    """Prints the table; returns the p50 TTFT added by each RAG way (ms)."""
    print(f"{'way':<12} {'n':>4} {'TTFT p50':>9} {'p99':>9}   {'retrieval call p50':>18} "
          f"{'wait p50':>9}")
    for name, s in ways.items():
        call = f"{statistics.median(s.call_ms):18.2f}" if s.call_ms else f"{'-':>18}"
        wait = f"{statistics.median(s.wait_ms):9.2f}" if s.wait_ms else f"{'-':>9}"
        print(f"{name:<12} {len(s.ttft_ms):>4} {_pct(s.ttft_ms, 0.5):9.2f} "
              f"{_pct(s.ttft_ms, 0.99):9.2f}   {call} {wait}")
    base = statistics.median(ways["pasted"].ttft_ms)
    added = {}
    for name in ("rag-cold", "rag-cached"):
        added[name] = statistics.median(ways[name].ttft_ms) - base
        verdict = "ok" if added[name] <= TARGET_MS else "OVER"
        print(f"TTFT({name}) - TTFT(pasted), p50: {added[name]:+.2f} ms "
              f"(target <= {TARGET_MS:g} ms: {verdict})")
    return added


def _warm_top_k(retriever: retriever_pb2_grpc.RetrieverServiceStub,
                request: generation_pb2.GenerateRequest) -> None:
    """Puts ``request``'s top-k in the retriever's cache, in the cache scope the router
    will ask in (no tenant, the request's ``cache_salt``: the retriever's caches
    are scoped, so the rag-cold request's salt would not do), without the
    engine seeing the prompt (its prefix cache stays cold)."""
    retriever.Query(retriever_pb2.QueryRequest(
        collection=request.retrieval.collection, query=request.chat.messages[-1].content,
        top_k=request.retrieval.top_k, cache_scope=resolve("", request.cache_salt)), timeout=30)


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _measure(mesh: Mesh, qs: Sequence[str], *, collection: str, rounds: int, top_k: int,
             max_tokens: int, load: Load | None = None) -> dict[str, float]:
    """:func:`run_e2e` (or :func:`run_loaded` with ``load``) on a started
    ``mesh`` once its router makes prompt ids in process; prints the table
    and the load average; returns :func:`report`'s (nothing for ``load``)."""
    mesh.wait_prompts_in_router()
    print(f"e2e: load average before: {_load()}", flush=True)
    if load is not None:
        samples = run_loaded(mesh.ingress_address, qs, collection=collection, rounds=rounds,
                             top_k=top_k, max_tokens=max_tokens, load=load)
        print(f"e2e: load average after:  {_load()}")
        report_loaded(samples, load)
        return {}
    ways = run_e2e(mesh.ingress_address, qs, collection=collection, rounds=rounds,
                   top_k=top_k, max_tokens=max_tokens)
    print(f"e2e: load average after:  {_load()}")
    return report(ways)


def e2e_part(retriever_address: str, qs: Sequence[str], *, collection: str, rounds: int = 30,
             top_k: int = 3, max_tokens: int = 2,
             engine_args: Sequence[str] = ()) -> dict[str, float]:
    """The part ``benchmarks/retrieval.py`` runs: a mesh (one engine, free
    ports) whose router queries the retriever at ``retriever_address``."""
    with Mesh(ingress_port=0, admin_port=0, engine_args=engine_args,
              router_args=["--retriever-address", retriever_address],
              run_dir=tempfile.mkdtemp(prefix="llmesh-bench-rag-")) as mesh:
        return _measure(mesh, qs, collection=collection, rounds=rounds, top_k=top_k,
                        max_tokens=max_tokens)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=2)
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    parser.add_argument("--engine-arg", action="append", default=[],
                        help="extra engine flag (repeat), e.g. --engine-arg=--kv-cache-bytes "
                             "--engine-arg=268435456 where memory is short")
    parser.add_argument("--load", type=int, default=0, metavar="K",
                        help="under load: K clients keep the router's queue full (module doc)")
    parser.add_argument("--slots", type=int, default=2,
                        help="with --load: the router's --max-running-per-replica")
    parser.add_argument("--concurrent", type=int, default=4,
                        help="with --load: RAG requests sent at once per round")
    parser.add_argument("--load-tokens", type=int, default=16,
                        help="with --load: tokens each background request generates")
    args = parser.parse_args(argv)
    documents = load_corpus(args.corpus)
    load = (Load(args.load, args.slots, args.concurrent, args.load_tokens) if args.load
            else None)
    router_args = ["--max-running-per-replica", str(args.slots)] if load else []
    with Mesh(ingress_port=0, admin_port=0, retrieval=True, engine_args=args.engine_arg,
              router_args=router_args,
              run_dir=tempfile.mkdtemp(prefix="llmesh-bench-rag-")) as mesh:
        with grpc.insecure_channel(mesh.services["retriever"].grpc_address) as channel:
            ingest(channel, documents)
        _measure(mesh, questions(documents), collection=COLLECTION, rounds=args.rounds,
                 top_k=args.top_k, max_tokens=args.max_tokens, load=load)


if __name__ == "__main__":
    main()
