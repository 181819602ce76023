"""API keys → tenants: the router's key file, parsed once into typed values.

The file (``--api-keys FILE``, YAML or JSON: JSON is YAML) maps each tenant to
the SHA-256 of its keys, the models it may use and its limits::

    tenants:
      - id: acme
        keys: ["sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"]
        models: ["*"]                  # every served model (the default)
        cache_group: acme-org          # optional: share caches with the group
        cascade: large                 # optional: the cascade alias's default mode
        limits:                        # absent or 0: no limit
          requests_per_minute: 600
          tokens_per_minute: 200000    # prompt + completion
          max_concurrent: 16           # requests in flight

Caches are scoped by tenant (:mod:`services.common.cache_scope`): a tenant
never reuses another's cached work. Tenants whose entries name the same
``cache_group`` share one scope (an explicit opt-in, e.g. the tenants of one
organisation); a group's name is its own namespace, never a tenant id.
``cascade`` (``auto``, ``small`` or ``large``) is the mode of the tenant's
requests to the cascade's alias that name none (e.g. a tenant that always
wants the large model).

The file holds hashes only, never a key: an entry that is not
``sha256:<64 hex digits>`` is refused (without echoing it: it may be a key
pasted by mistake). ``llmesh keys new --tenant ID`` mints a key, prints it
once and prints the entry to add (:func:`mint_key`, :func:`key_entry`).

**Lookup, and why it is safe against timing.** :meth:`KeyTable.authenticate`
hashes the presented key (SHA-256, ~1 µs for a 40-byte key) and looks the hex
digest up in a dict. The lookup's time depends only on the digest of what the
caller sent; learning anything about a stored digest from it would need
SHA-256 preimages, and a stored digest says nothing usable about a 256-bit
random key anyway. That is the argument for storing and comparing hashes
(the same one as for ``hmac.compare_digest`` over digests) without a linear
scan of constant-time comparisons, which would cost O(keys) per request.

**Why in the router, not Envoy ext_authz.** The check is one SHA-256 and one
dict lookup: ~1-2 µs per request measured on this 2-core box (see
docs/api-keys.md for the numbers), against an extra gRPC round trip from
Envoy to an authorization service per request (~100-300 µs on loopback,
plus a process to run and keep in sync). The tenant is also needed in the
router anyway (limits, fairness, metrics).

Errors: :class:`KeyFileError` for a file that cannot be read or parsed or
breaks a rule; its message names the place (``tenants[1].keys[0]``) and never
holds a key.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from services.router.cascade.policy import CascadeMode

#: The one hash form the file accepts.
HASH_PREFIX = "sha256:"
_HASH_RE = re.compile(r"sha256:[0-9a-f]{64}")
#: Minted keys start with this (so that a leaked key is recognisable, as
#: GitHub's ``ghp_`` tokens are); any string is accepted as a key though.
KEY_PREFIX = "lmk_"
#: Everything a tenant may use.
ALL_MODELS = "*"
#: The gRPC metadata (and HTTP headers) a key may come in.
AUTHORIZATION_HEADER = "authorization"
API_KEY_HEADER = "x-api-key"
_TENANT_ID_RE = re.compile(r"[\x21-\x7e]{1,128}")
_LIMIT_NAMES = ("requests_per_minute", "tokens_per_minute", "max_concurrent")
_TENANT_FIELDS = ("id", "keys", "models", "limits", "cache_group", "cascade")


class KeyFileError(ValueError):
    """The key file cannot be used; the message says where and why (no secrets)."""


@dataclass(frozen=True)
class TenantLimits:
    """A tenant's limits; 0 is no limit.

    Attributes:
      requests_per_minute: requests started in any 60 s window.
      tokens_per_minute: prompt + completion tokens in any 60 s window
        (:mod:`services.router.tenant_limits`).
      max_concurrent: requests in flight at once.
    """

    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    max_concurrent: int = 0


@dataclass(frozen=True)
class Tenant:
    """One tenant: its id (in logs and metric labels), the models it may use
    (``"*"``: all), its limits, the cache group it shares caches with (""
    none: its caches are its own) and the cascade mode its requests to the
    cascade's alias take when they name none (None: ``auto``;
    :mod:`services.router.cascade.policy`)."""

    id: str
    models: frozenset[str] = frozenset({ALL_MODELS})
    limits: TenantLimits = TenantLimits()
    cache_group: str = ""
    cascade: CascadeMode | None = None

    def may_use(self, model: str) -> bool:
        return ALL_MODELS in self.models or model in self.models


@dataclass(frozen=True)
class KeyTable:
    """The parsed key file: tenants by id and by key digest (hex)."""

    tenants: Mapping[str, Tenant]
    _by_digest: Mapping[str, Tenant] = field(repr=False)

    def authenticate(self, key: str) -> Tenant | None:
        """The tenant of ``key``, or None (see the module doc for timing)."""
        return self._by_digest.get(hashlib.sha256(key.encode()).hexdigest())

    @property
    def num_keys(self) -> int:
        return len(self._by_digest)

    def tenant_ids_with_keys(self) -> set[str]:
        """The ids of the tenants at least one key of the file authenticates as."""
        return {tenant.id for tenant in self._by_digest.values()}


def hash_key(key: str) -> str:
    """The file's entry for ``key``: ``sha256:<hex>``."""
    return HASH_PREFIX + hashlib.sha256(key.encode()).hexdigest()


def mint_key() -> str:
    """A new random key: :data:`KEY_PREFIX` + 256 bits (URL-safe base64)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_entry(tenant: str, digest: str) -> str:
    """The YAML lines of a one-key tenant entry to paste into the file."""
    return (f"  - id: {tenant}\n    keys: [\"{digest}\"]\n    models: [\"*\"]\n")


def key_from_headers(authorization: str | None, api_key: str | None) -> str | None:
    """The key a call presents: ``authorization: Bearer KEY`` (scheme case-
    insensitive, RFC 6750) or ``x-api-key: KEY``; None when neither is there
    (an ``authorization`` of another scheme counts as none)."""
    if authorization:
        scheme, _, value = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    if api_key and api_key.strip():
        return api_key.strip()
    return None


def load_key_table(path: str | Path) -> KeyTable:
    """Reads and parses the key file at ``path``.

    Raises:
      KeyFileError: unreadable, not YAML/JSON, or a rule broken.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise KeyFileError(f"cannot read the API key file {path}: "
                           f"{getattr(err, 'strerror', None) or type(err).__name__}") from None
    return parse_key_table(text, source=str(path))


def parse_key_table(text: str, *, source: str = "<keys>") -> KeyTable:
    """Parses the key file's text (YAML or JSON; see the module doc).

    Raises:
      KeyFileError: naming the first bad place (a YAML error by line only:
        its excerpt could hold a key).
    """
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise KeyFileError(f"{source}: not valid YAML or JSON{where}") from None
    if not isinstance(doc, dict) or set(doc) != {"tenants"}:
        raise KeyFileError(f"{source}: the top level must be a mapping with one key, "
                           "`tenants` (a list)")
    if not isinstance(doc["tenants"], list):
        raise KeyFileError(f"{source}: tenants: must be a list")
    tenants: dict[str, Tenant] = {}
    by_digest: dict[str, Tenant] = {}
    for i, raw in enumerate(doc["tenants"]):
        tenant, digests = _tenant(raw, f"{source}: tenants[{i}]")
        if tenant.id in tenants:
            raise KeyFileError(f"{source}: tenants[{i}].id: tenant {tenant.id!r} appears twice")
        tenants[tenant.id] = tenant
        for j, digest in enumerate(digests):
            if digest in by_digest:
                raise KeyFileError(
                    f"{source}: tenants[{i}].keys[{j}]: the same key hash is already a key of "
                    f"tenant {by_digest[digest].id!r}; a key maps to one tenant")
            by_digest[digest] = tenant
    return KeyTable(tenants, by_digest)


def _tenant(raw: Any, where: str) -> tuple[Tenant, list[str]]:
    if not isinstance(raw, dict):
        raise KeyFileError(f"{where}: must be a mapping with {', '.join(_TENANT_FIELDS)}")
    unknown = set(raw) - set(_TENANT_FIELDS)
    if unknown:
        raise KeyFileError(f"{where}: unknown field(s) {sorted(map(str, unknown))}; "
                           f"allowed: {', '.join(_TENANT_FIELDS)}")
    tenant_id = raw.get("id")
    if not isinstance(tenant_id, str) or not _TENANT_ID_RE.fullmatch(tenant_id):
        raise KeyFileError(f"{where}.id: must be 1..128 printable ASCII characters "
                           "without spaces")
    keys = raw.get("keys", [])
    if not isinstance(keys, list):
        raise KeyFileError(f"{where}.keys: must be a list of 'sha256:<64 hex>' hashes")
    digests = []
    for j, key in enumerate(keys):
        if not isinstance(key, str) or not _HASH_RE.fullmatch(key.strip().lower()):
            # Never echo it: it may be a raw key pasted by mistake.
            raise KeyFileError(
                f"{where}.keys[{j}]: not a 'sha256:<64 hex digits>' hash; the file holds "
                "hashes of keys, never keys (make one with `llmesh keys new --tenant ID` "
                "or `llmesh keys hash`)")
        digests.append(key.strip().lower()[len(HASH_PREFIX):])
    models = raw.get("models", [ALL_MODELS])
    if (not isinstance(models, list) or not models
            or not all(isinstance(m, str) and m for m in models)):
        raise KeyFileError(f"{where}.models: must be a non-empty list of model ids "
                           "(\"*\": every served model)")
    cache_group = raw.get("cache_group", "")
    if "cache_group" in raw and not (isinstance(cache_group, str)
                                     and _TENANT_ID_RE.fullmatch(cache_group)):
        raise KeyFileError(f"{where}.cache_group: must be 1..128 printable ASCII characters "
                           "without spaces (tenants naming the same group share caches)")
    tenant = Tenant(tenant_id, frozenset(models), _limits(raw.get("limits", {}), where),
                    cache_group, _cascade(raw.get("cascade"), where))
    return tenant, digests


def _cascade(raw: Any, where: str) -> CascadeMode | None:
    if raw is None:
        return None
    try:
        return CascadeMode(raw)
    except ValueError:
        modes = ", ".join(m.value for m in CascadeMode)
        raise KeyFileError(f"{where}.cascade: must be one of {modes} (the default mode of "
                           "this tenant's requests to the cascade's alias)") from None


def _limits(raw: Any, where: str) -> TenantLimits:
    if raw is None:
        return TenantLimits()
    if not isinstance(raw, dict):
        raise KeyFileError(f"{where}.limits: must be a mapping of {', '.join(_LIMIT_NAMES)}")
    unknown = set(raw) - set(_LIMIT_NAMES)
    if unknown:
        raise KeyFileError(f"{where}.limits: unknown limit(s) {sorted(map(str, unknown))}; "
                           f"allowed: {', '.join(_LIMIT_NAMES)}")
    for name, value in raw.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise KeyFileError(f"{where}.limits.{name}: must be an integer >= 0 "
                               "(0: no limit)")
    return TenantLimits(**raw)


__all__ = [
    "ALL_MODELS", "API_KEY_HEADER", "AUTHORIZATION_HEADER", "KeyFileError", "KeyTable",
    "Tenant", "TenantLimits", "hash_key", "key_entry", "key_from_headers", "load_key_table",
    "mint_key", "parse_key_table",
]
