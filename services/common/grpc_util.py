"""Small gRPC helpers shared by the services: channel options, request ids,
and the mesh's optional mutual TLS (:class:`MeshTls`).

Channels between services come from :func:`make_channel`: cleartext, unless
the server kit turned mutual TLS on for the process (:func:`use_mesh_tls`,
from ``--tls-cert --tls-key --tls-ca``) before the service started; then every
channel presents the service's certificate and verifies the peer against the
mesh CA (``grpc.ssl_channel_credentials``; the peer's SAN must name the host
dialled).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.common.logging import REQUEST_ID_METADATA_KEY

# Long-lived HTTP/2 channels between services: keepalive so an idle channel is
# not silently dropped, and no per-request connection set-up. Reconnection
# backs off from 0.1 s to at most 1 s (gRPC's default grows to 120 s), so a
# restarted service is used again within about a second of serving.
CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
]

#: Most bytes of request metadata (headers) a service accepts. gRPC's default
#: (8 KiB soft, refused at random up to a 16 KiB hard limit) answers larger
#: headers with RESOURCE_EXHAUSTED, which Envoy turns into HTTP 429 and clients
#: retry. Set above everything Envoy forwards (its ``max_request_headers_kb``,
#: ``services/cli/envoy_config.py``, plus the headers it adds) so a header
#: Envoy let through reaches the handler, which validates the ones it reads
#: (the router: ``x-request-id``, INVALID_ARGUMENT when too long).
MAX_METADATA_BYTES = 256 * 1024

SERVER_OPTIONS: list[tuple[str, int]] = [
    # Never share a port with another process silently (Linux SO_REUSEPORT).
    ("grpc.so_reuseport", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    # Soft and hard limit equal: no random refusals between the two.
    ("grpc.max_metadata_size", MAX_METADATA_BYTES),
    ("grpc.absolute_max_metadata_size", MAX_METADATA_BYTES),
]


@dataclass(frozen=True)
class MeshTls:
    """One service's mutual-TLS material inside the mesh (PEM files).

    Attributes:
      cert: its certificate, presented as server and as client.
      key: the certificate's private key.
      ca: the mesh CA: peers must present a certificate it signed.

    Source: gRPC Python authentication guide (``grpc.ssl_server_credentials``
    with ``require_client_auth``; ``grpc.ssl_channel_credentials`` with a
    client key and chain).
    """

    cert: Path
    key: Path
    ca: Path

    def _read(self) -> tuple[bytes, bytes, bytes]:
        return Path(self.cert).read_bytes(), Path(self.key).read_bytes(), Path(self.ca).read_bytes()

    def server_credentials(self) -> grpc.ServerCredentials:
        """Server side: requires a client certificate signed by ``ca``.

        Raises:
          OSError: a file cannot be read.
        """
        cert, key, ca = self._read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Client side: verifies the server against ``ca``, presents ``cert``.

        Raises:
          OSError: a file cannot be read.
        """
        cert, key, ca = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                            certificate_chain=cert)


#: The process's mutual TLS for outgoing channels (None: cleartext); set once
#: at start by the server kit (:func:`use_mesh_tls`), never at import.
_mesh_tls: MeshTls | None = None


def use_mesh_tls(tls: MeshTls | None) -> None:
    """Makes :func:`make_channel` open mutual-TLS channels with ``tls`` (None: cleartext)."""
    global _mesh_tls
    _mesh_tls = tls


def make_channel(target: str) -> grpc.aio.Channel:
    """Opens a long-lived channel to ``host:port`` (create once, reuse):
    mutual TLS when :func:`use_mesh_tls` set it, else cleartext."""
    if _mesh_tls is not None:
        return grpc.aio.secure_channel(target, _mesh_tls.channel_credentials(),
                                       options=CHANNEL_OPTIONS)
    return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)


def request_id_from(context: grpc.aio.ServicerContext, given: str = "") -> str:
    """The request id: ``given`` if set, else ``x-request-id`` metadata, else a new one."""
    return given or request_id_of(call_headers(context))


def request_id_of(headers: Mapping[str, str], given: str = "") -> str:
    """:func:`request_id_from` of a call whose metadata is read already
    (:func:`call_headers`): ``given``, else ``x-request-id``, else a new one."""
    return given or headers.get(REQUEST_ID_METADATA_KEY) or uuid.uuid4().hex


def call_headers(context: grpc.aio.ServicerContext) -> dict[str, str]:
    """The call's invocation metadata as ``{key: first value}`` (keys lower
    case; a binary ``-bin`` value as ``str(bytes)``), to read once per call:
    every ``invocation_metadata()`` converts all of it anew (~6 us here; the
    router's handler asked for eight keys, one call each)."""
    return {name: str(value) for name, value in reversed(context.invocation_metadata() or ())}


def request_id_metadata(request_id: str) -> tuple[tuple[str, str], ...]:
    """Outgoing metadata that carries ``request_id`` to the next hop."""
    return ((REQUEST_ID_METADATA_KEY, request_id),)


def status_code_of(value: int) -> grpc.StatusCode:
    """The :class:`grpc.StatusCode` of a numeric code carried in a message
    (UNKNOWN if none matches)."""
    for code in grpc.StatusCode:
        if code.value[0] == value:
            return code
    return grpc.StatusCode.UNKNOWN
