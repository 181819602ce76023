"""Where gRPC core reads a socket: on the thread that wakes the event loop
(:func:`read_on_poller`). Imports no grpc: every service's ``__main__``
(engine, router, tokenizer, cache, retriever) calls it first, since gRPC core
reads ``GRPC_EXPERIMENTS`` once, when ``grpc`` is imported. One setting for
every process of the mesh; programs that import a ``__main__`` for its
parser (``llmesh up``) and clients (``llmesh bench``) keep gRPC's default.

gRPC Python 1.85's default, the EventEngine listener and endpoints, hands
every readable socket from its epoll thread to a worker of its thread pool
(two futex wake-ups), which reads it and kicks the ``grpc.aio`` poller thread
(an eventfd), which wakes the event loop (a socket): four threads between a
byte's arrival and the handler. With these experiments off, gRPC uses its
iomgr TCP code, whose poller is the ``grpc.aio`` poller thread itself: it
reads the socket and wakes the loop, two threads. Seen with ``strace -f`` on
the engine (a ``Multiplex`` start: ``epoll_wait`` → ``futex`` → ``futex`` →
``recvmsg`` → ``write(eventfd)`` → ``read(eventfd)`` → ``write(loop)``, then
``epoll_wait`` → ``recvmsg`` → ``write(loop)``) and measured on the 2-vCPU VM
(2026-12-07, load 0.7-2.2, 29 one-stream requests, median): a start written
by the client → the engine's handler 0.56 → 0.48 ms, a token written by the
engine → read by a client that sets it too 0.57 → 0.49 ms
(docs/architecture.md "What the mesh costs"). Writes are unchanged: the
event loop's thread writes a response inline either way.

gRPC's own name resolution still works with these off (its DNS resolver asks
the nameserver for a target's name, as for the router's ``--tokenizer`` and
``--cache`` in Kubernetes; ``tests/common/test_grpc_polling.py``), and the
router's engine discovery resolves outside gRPC
(:mod:`services.router.discovery`). Seen from outside a process: 200 health
checks wake its EventEngine pool threads (``event_engine`` in
``/proc/PID/task/*/comm``) 3-4 times a call with gRPC's default, under 0.5
with this (``tests/poller_reads.py``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

#: The environment variable gRPC core reads its experiments from.
EXPERIMENTS_ENV = "GRPC_EXPERIMENTS"
#: The experiments that move socket reads onto EventEngine threads; each is
#: turned off (``-name``).
THREAD_POOL_READS = ("event_engine_listener", "event_engine_client",
                     "event_engine_for_all_other_endpoints")


def read_on_poller(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Turns :data:`THREAD_POOL_READS` off in ``environ`` (the process's own by
    default) unless :data:`EXPERIMENTS_ENV` is set already (an operator's
    choice wins, e.g. ``GRPC_EXPERIMENTS=`` for gRPC's default). Mutates.

    Returns:
      True when it set the variable; False when it was set already, or when
      ``grpc`` is imported already (gRPC read it then: nothing is changed).
    """
    if "grpc" in sys.modules or EXPERIMENTS_ENV in environ:
        return False
    environ[EXPERIMENTS_ENV] = ",".join(f"-{name}" for name in THREAD_POOL_READS)
    return True
