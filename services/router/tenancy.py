"""Who is calling: API key → tenant, the tenant's models and limits, for
both router edges (gRPC and the OpenAI HTTP API).

:class:`Tenancy` is the one place the edges ask:

* :meth:`Tenancy.authenticate` once per call (a ``GenerateStream`` call: once,
  when it opens; its turns keep that tenant): the key from
  ``authorization: Bearer KEY`` or ``x-api-key: KEY`` (gRPC metadata or HTTP
  headers) → its :class:`Tenant`. With auth on (``--api-keys FILE``) a call
  without a key is UNAUTHENTICATED ("missing API key: send 'authorization:
  Bearer <key>'"), an unknown key UNAUTHENTICATED ("invalid API key"), and
  ``x-tenant-id`` is ignored: the tenant is the key's. With auth off it
  returns None and the caller's ``x-tenant-id`` names the tenant, as before.
  Health and reflection never ask: they stay open.
* :meth:`Tenancy.check_model` after validation: a model outside the tenant's
  ``models`` is PERMISSION_DENIED naming it (HTTP 403).
* :meth:`Tenancy.run` wraps the model's pipeline with the tenant's limits
  (:mod:`services.router.tenant_limits`): a lease at the start, the token
  reservation after tokenization (the pipeline calls back), settlement in
  ``finally``; refusals are RESOURCE_EXHAUSTED with ``retry-after-ms``
  through :meth:`GenerationError.refused`, the admission queue's own path,
  so gRPC and HTTP (429 ``Retry-After``) map them alike.
* :meth:`Tenancy.reload` on SIGHUP: a good file replaces the table for new
  calls (calls in flight keep the tenant they authenticated as); a bad one
  keeps the old table, logs ``api_keys_reload_failed`` with the file's
  error (which never holds a key) and counts
  ``llmesh:api_key_reloads_total{outcome="error"}``.

Logs carry the tenant id, never a key (nor its hash).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import grpc
import structlog

from services.common.sampling import InvalidRequestError
from services.router.api_keys import (
    ALL_MODELS,
    KeyFileError,
    KeyTable,
    Tenant,
    key_from_headers,
    load_key_table,
)
from services.router.cascade.policy import PromptRerouted
from services.router.generation import (
    Event,
    Finished,
    GenerationError,
    GenerationPipeline,
    Progress,
)
from services.router.metrics import RouterMetrics
from services.router.routing import RoutingSession
from services.router.tenant_limits import TenantLimited, TenantLimiter
from services.router.validation import GenerationRequest

log = structlog.get_logger()

MISSING_KEY_MESSAGE = "missing API key: send 'authorization: Bearer <key>' (or 'x-api-key: <key>')"
INVALID_KEY_MESSAGE = "invalid API key"
EMPTY_BEARER_MESSAGE = ("missing API key: the authorization header's Bearer token is empty; "
                        "send 'authorization: Bearer <key>' (or 'x-api-key: <key>')")
NOT_BEARER_MESSAGE = ("missing API key: the authorization header is not 'Bearer <key>'; "
                      "send 'authorization: Bearer <key>' (or 'x-api-key: <key>')")


class AuthError(Exception):
    """The call is refused by the key checks.

    Attributes:
      code: UNAUTHENTICATED or PERMISSION_DENIED.
      reason: ``missing_key``, ``invalid_key`` or ``model_not_allowed`` (the
        metric's label).
    """

    def __init__(self, code: grpc.StatusCode, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message


class Tenancy:
    """API keys and per-tenant limits of one router (single event loop).

    Args:
      keys_path: the key file; None: auth off.
      metrics: the router's metric families.

    Raises:
      KeyFileError: the file is bad at start (the router exits 2 with its line).
    """

    def __init__(self, keys_path: str | Path | None, metrics: RouterMetrics) -> None:
        self.keys_path = None if keys_path is None else Path(keys_path)
        self._metrics = metrics
        self._observer = metrics.tenant_observer()
        self.limiter = TenantLimiter(observer=self._observer)
        self.table: KeyTable | None = None
        #: The model ids the router serves, once every pool is open (None before).
        self._served: frozenset[str] | None = None
        if self.keys_path is not None:
            self._install(load_key_table(self.keys_path))

    @property
    def enabled(self) -> bool:
        return self.table is not None

    def _install(self, table: KeyTable) -> None:
        self.table = table
        self._metrics.api_keys.labels("keys").set(table.num_keys)
        self._metrics.api_keys.labels("tenants").set(len(table.tenants))

    def warn_if_locked_out(self) -> None:
        """Logs a warning when the key table lets no one in (no keys at all:
        ``api_keys_none``) or has tenants no key reaches
        (``api_keys_tenants_without_keys``). The router calls it once logging
        is set up, and :meth:`reload` after each reload."""
        table = self.table
        if table is None:
            return
        keyless = sorted(set(table.tenants) - table.tenant_ids_with_keys())
        if table.num_keys == 0:
            log.warning("api_keys_none", file=str(self.keys_path),
                        effect="every generation call is refused UNAUTHENTICATED")
        elif keyless:
            log.warning("api_keys_tenants_without_keys", tenants=keyless,
                        effect="no call can act as these tenants")

    def set_served_models(self, models: Iterable[str]) -> None:
        """Tells the model ids the router serves (every pool open); warns of
        tenants that list others (``api_keys_unknown_models``), now and after
        each reload."""
        self._served = frozenset(models)
        self._warn_unknown_models()

    def _warn_unknown_models(self) -> None:
        if self.table is None or self._served is None:
            return
        unknown = {tenant.id: sorted(tenant.models - self._served - {ALL_MODELS})
                   for tenant in self.table.tenants.values()}
        unknown = {tenant: models for tenant, models in unknown.items() if models}
        if unknown:
            log.warning("api_keys_unknown_models", tenants=unknown, served=sorted(self._served),
                        effect="the mesh serves no such model: a call naming it is refused "
                               "as an unknown model")

    def reload(self) -> bool:
        """Reads the key file again (SIGHUP); True when the new table is in use."""
        if self.keys_path is None:
            log.warning("api_keys_reload_ignored", why="the router runs without --api-keys")
            return False
        try:
            table = load_key_table(self.keys_path)
        except KeyFileError as err:
            self._metrics.api_key_reloads.labels("error").inc()
            log.error("api_keys_reload_failed", error=str(err),
                      effect="the previous keys stay in use")
            return False
        self._install(table)
        self._metrics.api_key_reloads.labels("ok").inc()
        log.info("api_keys_reloaded", tenants=len(table.tenants), keys=table.num_keys)
        self.warn_if_locked_out()
        self._warn_unknown_models()
        return True

    # ----------------------------------------------------------------- auth

    def authenticate(self, authorization: str | None, api_key: str | None) -> Tenant | None:
        """The calling tenant (None: auth is off), bound to the call's log lines
        as ``tenant``.

        Raises:
          AuthError: UNAUTHENTICATED, no key or an unknown one.
        """
        table = self.table
        if table is None:
            return None
        key = key_from_headers(authorization, api_key)
        if key is None:
            self._auth_failed("missing_key")
            # Say what is wrong with an authorization header that gave no key,
            # never echoing it (it may be the key itself).
            header = (authorization or "").strip()
            if not header:
                message = MISSING_KEY_MESSAGE
            elif header.partition(" ")[0].lower() == "bearer":
                message = EMPTY_BEARER_MESSAGE
            else:
                message = NOT_BEARER_MESSAGE
            raise AuthError(grpc.StatusCode.UNAUTHENTICATED, "missing_key", message)
        tenant = table.authenticate(key)
        if tenant is None:
            self._auth_failed("invalid_key")
            raise AuthError(grpc.StatusCode.UNAUTHENTICATED, "invalid_key", INVALID_KEY_MESSAGE)
        structlog.contextvars.bind_contextvars(tenant=tenant.id)  # the call's log lines
        return tenant

    def check_model(self, tenant: Tenant | None, model: str) -> None:
        """Raises AuthError (PERMISSION_DENIED) when ``tenant`` may not use ``model``."""
        if tenant is None or tenant.may_use(model):
            return
        self._auth_failed("model_not_allowed")
        allowed = ", ".join(repr(m) for m in sorted(tenant.models))
        raise AuthError(grpc.StatusCode.PERMISSION_DENIED, "model_not_allowed",
                        f"tenant {tenant.id!r} may not use model {model!r}; its keys "
                        f"allow {allowed}")

    @staticmethod
    def visible_models(tenant: Tenant | None, models: Iterable[str]) -> list[str]:
        """The served models ``tenant`` may use (all with auth off): what
        ListModels and ``GET /v1/models`` list, as OpenAI lists a key's models."""
        return [m for m in models if tenant is None or tenant.may_use(m)]

    def _auth_failed(self, reason: str) -> None:
        self._metrics.auth_failures.labels(reason).inc()

    # --------------------------------------------------------------- limits

    def background_refusal(self, request: GenerationRequest) -> TenantLimited | None:
        """Why background work on ``request.tenant``'s behalf (a history
        summary: ``request`` is its generation) may not start now: the
        refusal :meth:`run` would meet, its token reservation counted as
        ``max_tokens`` alone (the prompt is not made yet); None when it may,
        or when auth is off. Counts nothing."""
        tenant = self._tenant_of(request)
        if tenant is None:
            return None
        return self.limiter.check(tenant.id, tenant.limits,
                                  tokens=request.sampling.max_tokens * request.sampling.n)

    def run_background(self, request: GenerationRequest, pipeline: GenerationPipeline
                       ) -> AsyncIterator[Event]:
        """``request`` (background work on ``request.tenant``'s behalf) run as
        that tenant (:meth:`run`: its limits, usage and metrics), or as is
        with auth off. A tenant the key file no longer has is refused
        PERMISSION_DENIED."""
        received_at = time.monotonic()
        if self.table is None:
            return pipeline.run(request, received_at=received_at)
        tenant = self._tenant_of(request)
        if tenant is None:
            raise GenerationError(grpc.StatusCode.PERMISSION_DENIED,
                                  f"tenant {request.tenant!r} is no longer in the key file")
        return self.run(tenant, request, pipeline, received_at=received_at, deadline=None,
                        background=True)

    def _tenant_of(self, request: GenerationRequest) -> Tenant | None:
        return None if self.table is None else self.table.tenants.get(request.tenant)

    async def run(self, tenant: Tenant, request: GenerationRequest,
                  pipeline: GenerationPipeline, *, received_at: float,
                  deadline: float | None, progress: Progress | None = None,
                  session: RoutingSession | None = None,
                  background: bool = False) -> AsyncIterator[Event]:
        """``pipeline.run(request, ...)`` under ``tenant``'s limits (with auth
        off the router calls the pipeline directly: no layer per event);
        ``background``: work on the tenant's behalf, holding no concurrency
        slot (:meth:`TenantLimiter.begin`).

        Raises:
          GenerationError: RESOURCE_EXHAUSTED (``retry-after-ms``) when the
            tenant is over a limit; and whatever the pipeline raises.
          InvalidRequestError: OUT_OF_RANGE, the reservation alone passes
            ``tokens_per_minute``.
        """
        try:
            lease = self.limiter.begin(tenant.id, tenant.limits, background=background)
        except TenantLimited as err:
            self._observer.ended(tenant.id, "resource_exhausted")
            self._metrics.observe_refused(model=request.model, outcome="resource_exhausted",
                                          priority=request.priority.name.lower())
            raise GenerationError.refused(err) from None
        progress = Progress() if progress is None else progress

        def reserve(prompt_tokens: int, max_tokens: int) -> None:
            try:
                lease.reserve(prompt_tokens, max_tokens, prompt_field=request.input_field,
                              retrieval=request.retrieval is not None)
            except TenantLimited as err:
                raise GenerationError.refused(err) from None

        outcome, failed = "cancelled", False
        try:
            events = pipeline.run(request, received_at=received_at, deadline=deadline,
                                  progress=progress, session=session, reserve_tokens=reserve)
            async with contextlib.aclosing(events):
                async for event in events:
                    if isinstance(event, Finished):
                        outcome = event.reason.name.lower()
                    yield event
        except PromptRerouted:
            # The cascade's large leg serves the request: it counts there.
            outcome, failed = "rerouted", True
            lease.refund_request()
            raise
        except (GenerationError, InvalidRequestError) as err:
            outcome, failed = err.code.name.lower(), True
            raise
        except Exception:
            outcome, failed = "internal", True
            raise
        finally:
            lease.end(prompt_tokens=progress.prompt_tokens,
                      completion_tokens=progress.completion_tokens, failed=failed)
            self._observer.ended(tenant.id, outcome)


__all__ = ["AuthError", "EMPTY_BEARER_MESSAGE", "INVALID_KEY_MESSAGE", "MISSING_KEY_MESSAGE",
           "NOT_BEARER_MESSAGE", "Tenancy"]
