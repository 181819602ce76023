"""The cascade's policy (router flags) and a request's mode, validated once.

A request names the cascade by its alias model id; its mode comes from the
request's ``cascade`` field, else the ``x-llmesh-cascade`` header (gRPC
metadata or HTTP header), else its tenant's ``cascade`` setting (the API key
file), else ``auto``.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from llmesh.v1 import generation_pb2
from services.common.sampling import InvalidRequestError
from services.router.cascade.path import AnswerPath

#: The request header (gRPC metadata, HTTP header) that picks the path.
MODE_HEADER = "x-llmesh-cascade"

_MODEL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class CascadeMode(enum.Enum):
    """How a request to the alias is served (``GenerateRequest.cascade``)."""

    AUTO = "auto"
    SMALL = "small"
    LARGE = "large"

    @classmethod
    def of(cls, pb: int, header: str | None,
           tenant_default: CascadeMode | None = None) -> CascadeMode:
        """The mode of a request: the field when set, else the header, else
        the tenant's setting (its key file entry's ``cascade``), else AUTO.

        Raises:
          InvalidRequestError: INVALID_ARGUMENT naming ``cascade`` (an enum
            value this router does not know) or the header (not auto, small
            or large).
        """
        by_pb = {generation_pb2.CASCADE_MODE_AUTO: cls.AUTO,
                 generation_pb2.CASCADE_MODE_SMALL: cls.SMALL,
                 generation_pb2.CASCADE_MODE_LARGE: cls.LARGE}
        if pb:
            if pb not in by_pb:
                raise InvalidRequestError("cascade", f"unknown CascadeMode value {pb}")
            return by_pb[pb]
        if header is None or not header.strip():
            return cls.AUTO if tenant_default is None else tenant_default
        try:
            return cls(header.strip().lower())
        except ValueError:
            raise InvalidRequestError(MODE_HEADER, f"must be auto, small or large, "
                                      f"got {header[:32]!r}") from None


@dataclass(frozen=True)
class CascadePolicy:
    """The router's cascade (``--cascade SMALL,LARGE`` and its knobs).

    Attributes:
      small: the model tried first.
      large: the model a request escalates to.
      alias: the model id that asks for the cascade (listed by ListModels).
      window_tokens: ``k``, the small model's tokens held back while the
        rule decides (fewer when the generation ends sooner).
      min_mean_logprob: escalate when the mean chosen-token logprob over the
        window is below this (nats; FrugalGPT's generation-score threshold).
      margin: a position is "low margin" when its top-1 minus top-2 logprob
        is below this (nats); 0 turns the margin rule off.
      max_low_margin_share: escalate when more than this share of the
        window's positions are low margin (with ``margin`` > 0).
      max_prompt_tokens: the prompt-only rule: a prompt longer than this
        (in the small model's tokens) goes straight to the large model; 0: off.
    """

    small: str
    large: str
    alias: str = "auto"
    window_tokens: int = 8
    min_mean_logprob: float = -1.0
    margin: float = 0.0
    max_low_margin_share: float = 0.5
    max_prompt_tokens: int = 0

    def __post_init__(self) -> None:
        for name in (self.small, self.large, self.alias):
            if not _MODEL_ID.fullmatch(name):
                raise ValueError(f"--cascade: {name!r} is not a model id")
        if len({self.small, self.large, self.alias}) != 3:
            raise ValueError(f"--cascade: the small model ({self.small}), the large one "
                             f"({self.large}) and the alias ({self.alias}) must differ")
        if self.window_tokens < 1:
            raise ValueError(f"--cascade-window must be >= 1, got {self.window_tokens}")
        if not self.min_mean_logprob <= 0:  # NaN too: it would never escalate
            raise ValueError("--cascade-min-mean-logprob is a log-probability: <= 0, got "
                             f"{self.min_mean_logprob:g}")
        if self.margin < 0 or not 0 <= self.max_low_margin_share <= 1:
            raise ValueError("--cascade-margin must be >= 0 and --cascade-max-low-margin-"
                             "share in [0, 1]")
        if self.max_prompt_tokens < 0:
            raise ValueError("--cascade-max-prompt-tokens must be >= 0 (0: off)")

    @property
    def internal_logprobs(self) -> int:
        """Alternatives per position the small engine is asked for: 2 for the
        margin rule (the top-2), else 0 (the chosen token's own logprob)."""
        return 2 if self.margin > 0 else 0

    def describe(self) -> str:
        """The policy in one line (logs)."""
        return (f"{self.alias}={self.small}->{self.large} k={self.window_tokens} "
                f"min_mean_logprob={self.min_mean_logprob:g} margin={self.margin:g} "
                f"max_low_margin_share={self.max_low_margin_share:g} "
                f"max_prompt_tokens={self.max_prompt_tokens}")


class PromptRerouted(Exception):
    """A leg's prompt is too long for the small model (:meth:`CascadeLeg.check_prompt`):
    the leg ends before admission (its ``request_finished`` outcome
    ``rerouted``, nothing billed) and the cascade serves the request from
    the large model.

    Attributes:
      prompt_tokens: the prompt's length in the small model's tokens.
      limit: ``--cascade-max-prompt-tokens``.
    """

    def __init__(self, prompt_tokens: int, limit: int) -> None:
        super().__init__(f"the prompt's {prompt_tokens} tokens pass "
                         f"--cascade-max-prompt-tokens ({limit})")
        self.prompt_tokens = prompt_tokens
        self.limit = limit


@dataclass
class CascadeLeg:
    """What a cascade request carries through the pipeline
    (``GenerationRequest.cascade``): its mode, and once the runner runs a
    leg, which one and (set when decided) the path. The runner owns it; the
    pipeline only reads it for the ``request_finished`` log line.

    Attributes:
      alias: the model id the client named.
      mode: the request's mode.
      leg: ``small`` or ``large`` once a leg runs; "" on the validated request.
      path: the path, once decided.
      discarded: this leg's generation was cancelled by an escalation.
      max_prompt_tokens: the prompt-only rule on this leg (:meth:`check_prompt`;
        0: off).
    """

    alias: str
    mode: CascadeMode
    leg: str = ""
    path: AnswerPath | None = None
    discarded: bool = False
    max_prompt_tokens: int = 0

    def check_prompt(self, prompt_tokens: int) -> None:
        """The prompt-only rule, on the leg's own prompt: the pipeline calls
        it once the prompt is made (after its retrieval and history steps,
        the ids it tokenized once), before admission.

        Raises:
          PromptRerouted: the prompt is longer than ``max_prompt_tokens``
            (> 0): the large model serves the request instead.
        """
        if self.max_prompt_tokens and prompt_tokens > self.max_prompt_tokens:
            raise PromptRerouted(prompt_tokens, self.max_prompt_tokens)

    def log_fields(self) -> dict[str, object]:
        fields: dict[str, object] = dict(cascade=self.alias, cascade_leg=self.leg,
                                         cascade_mode=self.mode.value)
        if self.discarded:
            fields.update(cascade_discarded=True)
        if self.path is not None:
            fields.update(self.path.log_fields())
        return fields


__all__ = ["MODE_HEADER", "CascadeLeg", "CascadeMode", "CascadePolicy", "PromptRerouted"]
