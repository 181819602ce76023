"""The cascade's flags, shared by the router and ``llmesh up`` (which passes
them on to its router)."""

from __future__ import annotations

import argparse

from services.router.cascade.policy import CascadePolicy

_DEFAULTS = CascadePolicy("small", "large")

#: (flag, attribute, type, metavar, help) of every knob after ``--cascade``.
_KNOBS: tuple[tuple[str, str, type, str, str], ...] = (
    ("--cascade-alias", "alias", str, "MODEL",
     f"the model id that asks for the cascade (default {_DEFAULTS.alias})"),
    ("--cascade-window", "window_tokens", int, "K",
     f"small-model tokens held back while the rule decides (default {_DEFAULTS.window_tokens})"),
    ("--cascade-min-mean-logprob", "min_mean_logprob", float, "NATS",
     "escalate when the mean token logprob over the window is below this "
     f"(default {_DEFAULTS.min_mean_logprob:g})"),
    ("--cascade-margin", "margin", float, "NATS",
     "a position whose top-1 minus top-2 logprob is below this is low-margin; 0: the "
     f"margin rule is off (default {_DEFAULTS.margin:g})"),
    ("--cascade-max-low-margin-share", "max_low_margin_share", float, "SHARE",
     "escalate when more of the window's positions than this are low-margin (default "
     f"{_DEFAULTS.max_low_margin_share:g})"),
    ("--cascade-max-prompt-tokens", "max_prompt_tokens", int, "N",
     "prompt-only rule: a longer prompt (small model's tokens) goes straight to the large "
     f"model; 0: off (default {_DEFAULTS.max_prompt_tokens})"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds ``--cascade SMALL,LARGE`` and its knobs (defaults: None, so that
    ``llmesh up`` passes on only what was set)."""
    group = parser.add_argument_group(
        "cascade", "a small model first, the large one only when the small model's own "
        "logprobs say so (services/router/cascade; README \"Cascade\")")
    group.add_argument("--cascade", default=None, metavar="SMALL,LARGE",
                       help="serve the alias model (--cascade-alias) as a cascade between two "
                            "served models; default off")
    for flag, _, kind, metavar, text in _KNOBS:
        group.add_argument(flag, type=kind, default=None, metavar=metavar, help=text)


def policy_from_args(args: argparse.Namespace) -> CascadePolicy | None:
    """The policy the flags ask for, or None without ``--cascade``.

    Raises:
      ValueError: ``--cascade`` is not two model ids, a knob without
        ``--cascade``, or a knob out of range (:class:`CascadePolicy`).
    """
    knobs = {attr: getattr(args, flag[2:].replace("-", "_"))
             for flag, attr, *_ in _KNOBS
             if getattr(args, flag[2:].replace("-", "_")) is not None}
    if args.cascade is None:
        if knobs:
            raise ValueError("--cascade-* flags need --cascade SMALL,LARGE")
        return None
    models = [m.strip() for m in args.cascade.split(",")]
    if len(models) != 2:
        raise ValueError(f"--cascade {args.cascade!r}: expected SMALL,LARGE (two model ids)")
    return CascadePolicy(models[0], models[1], **knobs)


def problem(args: argparse.Namespace, models: list[str]) -> str | None:
    """What is wrong with ``llmesh up``'s cascade flags given its ``--model``
    names (checked before any service starts), or None."""
    try:
        policy = policy_from_args(args)
    except ValueError as err:
        return str(err)
    if policy is None:
        return None
    missing = [m for m in (policy.small, policy.large) if m not in models]
    if missing:
        return (f"--cascade names {missing}, which no --model NAME=PATH serves "
                f"(served: {models or ['the default model only']})")
    return None


def router_args(args: argparse.Namespace) -> list[str]:
    """The flags set on ``llmesh up``, for its router."""
    out = [] if args.cascade is None else ["--cascade", args.cascade]
    for flag, *_ in _KNOBS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            out += [flag, str(value)]
    return out


__all__ = ["add_arguments", "policy_from_args", "problem", "router_args"]
