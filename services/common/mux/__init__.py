"""One stream kit: many requests over one long-lived bidi gRPC call.

Every hop that multiplexes requests on one call (router → engine, router →
tokenizer) uses these pieces, at both ends:

* :class:`~services.common.mux.mailbox.Mailbox`: pending updates by key,
  merged with the wire type's merge function (one merge buffer).
* :class:`~services.common.mux.client.MuxClient`: the caller's end: stream
  ids' receivers, a batched writer, one reader, fail-all on a broken call.
* :class:`~services.common.mux.server.MuxServer`: the handler's end: the
  caller's messages fed to the adapter, an outbox written as one batch per
  wakeup, protocol violations as the call's status.

The kit knows no message type: each adapter passes its wire type's merge,
pack and unpack functions.
"""

from services.common.mux.client import MuxClient, Receiver
from services.common.mux.mailbox import Mailbox, StreamInbox, never_merge
from services.common.mux.server import MuxServer, ProtocolViolation

__all__ = ["Mailbox", "MuxClient", "MuxServer", "ProtocolViolation", "Receiver",
           "StreamInbox", "never_merge"]
