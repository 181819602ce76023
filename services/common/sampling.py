"""Sampling parameters and finish reasons as typed values inside the services.

Protobuf stays at the service edges: a servicer converts ``llmesh.v1.SamplingParams``
with :meth:`SamplingOptions.from_pb` (which validates every field) and works with
the frozen dataclass from then on.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

import grpc

from llmesh.v1 import common_pb2


#: Temperatures below this are greedy (as in vLLM): logits / 1e-40 overflow to inf.
GREEDY_TEMPERATURE_EPSILON = 1e-5
#: Most alternatives per position ``logprobs`` / ``prompt_logprobs`` may ask for
#: (OpenAI's ``top_logprobs`` limit).
MAX_LOGPROBS = 20
#: Most independent samples (``n``) one request may ask for.
MAX_N = 16
#: Most ``logit_bias`` entries, and the bound on each bias (OpenAI's limits).
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_LOGIT_BIAS = 100.0
#: Bounds of ``presence_penalty`` / ``frequency_penalty`` (OpenAI's) and of
#: ``repetition_penalty`` (vLLM accepts any > 0; above 10 only bans tokens).
MAX_ADDITIVE_PENALTY = 2.0
MAX_REPETITION_PENALTY = 10.0


class FinishReason(enum.IntEnum):
    """Why a sequence ended; values equal ``llmesh.v1.FinishReason``."""

    NONE = common_pb2.FINISH_REASON_UNSPECIFIED
    STOP = common_pb2.FINISH_REASON_STOP
    LENGTH = common_pb2.FINISH_REASON_LENGTH
    CANCELLED = common_pb2.FINISH_REASON_CANCELLED
    ERROR = common_pb2.FINISH_REASON_ERROR
    TOOL_CALLS = common_pb2.FINISH_REASON_TOOL_CALLS

    @classmethod
    def from_pb(cls, value: int) -> FinishReason:
        """``value`` as a :class:`FinishReason`; an unknown value counts as ERROR."""
        try:
            return cls(value)
        except ValueError:
            return cls.ERROR


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


#: llguidance's JSON compile options for every JSON constraint (schemas,
#: ``json_object``, tool-call arguments): one space after ``,`` and ``:``, no
#: other whitespace, so the output is compact and the same for every sample.
JSON_COMPILE_OPTIONS = {"item_separator": ", ", "key_separator": ": ",
                        "whitespace_flexible": False}


class ConstraintKind(enum.Enum):
    """What a :class:`StructuredOutput` constrains the output to
    (``llmesh.v1.StructuredOutput``'s oneof)."""

    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    GRAMMAR = "grammar"
    CHOICE = "choice"


@dataclass(frozen=True)
class StructuredOutput:
    """An output constraint as the engine compiles it.

    Attributes:
      kind: which constraint.
      spec: the JSON schema text (JSON_SCHEMA), the regex (REGEX), the grammar
        (GRAMMAR: Lark, or GBNF when it contains ``::=``); empty for
        JSON_OBJECT and CHOICE.
      choices: the allowed strings (CHOICE only).
    """

    kind: ConstraintKind
    spec: str = ""
    choices: tuple[str, ...] = ()

    @classmethod
    def from_pb(cls, pb: common_pb2.StructuredOutput,
                field: str = "sampling.structured_output") -> StructuredOutput | None:
        """None when no constraint is set.

        Raises:
          InvalidRequestError: an empty schema, regex or grammar, a schema that
            is not a JSON object, ``json_object: false``, or a choice list that
            is empty or has an empty string. (Whether it compiles is the
            engine's to say.)
        """
        which = pb.WhichOneof("constraint")
        if which is None:
            return None
        kind = ConstraintKind(which)
        where = f"{field}.{which}"
        if kind is ConstraintKind.JSON_OBJECT:
            if not pb.json_object:
                raise InvalidRequestError(where, "set it to true, or set no constraint")
            return cls(kind)
        if kind is ConstraintKind.CHOICE:
            choices = tuple(pb.choice.choices)
            if not choices:
                raise InvalidRequestError(f"{where}.choices", "give at least one string")
            if any(c == "" for c in choices):
                raise InvalidRequestError(f"{where}.choices", "choices must be non-empty")
            return cls(kind, choices=choices)
        spec = getattr(pb, which)
        if not spec.strip():
            raise InvalidRequestError(where, "must not be empty")
        if kind is ConstraintKind.JSON_SCHEMA:
            try:
                schema = json.loads(spec)
            except ValueError as err:
                raise InvalidRequestError(where, f"is not valid JSON: {err}") from None
            if not isinstance(schema, dict | bool):
                raise InvalidRequestError(
                    where, f"a JSON schema is an object or a boolean, got {type(schema).__name__}")
        return cls(kind, spec)

    def to_pb(self) -> common_pb2.StructuredOutput:
        if self.kind is ConstraintKind.JSON_OBJECT:
            return common_pb2.StructuredOutput(json_object=True)
        if self.kind is ConstraintKind.CHOICE:
            return common_pb2.StructuredOutput(
                choice=common_pb2.ChoiceConstraint(choices=list(self.choices)))
        return common_pb2.StructuredOutput(**{self.kind.value: self.spec})


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
      logprobs: alternatives per generated token to return (0..20; 0 the
        chosen token's own only), None for no log-probabilities.
      prompt_logprobs: the same for the prompt tokens, None for none.
      n: independent samples of the prompt (1..16); choice i is seeded with
        ``seed + i`` when ``seed`` is set.
      presence_penalty: subtracted once from each generated token's logit, [-2, 2].
      frequency_penalty: subtracted per occurrence of each generated token, [-2, 2].
      repetition_penalty: > 0, 1 off; divides positive / multiplies negative
        logits of tokens in the prompt or output.
      min_tokens: EOS and stop token ids are masked before this many tokens.
        With a constraint the output is extended inside the grammar; a choice
        constraint cannot be, so ``min_tokens`` > 1 beside one is refused, and a
        grammar that admits nothing more before ``min_tokens`` ends the request
        with an error naming both (the engine's scheduler).
      logit_bias: ``(token id, bias)`` pairs, sorted by id, added to the logits.
      include_stop_str_in_output: keep a matched stop string in the text.
      structured_output: the output constraint, or None.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    include_stop_str_in_output: bool = False
    structured_output: StructuredOutput | None = None

    @property
    def has_penalties(self) -> bool:
        """True when a penalty, ``min_tokens`` or ``logit_bias`` changes the logits."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.min_tokens or self.logit_bias)

    @property
    def plain(self) -> bool:
        """True when only the original fields (temperature .. ignore_eos) are
        used: the response cache stores only such requests (its key covers
        nothing else)."""
        return (self.logprobs is None and self.prompt_logprobs is None and self.n == 1
                and not self.has_penalties and not self.include_stop_str_in_output
                and self.structured_output is None)

    def choice_seed(self, index: int) -> int | None:
        """The seed of choice ``index`` (``seed + index`` modulo 2**64), None when unseeded."""
        return None if self.seed is None else (self.seed + index) % 2**64

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

        temperature, top_p, top_k = _sampler_fields(pb, bad)
        max_tokens = _max_tokens(pb, default_max_tokens, max_tokens_cap, bad)
        _check_stops(pb, vocab_size, bad)
        logprobs = _optional_count(pb, "logprobs", 0, MAX_LOGPROBS, bad)
        prompt_logprobs = _optional_count(pb, "prompt_logprobs", 0, MAX_LOGPROBS, bad)
        n = _optional_count(pb, "n", 1, MAX_N, bad)
        presence = _penalty(pb, "presence_penalty", 0.0, bad)
        frequency = _penalty(pb, "frequency_penalty", 0.0, bad)
        repetition = pb.repetition_penalty if pb.HasField("repetition_penalty") else 1.0
        if not 0.0 < repetition <= MAX_REPETITION_PENALTY:
            raise bad("repetition_penalty",
                      f"must be in (0, {MAX_REPETITION_PENALTY:g}] (1 is off), got {repetition}")
        min_tokens = pb.min_tokens if pb.HasField("min_tokens") else 0
        if not 0 <= min_tokens <= max_tokens:
            raise bad("min_tokens", f"must be in [0, max_tokens = {max_tokens}], got {min_tokens}")
        logit_bias = _logit_bias(pb, vocab_size, bad)
        structured = _structured_output(pb, min_tokens, field_prefix, bad)
        return cls(
            temperature=float(temperature),
            top_p=float(top_p),
            top_k=int(top_k),
            seed=int(pb.seed) if pb.HasField("seed") else None,
            max_tokens=int(max_tokens),
            stop=tuple(pb.stop),
            stop_token_ids=tuple(pb.stop_token_ids),
            ignore_eos=pb.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            n=1 if n is None else n,
            presence_penalty=presence,
            frequency_penalty=frequency,
            repetition_penalty=float(repetition),
            min_tokens=int(min_tokens),
            logit_bias=logit_bias,
            include_stop_str_in_output=pb.include_stop_str_in_output,
            structured_output=structured,
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
        if self.logprobs is not None:
            pb.logprobs = self.logprobs
        if self.prompt_logprobs is not None:
            pb.prompt_logprobs = self.prompt_logprobs
        if self.n != 1:
            pb.n = self.n
        if self.presence_penalty:
            pb.presence_penalty = self.presence_penalty
        if self.frequency_penalty:
            pb.frequency_penalty = self.frequency_penalty
        if self.repetition_penalty != 1.0:
            pb.repetition_penalty = self.repetition_penalty
        if self.min_tokens:
            pb.min_tokens = self.min_tokens
        pb.logit_bias.update(dict(self.logit_bias))
        pb.include_stop_str_in_output = self.include_stop_str_in_output
        if self.structured_output is not None:
            pb.structured_output.CopyFrom(self.structured_output.to_pb())
        return pb


def _sampler_fields(pb: common_pb2.SamplingParams, bad) -> tuple[float, float, int]:
    """``temperature`` (below :data:`GREEDY_TEMPERATURE_EPSILON` folded to 0:
    greedy), ``top_p`` and ``top_k``, checked, with their defaults when unset."""
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
    return float(temperature), float(top_p), int(top_k)


def _max_tokens(pb: common_pb2.SamplingParams, default: int, cap: int, bad) -> int:
    """``max_tokens`` (``default`` when unset) in ``[1, cap]``; OUT_OF_RANGE above the cap."""
    max_tokens = pb.max_tokens if pb.HasField("max_tokens") else default
    if max_tokens <= 0:
        raise bad("max_tokens", f"must be >= 1, got {max_tokens}")
    if max_tokens > cap:
        raise bad("max_tokens", f"must be <= {cap} (server cap), got {max_tokens}",
                  grpc.StatusCode.OUT_OF_RANGE)
    return int(max_tokens)


def _check_stops(pb: common_pb2.SamplingParams, vocab_size: int | None, bad) -> None:
    """Stop strings non-empty; stop token ids >= 0 (and in the vocabulary when known)."""
    if any(s == "" for s in pb.stop):
        raise bad("stop", "stop strings must be non-empty")
    for token_id in pb.stop_token_ids:
        if token_id < 0:
            raise bad("stop_token_ids", f"token id {token_id} is negative (ids are >= 0)")
        if vocab_size is not None and token_id >= vocab_size:
            raise bad("stop_token_ids", f"token id {token_id} is outside the vocabulary "
                      f"[0, {vocab_size})")


def _logit_bias(pb: common_pb2.SamplingParams, vocab_size: int | None,
                bad) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` checked (entries, ids, bias range), sorted by token id."""
    if len(pb.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad("logit_bias", f"at most {MAX_LOGIT_BIAS_ENTRIES} entries, "
                  f"got {len(pb.logit_bias)}")
    for token_id, bias in pb.logit_bias.items():
        if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
            raise bad("logit_bias", f"token id {token_id} is outside the vocabulary "
                      f"[0, {vocab_size if vocab_size is not None else 'vocab_size'})")
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise bad("logit_bias", f"the bias of token {token_id} must be in "
                      f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias}")
    return tuple(sorted((int(t), float(b)) for t, b in pb.logit_bias.items()))


def _structured_output(pb: common_pb2.SamplingParams, min_tokens: int, field_prefix: str,
                       bad) -> StructuredOutput | None:
    """The output constraint (None: none), refused beside a ``min_tokens`` > 1
    that a choice constraint cannot honour."""
    structured = StructuredOutput.from_pb(pb.structured_output,
                                          f"{field_prefix}.structured_output")
    if structured is not None and structured.kind is ConstraintKind.CHOICE \
            and min_tokens > 1:
        raise bad("min_tokens", f"cannot be honoured beside a choice constraint "
                  f"({field_prefix}.structured_output.choice): the output is one of the "
                  f"given strings, which min_tokens cannot lengthen; leave min_tokens at "
                  f"0 or 1, or constrain with a regex, JSON schema or grammar, which it "
                  f"can extend")
    return structured


def _optional_count(pb: common_pb2.SamplingParams, field: str, low: int, high: int,
                    bad) -> int | None:
    """``pb.<field>`` checked to lie in ``[low, high]``, None when unset."""
    if not pb.HasField(field):
        return None
    value = getattr(pb, field)
    if not low <= value <= high:
        raise bad(field, f"must be in [{low}, {high}], got {value}")
    return int(value)


def _penalty(pb: common_pb2.SamplingParams, field: str, default: float, bad) -> float:
    """An additive penalty checked to lie in [-2, 2] (0 when unset)."""
    value = getattr(pb, field) if pb.HasField(field) else default
    if not -MAX_ADDITIVE_PENALTY <= value <= MAX_ADDITIVE_PENALTY:
        raise bad(field, f"must be in [-{MAX_ADDITIVE_PENALTY:g}, {MAX_ADDITIVE_PENALTY:g}], "
                  f"got {value}")
    return float(value)


#: Most speculative tokens a request may ask for per step.
MAX_SPECULATIVE_TOKENS = 16


class SpeculativeMethod(enum.Enum):
    """Where speculative tokens come from (``llmesh.v1.SpeculativeMethod``)."""

    NONE = "none"
    NGRAM = "ngram"
    DRAFT = "draft"
    SUFFIX = "suffix"

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
    common_pb2.SPECULATIVE_METHOD_SUFFIX: SpeculativeMethod.SUFFIX,
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
                    "SPECULATIVE_METHOD_NGRAM (2), SPECULATIVE_METHOD_DRAFT (3) or "
                    "SPECULATIVE_METHOD_SUFFIX (4), or leave it unset for the engine's default")
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
