"""The calls a server is running, so that a drain can wait for them while it
still answers health checks.

``grpc.aio.Server.stop(grace)`` stops accepting connections and calls at once:
from then on a health check gets no answer, not NOT_SERVING. The server kit
(:mod:`services.common.server`) therefore drains in two steps: health
NOT_SERVING and :meth:`Service.drain` (new work refused with UNAVAILABLE), then
:meth:`ActiveCalls.wait_idle` while the server still serves, and only then
``stop`` with what is left of the grace period. Callers (the router's replica
probes, Envoy's health checks, a Kubernetes readiness probe) thus see the
process NOT_SERVING for the whole drain, and a stream that ends lets the
process exit at once instead of at the grace deadline.

:class:`ActiveCalls` is fed by the kit's server interceptor
(:class:`services.common.request_guard.RequestGuard`) around each async handler.
Threading: the server's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Iterator

#: Method prefixes a drain does not wait for: the health service (a Watch call
#: lasts as long as its client wants) and reflection.
NOT_WORK = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class ActiveCalls:
    """Calls in progress, by full method name (``/pkg.Service/Method``)."""

    def __init__(self) -> None:
        self._by_method: Counter[str] = Counter()

    @contextlib.contextmanager
    def track(self, method: str) -> Iterator[None]:
        """Counts one call of ``method`` while the block runs."""
        self._by_method[method] += 1
        try:
            yield
        finally:
            self._by_method[method] -= 1
            if not self._by_method[method]:
                del self._by_method[method]

    def working(self) -> dict[str, int]:
        """Calls in progress by method, health and reflection left out."""
        return {method: count for method, count in self._by_method.items()
                if not method.startswith(NOT_WORK)}

    async def wait_idle(self, timeout_s: float, poll_s: float = 0.05) -> bool:
        """Waits up to ``timeout_s`` seconds for :meth:`working` to be empty;
        True when it is."""
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout_s
        while self.working():
            if loop.time() >= until:
                return False
            await asyncio.sleep(min(poll_s, max(0.0, until - loop.time())))
        return True
