"""The cascade at the router's edges: a request to the alias validated once
(against both models), and the alias's model card (ListModels, ``/v1/models``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from llmesh.v1 import generation_pb2
from services.common.sampling import InvalidRequestError
from services.router.cascade.policy import CascadeLeg, CascadeMode, CascadePolicy
from services.router.validation import GenerationRequest, ModelLimits

#: Validates a request as one served model (the router's own validation).
ValidateAs = Callable[[generation_pb2.GenerateRequest], GenerationRequest]


def validate_alias(pb: generation_pb2.GenerateRequest, header_mode: str | None,
                   policy: CascadePolicy | None, validate_as: ValidateAs, *,
                   tenant_mode: CascadeMode | None = None) -> GenerationRequest | None:
    """The validated request when ``pb`` names the cascade alias (``model`` the
    small one, ``cascade`` its mode: :meth:`CascadeMode.of`, ``tenant_mode``
    the tenant's default), else None (a request to a model; its ``cascade``
    field must be unset).

    Both models validate the request (each its limits, chat template and the
    tenant's permission), so a request one of them would refuse is refused
    before any generation, whatever path it would take; in mode ``small``
    (the large model is never asked) the small model alone validates it.

    Raises:
      InvalidRequestError: INVALID_ARGUMENT naming ``cascade`` (set on a
        request to another model, or unknown), ``x-llmesh-cascade``, or
        ``prompt_tokens`` (token ids are one model's: the legs tokenize
        apart); and whatever ``validate_as`` raises.
    """
    if policy is None or pb.model != policy.alias:
        if pb.cascade:
            alias = "none is configured" if policy is None else repr(policy.alias)
            raise InvalidRequestError("cascade", f"is for the cascade's alias model only "
                                      f"({alias})")
        return None
    if pb.WhichOneof("input") == "prompt_tokens":
        raise InvalidRequestError("prompt_tokens", "token ids belong to one model's "
                                  "vocabulary and the cascade's models tokenize apart: send "
                                  "`prompt` text, or name a model")
    mode = CascadeMode.of(pb.cascade, header_mode, tenant_mode)
    validated: list[GenerationRequest] = []
    reachable = (policy.small,) if mode is CascadeMode.SMALL else (policy.small, policy.large)
    for model in reachable:
        leg = generation_pb2.GenerateRequest()
        leg.CopyFrom(pb)
        leg.model = model
        leg.ClearField("cascade")
        validated.append(validate_as(leg))
    return dataclasses.replace(validated[0], cascade=CascadeLeg(policy.alias, mode))


def alias_card(policy: CascadePolicy | None,
               visible: Mapping[str, ModelLimits]) -> ModelLimits | None:
    """The alias's limits (the tighter of the two models'), or None when no
    cascade is configured or the caller cannot see both models."""
    if policy is None or policy.small not in visible or policy.large not in visible:
        return None
    small, large = visible[policy.small], visible[policy.large]
    return dataclasses.replace(
        small, model=policy.alias, max_model_len=min(small.max_model_len, large.max_model_len),
        max_tokens_cap=min(small.max_tokens_cap, large.max_tokens_cap),
        has_chat_template=small.has_chat_template and large.has_chat_template)


def served_problem(policy: CascadePolicy | None, served: Mapping[str, ModelLimits], *,
                   complete: bool) -> str | None:
    """What keeps the router from serving ``policy`` over the ``served``
    models (checked at start, naming the flag), or None.

    Args:
      complete: every pool is open (a model missing now is missing for good).

    A window longer than the small model's context window could never fill:
    the whole answer would be held back (QA: ``--cascade-window 1000000000``
    was accepted).
    """
    if policy is None:
        return None
    missing = {policy.small, policy.large} - set(served)
    if missing and complete:
        return (f"--cascade names {sorted(missing)}, which no pool serves "
                f"(served: {sorted(served)})")
    small = served.get(policy.small)
    if small is not None and policy.window_tokens > small.max_model_len:
        return (f"--cascade-window {policy.window_tokens}: more than the small model "
                f"{policy.small!r}'s context window ({small.max_model_len} tokens); the "
                "window could never fill and every answer would be held back whole")
    return None


__all__ = ["alias_card", "served_problem", "validate_alias"]
