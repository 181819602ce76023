"""Cache scopes: which cached work a request may reuse, and who may reuse its work.

Every cache that can answer one request from another's work is keyed by the
request's cache scope (DESIGN.md, "Caches are scoped"): the response cache
(``CacheKey.cache_scope``, :mod:`services.cache.keys`), coalescing
(:class:`services.router.single_flight.CoalescingKey`), the prefix-cache block
hashes (:func:`services.common.block_hash.scoped_seed`, hence the KV events,
the prefix index and KV-aware routing) and the engine's suffix decoding cache
(``EngineRequest.cache_scope``).

The router resolves the scope once per request, at its edge, from

* the **owner**: with API keys the key's tenant (``tenant:<id>``), or the
  cache group its key-file entry opts into (``group:<name>``: tenants of one
  group share); without keys the caller's ``x-tenant-id`` (self-declared:
  it separates honest callers, it stops no one who sends another's id); none
  (""): the shared scope of every caller without one;
* the request's ``cache_salt`` (vLLM's name): scopes further, never wider
  (it is combined with the owner, never replaces it).

The result is opaque to the engine and the cache service: "" for the shared
scope (no owner, no salt: keys and hashes are as before scopes existed), else
the hex SHA-256 of the length-prefixed owner and salt (64 characters: an
owner's name and a salt never leave the router, and no two (owner, salt)
pairs meet). Owners are namespaced (``tenant:`` vs ``group:``), so a cache
group named like a tenant never shares with that tenant.
"""

from __future__ import annotations

import hashlib
import struct

from services.common.sampling import InvalidRequestError

#: Longest ``cache_salt`` a caller may send (UTF-8 bytes).
MAX_CACHE_SALT_BYTES = 256
#: Longest resolved scope the engine and the cache service accept (bytes; the
#: router sends 64 hex characters).
MAX_CACHE_SCOPE_BYTES = 128
#: The shared scope.
SHARED = ""

_DOMAIN = b"llmesh.cache-scope.v1\x00"
_U32 = struct.Struct("<I")


def owner(tenant: str, cache_group: str = "") -> str:
    """The scope owner of a request: ``group:<cache_group>`` when the tenant's
    entry names one, else ``tenant:<tenant>``, or "" with no tenant."""
    if cache_group:
        return "group:" + cache_group
    return "tenant:" + tenant if tenant else ""


def resolve(scope_owner: str, cache_salt: str = "") -> str:
    """The opaque cache scope of ``scope_owner`` (:func:`owner`) and a request's
    ``cache_salt`` ("" for none): :data:`SHARED` when both are empty, else 64
    hex characters (see the module doc)."""
    if not scope_owner and not cache_salt:
        return SHARED
    data = _DOMAIN
    for part in (scope_owner, cache_salt):
        encoded = part.encode()
        data += _U32.pack(len(encoded)) + encoded
    return hashlib.sha256(data).hexdigest()


def check_salt(salt: str, field: str = "cache_salt") -> str:
    """A caller's ``cache_salt``, checked once at the router's edge.

    Raises:
      InvalidRequestError: INVALID_ARGUMENT naming ``field``: empty (send none
        instead) or longer than :data:`MAX_CACHE_SALT_BYTES` bytes.
    """
    size = len(salt.encode())
    if size == 0:
        raise InvalidRequestError(field, "must be a non-empty string when set")
    if size > MAX_CACHE_SALT_BYTES:
        raise InvalidRequestError(field, f"at most {MAX_CACHE_SALT_BYTES} bytes (UTF-8), "
                                  f"got {size}")
    return salt


def check_scope(scope: str, field: str = "cache_scope") -> str:
    """A resolved scope received by the engine or the cache service: "" or up
    to :data:`MAX_CACHE_SCOPE_BYTES` visible ASCII characters (``!`` to ``~``;
    the router sends 64 hex characters).

    Raises:
      InvalidRequestError: INVALID_ARGUMENT naming ``field``: longer than
        :data:`MAX_CACHE_SCOPE_BYTES` bytes, or a character outside that set
        (a space, a control character, non-ASCII), with its index.
    """
    size = len(scope.encode())
    if size > MAX_CACHE_SCOPE_BYTES:
        raise InvalidRequestError(field, f"at most {MAX_CACHE_SCOPE_BYTES} bytes, got {size}")
    if scope and not (scope.isascii() and scope.isprintable() and " " not in scope):
        index, char = next((i, c) for i, c in enumerate(scope)
                           if not ("!" <= c <= "~"))
        raise InvalidRequestError(field, f"character {char!r} at index {index} is not visible "
                                  f"ASCII ('!' to '~'; the router sends hex)")
    return scope


__all__ = ["MAX_CACHE_SALT_BYTES", "MAX_CACHE_SCOPE_BYTES", "SHARED", "check_salt",
           "check_scope", "owner", "resolve"]
