"""A cache service from before the stream RPCs, in a process of its own:
the real :class:`~services.cache.service.CacheService` on a grpc.aio server
with only its unary ``GetCachedResponse`` and ``PutCachedResponse``
registered (an older cache mid-way through a rolling upgrade, whose server
answers the stream RPCs UNIMPLEMENTED "Method not found!").

Run ``python -m tests.router.old_cache_server``: it prints its port on the
first line of stdout once serving, and serves until killed. A process of its
own, not the test's loop: a fresh router channel's first write then races
the UNIMPLEMENTED as it does between real processes (the call can end
"INTERNAL: Internal error from Core" instead).
"""

from __future__ import annotations

import asyncio
import sys

import grpc
import structlog
from prometheus_client import CollectorRegistry

from llmesh.v1 import cache_pb2
from services.cache.metrics import CacheMetrics
from services.cache.service import CacheService
from services.cache.store import MemoryStore


def unary_handlers(cache: CacheService) -> grpc.GenericRpcHandler:
    """``llmesh.v1.CacheService`` with only the unary get and put of responses."""
    return grpc.method_handlers_generic_handler("llmesh.v1.CacheService", {
        "GetCachedResponse": grpc.unary_unary_rpc_method_handler(
            cache.GetCachedResponse,
            request_deserializer=cache_pb2.GetCachedResponseRequest.FromString,
            response_serializer=cache_pb2.GetCachedResponseResponse.SerializeToString),
        "PutCachedResponse": grpc.unary_unary_rpc_method_handler(
            cache.PutCachedResponse,
            request_deserializer=cache_pb2.PutCachedResponseRequest.FromString,
            response_serializer=cache_pb2.PutCachedResponseResponse.SerializeToString),
    })


async def serve() -> None:
    """Serves until killed; the port alone on stdout, the logs on stderr."""
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    cache = CacheService(MemoryStore(), metrics=CacheMetrics.create(CollectorRegistry()))
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((unary_handlers(cache),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await cache.start()
    print(port, flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(serve())
