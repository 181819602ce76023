"""``SamplingOptions`` → the keyword arguments of TensorRT-LLM's ``SamplingParams``.

Every llmesh sampling field is classified here explicitly (:data:`SAMPLING_FIELDS`):
mapped, honoured by the router, or refused with INVALID_ARGUMENT naming the
field and why. Written against the documented
``tensorrt_llm.SamplingParams`` and ``tensorrt_llm.sampling_params.GuidedDecodingParams``
(https://nvidia.github.io/TensorRT-LLM/llm-api/reference.html#tensorrt_llm.llmapi.SamplingParams,
source ``tensorrt_llm/sampling_params.py``), the sampling guide
(https://nvidia.github.io/TensorRT-LLM/1.0.0/features/sampling.html), ``GuidedDecodingParams``
(https://nvidia.github.io/TensorRT-LLM/llm-api/reference/GuidedDecodingParams.html) and the
guided-decoding example (https://nvidia.github.io/TensorRT-LLM/examples/llm_guided_decoding.html).

Pure: no ``tensorrt_llm`` import. :func:`sampling_spec` returns plain kwargs;
the backend calls ``SamplingParams(**spec.params,
guided_decoding=GuidedDecodingParams(**spec.guided_decoding))``.

The table of every ``SamplingOptions`` field is :data:`SAMPLING_FIELDS` below
(that of the other ``SequenceRequest`` fields is
:data:`.request_map.REQUEST_FIELDS`): each is MAPPED to TensorRT-LLM, honoured
ELSEWHERE (the router), REFUSED with INVALID_ARGUMENT naming it, or IGNORED
with the reason that is safe. ``tests/engine/test_tensorrt_llm_mapping.py``
fails for a field without an entry, and checks each entry's claim on
:func:`.request_map.generate_args`.

Refusals and why (each INVALID_ARGUMENT naming the field):

* ``sampling.prompt_logprobs``: this backend streams generated tokens only.
* ``sampling.n`` with temperature 0: TensorRT-LLM's LLM API refuses several
  greedy returns (``SamplingParams._validate``: "Greedy decoding in the LLM API
  does not allow multiple returns").
* ``sampling.n`` with a seed: llmesh seeds choice ``i`` with ``seed + i``
  (reproducible one by one); TensorRT-LLM seeds a request once.
* ``sampling.min_tokens`` beside stop token ids or a second EOS id:
  TensorRT-LLM documents ``min_tokens`` as a lower bound held by ``end_id``;
  llmesh promises that stop token ids are masked too, which it does not
  document.
* ``sampling.structured_output.grammar`` in Lark: xgrammar's EBNF only.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from services.common.sampling import (
    ConstraintKind,
    InvalidRequestError,
    SamplingOptions,
    StructuredOutput,
)
from services.engine.validation import OPTIONAL_FEATURES

if TYPE_CHECKING:  # imported where a bias is built: a refused start needs no torch
    import torch


class Handling(enum.Enum):
    """What the tensorrt_llm backend does with one request field."""

    #: Becomes an argument of ``generate_async`` / ``SamplingParams``; some
    #: combinations may be refused (the rule's note says which).
    MAPPED = "mapped"
    #: Honoured outside TensorRT-LLM (the router, or the backend's own bookkeeping).
    ELSEWHERE = "elsewhere"
    #: INVALID_ARGUMENT naming the field whenever it asks for what TensorRT-LLM
    #: cannot do; the note is the message after the field name.
    REFUSED = "refused"
    #: Accepted and without effect here; the note says why that breaks no promise.
    IGNORED = "ignored"


@dataclass(frozen=True)
class FieldRule:
    """How one request field reaches TensorRT-LLM.

    Attributes:
      handling: see :class:`Handling`.
      note: what it becomes, who honours it, why it is refused (the refusal's
        message) or why ignoring it is safe.
    """

    handling: Handling
    note: str


_MAPPED, _ELSEWHERE, _REFUSED = Handling.MAPPED, Handling.ELSEWHERE, Handling.REFUSED

#: Every ``SamplingOptions`` field, by name.
SAMPLING_FIELDS: dict[str, FieldRule] = {
    "temperature": FieldRule(_MAPPED, "``temperature``; 0 (greedy) → ``top_k=1`` with "
                             "temperature, top_p and seed unset: TensorRT-LLM's greedy rule"),
    "top_p": FieldRule(_MAPPED, "``top_p`` when < 1, else unset (the runtime's off); unused "
                       "when greedy"),
    "top_k": FieldRule(_MAPPED, "``top_k`` when > 0, else unset; ``1`` when greedy"),
    "seed": FieldRule(_MAPPED, "``seed``; unset → a random 63-bit seed (TensorRT-LLM's "
                      "default seed 0 would repeat the same tokens); unused when greedy"),
    "max_tokens": FieldRule(_MAPPED, "``max_tokens``"),
    "stop": FieldRule(_ELSEWHERE, "matched on text by the router; the engine sees ids only "
                      "(``detokenize=False``)"),
    "stop_token_ids": FieldRule(_MAPPED, "``stop_token_ids`` (then the model's other EOS ids "
                                "unless ignore_eos; the first EOS id is ``end_id``), kept in "
                                "the output (``include_stop_str_in_output=True``) as our "
                                "contract says"),
    "ignore_eos": FieldRule(_MAPPED, "``ignore_eos``"),
    "logprobs": FieldRule(_MAPPED, "``logprobs=max(k, 1)``; k = 0 keeps only the chosen "
                          "token's"),
    "prompt_logprobs": FieldRule(_REFUSED, "the tensorrt_llm backend streams the generated "
                                 "tokens' log-probabilities only; leave prompt_logprobs unset "
                                 "or use the torch backend"),
    "n": FieldRule(_MAPPED, "``n``; refused with temperature 0 or with a seed (below)"),
    "presence_penalty": FieldRule(_MAPPED, "``presence_penalty``, unset at 0"),
    "frequency_penalty": FieldRule(_MAPPED, "``frequency_penalty``, unset at 0"),
    "repetition_penalty": FieldRule(_MAPPED, "``repetition_penalty``, unset at 1"),
    "min_tokens": FieldRule(_MAPPED, "``min_tokens``, unset at 0; refused beside stop token "
                            "ids or a second EOS id (below)"),
    "logit_bias": FieldRule(_MAPPED, "``embedding_bias``: a float32 ``[vocab_size]`` tensor "
                            "(\"embedding bias, aka logit bias\")"),
    "include_stop_str_in_output": FieldRule(_ELSEWHERE, "a router (text) option; TensorRT-LLM "
                                            "always keeps the stop token ids here"),
    "structured_output": FieldRule(_MAPPED, "``GuidedDecodingParams``: json_schema → ``json``, "
                                   "json_object → ``json_object``, regex → ``regex``, grammar "
                                   "→ ``grammar`` (EBNF only; Lark refused), choice → "
                                   "``regex`` (an escaped alternation); xgrammar, set by "
                                   "``llm_args``"),
}

#: Optional features (:data:`~services.engine.validation.OPTIONAL_FEATURES`)
#: this backend maps; the others are refused with INVALID_ARGUMENT.
IMPLEMENTED_FEATURES: frozenset[str] = frozenset(
    name for name in OPTIONAL_FEATURES if SAMPLING_FIELDS[name].handling is _MAPPED)
#: Why each unimplemented feature is refused (the message after the field name).
REFUSAL_REASONS: dict[str, str] = {
    name: SAMPLING_FIELDS[name].note for name in OPTIONAL_FEATURES
    if SAMPLING_FIELDS[name].handling is _REFUSED}

_REGEX_SPECIAL = frozenset("\\.^$|?*+()[]{}")


@dataclass(frozen=True)
class SamplingSpec:
    """What the backend turns into ``SamplingParams``.

    Attributes:
      params: ``SamplingParams`` keyword arguments (``embedding_bias`` a torch tensor).
      guided_decoding: ``GuidedDecodingParams`` keyword arguments, or None.
      keep_logprobs: alternatives per position to keep from TensorRT-LLM's
        answer (``sampling.logprobs``), None for no log-probabilities.
    """

    params: dict[str, Any]
    guided_decoding: dict[str, Any] | None = None
    keep_logprobs: int | None = None


def sampling_spec(options: SamplingOptions, eos_token_ids: tuple[int, ...],
                  vocab_size: int, rng: random.Random | None = None) -> SamplingSpec:
    """The TensorRT-LLM form of ``options`` (see :data:`SAMPLING_FIELDS`).

    Args:
      options: validated options (ids already checked against the vocabulary).
      eos_token_ids: the model's EOS ids, at least one.
      vocab_size: the model's vocabulary (the length of ``embedding_bias``).
      rng: draws the seed of an unseeded sampled request (default: ``random``).

    Raises:
      InvalidRequestError: INVALID_ARGUMENT naming a field TensorRT-LLM cannot
        honour as llmesh defines it (see the module docstring).
    """
    _refuse_unsupported(options, eos_token_ids)
    params: dict[str, Any] = dict(
        max_tokens=options.max_tokens, end_id=eos_token_ids[0], pad_id=eos_token_ids[0],
        stop_token_ids=_stop_ids(options, eos_token_ids), ignore_eos=options.ignore_eos,
        include_stop_str_in_output=True, detokenize=False, n=options.n,
        **_decoding(options, rng or random),
        **_penalties(options),
        logprobs=None if options.logprobs is None else max(options.logprobs, 1),
        embedding_bias=_embedding_bias(options.logit_bias, vocab_size),
    )
    return SamplingSpec(params, _guided_decoding(options.structured_output), options.logprobs)


def _refuse_unsupported(options: SamplingOptions, eos_token_ids: tuple[int, ...]) -> None:
    def refuse(field: str, message: str) -> InvalidRequestError:
        return InvalidRequestError(f"sampling.{field}", message, grpc.StatusCode.INVALID_ARGUMENT)

    if options.n > 1 and options.greedy:
        raise refuse("n", "TensorRT-LLM's LLM API refuses n > 1 with greedy decoding "
                     "(temperature 0: every choice would be the same); set temperature > 0 "
                     "or n = 1")
    if options.n > 1 and options.seed is not None:
        raise refuse("n", "with a seed, llmesh seeds choice i with seed + i, but TensorRT-LLM "
                     "seeds a request once; send n requests with seeds seed..seed+n-1, or "
                     "leave seed unset")
    extra_stops = options.stop_token_ids or (eos_token_ids[1:] and not options.ignore_eos)
    if options.min_tokens and extra_stops:
        raise refuse("min_tokens", "TensorRT-LLM holds back only end_id before min_tokens, "
                     "not stop token ids (or a model's second EOS id); drop stop_token_ids "
                     "or min_tokens")
    constraint = options.structured_output
    if (constraint is not None and constraint.kind is ConstraintKind.GRAMMAR
            and "::=" not in constraint.spec):
        raise refuse("structured_output.grammar", "TensorRT-LLM takes EBNF grammars (rules "
                     "written 'name ::= ...', xgrammar's dialect); Lark grammars are not accepted")


def _stop_ids(options: SamplingOptions, eos_token_ids: tuple[int, ...]) -> list[int] | None:
    """The request's stop ids, then the model's other EOS ids unless ignore_eos."""
    ids = list(options.stop_token_ids)
    if not options.ignore_eos:
        ids += [t for t in eos_token_ids[1:] if t not in ids]
    return ids or None


def _decoding(options: SamplingOptions, rng: random.Random) -> dict[str, Any]:
    if options.greedy:
        return dict(top_k=1, top_p=None, temperature=None, seed=None)
    return dict(
        temperature=options.temperature,
        top_k=options.top_k or None,
        top_p=options.top_p if options.top_p < 1.0 else None,
        seed=options.seed if options.seed is not None else rng.getrandbits(63))


def _penalties(options: SamplingOptions) -> dict[str, Any]:
    return dict(
        presence_penalty=options.presence_penalty or None,
        frequency_penalty=options.frequency_penalty or None,
        repetition_penalty=(options.repetition_penalty
                            if options.repetition_penalty != 1.0 else None),
        min_tokens=options.min_tokens or None)


def _embedding_bias(logit_bias: tuple[tuple[int, float], ...],
                    vocab_size: int) -> torch.Tensor | None:
    """A float32 ``[vocab_size]`` tensor, zero but at the biased ids; None for none."""
    if not logit_bias:
        return None
    import torch  # loaded already by TensorRT-LLM when requests run

    bias = torch.zeros(vocab_size, dtype=torch.float32)
    ids, values = zip(*logit_bias)
    bias[list(ids)] = torch.tensor(values, dtype=torch.float32)
    return bias


def _guided_decoding(constraint: StructuredOutput | None) -> dict[str, Any] | None:
    if constraint is None:
        return None
    kind = constraint.kind
    if kind is ConstraintKind.JSON_SCHEMA:
        return {"json": constraint.spec}
    if kind is ConstraintKind.JSON_OBJECT:
        return {"json_object": True}
    if kind is ConstraintKind.REGEX:
        return {"regex": constraint.spec}
    if kind is ConstraintKind.GRAMMAR:
        return {"grammar": constraint.spec}
    return {"regex": choice_regex(constraint.choices)}


def choice_regex(choices: tuple[str, ...]) -> str:
    """A regex matching exactly one of ``choices``: ``(a|b)``, each literal escaped."""
    escaped = ("".join("\\" + c if c in _REGEX_SPECIAL else c for c in choice)
               for choice in choices)
    return "(" + "|".join(escaped) + ")"
