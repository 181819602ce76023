"""gRPC server reflection for every service, methods included.

grpcio-reflection answers ``file_containing_symbol`` with the descriptor
pool's ``FindFileContainingSymbol``. protobuf's upb pool (the default
implementation since protobuf 4) finds messages, fields, enums and services
there but not methods, so ``grpcurl describe llmesh.v1.EngineService.Generate``
said "Symbol not found" for every method (deprecated ones included) while
``describe llmesh.v1.EngineService`` worked. :class:`MethodAwarePool` looks a
method name up as a method when the symbol lookup fails.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc
from google.protobuf import descriptor_pool
from google.protobuf.descriptor import FileDescriptor
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


class MethodAwarePool:
    """A descriptor pool (default: protobuf's default pool) whose
    ``FindFileContainingSymbol`` also resolves ``package.Service.Method`` to
    the file that declares the service; every other call goes to the pool."""

    def __init__(self, pool: descriptor_pool.DescriptorPool | None = None) -> None:
        self._pool = descriptor_pool.Default() if pool is None else pool

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)

    def FindFileContainingSymbol(self, symbol: str) -> FileDescriptor:
        """The file declaring ``symbol`` (a message, field, enum, service,
        extension or method: full name without a leading dot).

        Raises:
          KeyError: no such symbol (reflection answers NOT_FOUND).
        """
        try:
            return self._pool.FindFileContainingSymbol(symbol)
        except KeyError:
            try:
                return self._pool.FindMethodByName(symbol).containing_service.file
            except KeyError:
                raise KeyError(f"Couldn't find symbol {symbol}") from None


def enable_reflection(service_names: Iterable[str], server: grpc.aio.Server,
                      also: Iterable[str] = ()) -> None:
    """Serves reflection on ``server`` for ``service_names``, gRPC health and
    reflection itself (all from the default descriptor pool), and lists the
    services ``also`` names (another process serves them behind the same
    ingress: ``--reflect-service``).

    Raises:
      ValueError: a name in ``also`` the default pool does not hold
        (reflection would list it and fail to describe it).
    """
    pool = descriptor_pool.Default()
    also = tuple(also)
    for name in also:
        try:
            pool.FindServiceByName(name)
        except KeyError:
            raise ValueError(f"--reflect-service: no service {name!r} in this process's "
                             "descriptors") from None
    reflection.enable_server_reflection(
        (*service_names, *also, HEALTH_SERVICE, reflection.SERVICE_NAME), server,
        pool=MethodAwarePool())
