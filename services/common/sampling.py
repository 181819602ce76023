"""Sampling parameters and finish reasons as typed values inside the services.

Protobuf stays at the service edges: a servicer converts ``llmesh.v1.SamplingParams``
with :meth:`SamplingOptions.from_pb` (which validates every field) and works with
the frozen dataclass from then on.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import grpc

from llmesh.v1 import common_pb2


#: Temperatures below this are greedy (as in vLLM): logits / 1e-40 overflow to inf.
GREEDY_TEMPERATURE_EPSILON = 1e-5


class FinishReason(enum.IntEnum):
    """Why a sequence ended; values equal ``llmesh.v1.FinishReason``."""

    NONE = common_pb2.FINISH_REASON_UNSPECIFIED
    STOP = common_pb2.FINISH_REASON_STOP
    LENGTH = common_pb2.FINISH_REASON_LENGTH
    CANCELLED = common_pb2.FINISH_REASON_CANCELLED
    ERROR = common_pb2.FINISH_REASON_ERROR


class Priority(enum.IntEnum):
    """Traffic class; lower value is scheduled first."""

    INTERACTIVE = 0
    BATCH = 1

    @classmethod
    def from_pb(cls, value: int) -> Priority:
        return cls.BATCH if value == common_pb2.PRIORITY_BATCH else cls.INTERACTIVE

    def to_pb(self) -> int:
        return common_pb2.PRIORITY_BATCH if self is Priority.BATCH else common_pb2.PRIORITY_INTERACTIVE


class InvalidRequestError(ValueError):
    """A request field is out of bounds.

    Attributes:
      field: dotted field name as the client wrote it (``sampling.top_p``).
      code: the gRPC status to return (INVALID_ARGUMENT or OUT_OF_RANGE).
    """

    def __init__(self, field: str, message: str,
                 code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.code = code


@dataclass(frozen=True)
class SamplingOptions:
    """Validated sampling and stopping parameters of one request.

    Attributes:
      temperature: softmax temperature; 0 means greedy (argmax), and so does any
        value below :data:`GREEDY_TEMPERATURE_EPSILON` (it is stored as 0).
      top_p: nucleus mass in (0, 1]; 1 disables it.
      top_k: keep the k most likely tokens; 0 disables it.
      seed: seed of the request's own generator, or None (random).
      max_tokens: most tokens to generate (>= 1).
      stop: stop strings (matched on text by the router).
      stop_token_ids: token ids that end the sequence (matched by the engine).
      ignore_eos: do not stop at the model's EOS token.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (temperature 0)."""
        return self.temperature == 0.0

    @property
    def deterministic(self) -> bool:
        """True when the output is a function of the input (greedy or seeded)."""
        return self.greedy or self.seed is not None

    @classmethod
    def from_pb(
        cls, pb: common_pb2.SamplingParams, *, default_max_tokens: int, max_tokens_cap: int,
        vocab_size: int | None = None, field_prefix: str = "sampling",
    ) -> SamplingOptions:
        """Validates ``pb`` and converts it.

        Raises:
          InvalidRequestError: naming the first bad field (INVALID_ARGUMENT for a
            malformed value, OUT_OF_RANGE for max_tokens above the cap).
        """
        def bad(field: str, message: str,
                code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT) -> InvalidRequestError:
            return InvalidRequestError(f"{field_prefix}.{field}", message, code)

        temperature = pb.temperature if pb.HasField("temperature") else 0.0
        if not temperature >= 0.0 or temperature == float("inf"):
            raise bad("temperature", f"must be a finite number >= 0, got {temperature}")
        if temperature < GREEDY_TEMPERATURE_EPSILON:
            temperature = 0.0  # dividing logits by it would overflow: it means greedy
        top_p = pb.top_p if pb.HasField("top_p") else 1.0
        if not 0.0 < top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {top_p}")
        top_k = pb.top_k if pb.HasField("top_k") else 0
        if top_k < 0:
            raise bad("top_k", f"must be >= 0 (0 disables it), got {top_k}")
        max_tokens = pb.max_tokens if pb.HasField("max_tokens") else default_max_tokens
        if max_tokens <= 0:
            raise bad("max_tokens", f"must be >= 1, got {max_tokens}")
        if max_tokens > max_tokens_cap:
            raise bad("max_tokens", f"must be <= {max_tokens_cap} (server cap), got {max_tokens}",
                      grpc.StatusCode.OUT_OF_RANGE)
        if any(s == "" for s in pb.stop):
            raise bad("stop", "stop strings must be non-empty")
        for token_id in pb.stop_token_ids:
            if token_id < 0:
                raise bad("stop_token_ids", f"token id {token_id} is negative (ids are >= 0)")
            if vocab_size is not None and token_id >= vocab_size:
                raise bad("stop_token_ids", f"token id {token_id} is outside the vocabulary "
                          f"[0, {vocab_size})")
        return cls(
            temperature=float(temperature),
            top_p=float(top_p),
            top_k=int(top_k),
            seed=int(pb.seed) if pb.HasField("seed") else None,
            max_tokens=int(max_tokens),
            stop=tuple(pb.stop),
            stop_token_ids=tuple(pb.stop_token_ids),
            ignore_eos=pb.ignore_eos,
        )

    def to_pb(self) -> common_pb2.SamplingParams:
        """The protobuf form, with every field set explicitly."""
        pb = common_pb2.SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            max_tokens=self.max_tokens, stop=list(self.stop),
            stop_token_ids=list(self.stop_token_ids), ignore_eos=self.ignore_eos,
        )
        if self.seed is not None:
            pb.seed = self.seed
        return pb


#: Most speculative tokens a request may ask for per step.
MAX_SPECULATIVE_TOKENS = 16


class SpeculativeMethod(enum.Enum):
    """Where speculative tokens come from (``llmesh.v1.SpeculativeMethod``)."""

    NONE = "none"
    NGRAM = "ngram"
    DRAFT = "draft"

    @classmethod
    def parse(cls, name: str) -> SpeculativeMethod:
        """``"ngram"`` → NGRAM.

        Raises:
          ValueError: an unknown name (the message lists the known ones).
        """
        try:
            return cls(name.strip().lower())
        except ValueError:
            known = ", ".join(m.value for m in cls)
            raise ValueError(f"unknown speculative method {name!r}; choose {known}") from None


_METHOD_FROM_PB = {
    common_pb2.SPECULATIVE_METHOD_NONE: SpeculativeMethod.NONE,
    common_pb2.SPECULATIVE_METHOD_NGRAM: SpeculativeMethod.NGRAM,
    common_pb2.SPECULATIVE_METHOD_DRAFT: SpeculativeMethod.DRAFT,
}
_METHOD_TO_PB = {method: number for number, method in _METHOD_FROM_PB.items()}


@dataclass(frozen=True)
class SpeculativeOptions:
    """A request's speculative decoding switch; None fields take the engine's defaults.

    Attributes:
      method: the proposer, NONE to turn speculation off, None for the default.
      num_speculative_tokens: most tokens proposed per step (1..16), None for the default.
    """

    method: SpeculativeMethod | None = None
    num_speculative_tokens: int | None = None

    @classmethod
    def from_pb(cls, pb: common_pb2.SpeculativeParams,
                field_prefix: str = "speculative") -> SpeculativeOptions:
        """Validates ``pb`` and converts it.

        Raises:
          InvalidRequestError: INVALID_ARGUMENT for an unknown method or a count
            outside ``[1, MAX_SPECULATIVE_TOKENS]``.
        """
        method: SpeculativeMethod | None = None
        if pb.method != common_pb2.SPECULATIVE_METHOD_UNSPECIFIED:
            if pb.method not in _METHOD_FROM_PB:
                raise InvalidRequestError(
                    f"{field_prefix}.method",
                    f"unknown value {pb.method}; use SPECULATIVE_METHOD_NONE (1), "
                    "SPECULATIVE_METHOD_NGRAM (2) or SPECULATIVE_METHOD_DRAFT (3), or leave it "
                    "unset for the engine's default")
            method = _METHOD_FROM_PB[pb.method]
        count: int | None = None
        if pb.HasField("num_speculative_tokens"):
            count = pb.num_speculative_tokens
            if not 1 <= count <= MAX_SPECULATIVE_TOKENS:
                raise InvalidRequestError(
                    f"{field_prefix}.num_speculative_tokens",
                    f"must be in [1, {MAX_SPECULATIVE_TOKENS}] (or unset for the engine's "
                    f"default; method NONE turns speculation off), got {count}")
        return cls(method, count)

    def to_pb(self) -> common_pb2.SpeculativeParams:
        """The protobuf form (unset fields stay unset)."""
        pb = common_pb2.SpeculativeParams()
        if self.method is not None:
            pb.method = _METHOD_TO_PB[self.method]
        if self.num_speculative_tokens is not None:
            pb.num_speculative_tokens = self.num_speculative_tokens
        return pb
