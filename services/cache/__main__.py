"""``python -m services.cache``: runs the cache service.

Without ``--redis-url`` responses live in an embedded in-memory LRU
(``--max-entries``, ``--max-bytes``) and the prefix index in this process;
with it, both live in Redis (several cache services and routers then share
the index), which must answer at start-up (the process exits with status 2
and says so otherwise).
"""

from __future__ import annotations

from services.common.grpc_polling import read_on_poller  # imports no grpc

if __name__ == "__main__":  # the cache service's process (not a program importing build_parser)
    read_on_poller()  # before grpc is imported: gRPC core reads it once

import argparse
import asyncio
import sys

from services.cache.service import CacheService
from services.cache.prefix_index import MemoryPrefixIndex, PrefixIndex, RedisPrefixIndex
from services.cache.store import (
    MemoryStore,
    RedisOptions,
    RedisStore,
    ResponseStore,
    StoreUnavailableError,
)
from services.common.server import (
    StartFailed,
    add_server_arguments,
    run_service,
    server_config_from_args,
)


def build_parser() -> argparse.ArgumentParser:
    """The command line: cache flags plus the common server flags."""
    parser = argparse.ArgumentParser(prog="python -m services.cache", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", default=None,
                        help="redis://host:port/db; unset: embedded in-memory store")
    parser.add_argument("--ttl-seconds", type=int, default=3600,
                        help="lifetime of an entry stored with ttl_seconds 0 (seconds)")
    parser.add_argument("--max-entries", type=int, default=100_000,
                        help="in-memory store: most entries held")
    parser.add_argument("--max-bytes", type=int, default=256 * 1024 * 1024,
                        help="in-memory store: most bytes held (keys + values)")
    parser.add_argument("--redis-timeout-seconds", type=float, default=0.5,
                        help="Redis: most time one get/put may take before it counts as a miss")
    parser.add_argument("--redis-retry-seconds", type=float, default=1.0,
                        help="Redis: pause after a failure before calling Redis again (seconds)")
    parser.add_argument("--redis-max-connections", type=int, default=64,
                        help="Redis: connection pool size")
    parser.add_argument("--kv-index-prefix", default="llmesh:kv:",
                        help="Redis: key prefix of the prefix index (default llmesh:kv:)")
    add_server_arguments(parser)
    return parser


def build_store(args: argparse.Namespace) -> ResponseStore:
    """The store the flags ask for."""
    if args.redis_url:
        return RedisStore(args.redis_url, timeout_seconds=args.redis_timeout_seconds,
                          retry_interval_seconds=args.redis_retry_seconds,
                          max_connections=args.redis_max_connections)
    return MemoryStore(max_entries=args.max_entries, max_bytes=args.max_bytes)


def build_index(args: argparse.Namespace) -> PrefixIndex:
    """The prefix index the flags ask for (Redis with ``--redis-url``)."""
    if args.redis_url:
        return RedisPrefixIndex(args.redis_url, key_prefix=args.kv_index_prefix,
                                options=RedisOptions(
                                    timeout_seconds=args.redis_timeout_seconds,
                                    retry_interval_seconds=args.redis_retry_seconds,
                                    max_connections=args.redis_max_connections))
    return MemoryPrefixIndex()


def main(argv: list[str] | None = None) -> int:
    """Runs the service until SIGTERM/SIGINT; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.ttl_seconds <= 0:
        parser.error("--ttl-seconds must be > 0")
    try:
        store, index = build_store(args), build_index(args)
    except ValueError as exc:
        parser.error(str(exc))
    service = CacheService(store, default_ttl_seconds=args.ttl_seconds, index=index)
    try:
        asyncio.run(run_service(server_config_from_args("cache", args), service))
    except StartFailed as failed:
        if not isinstance(failed.error, StoreUnavailableError):
            raise
        print(f"cache: {failed.error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
