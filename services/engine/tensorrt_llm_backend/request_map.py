"""``SequenceRequest`` → the arguments of ``llm.generate_async``, and every
per-request check the tensorrt_llm backend makes before it calls it.

Pure: no ``tensorrt_llm`` import. :data:`REQUEST_FIELDS` classifies every
``SequenceRequest`` field as :data:`.sampling_map.SAMPLING_FIELDS` does the
sampling fields. ``generate_async`` takes (documented LLM API, 1.x) the prompt,
``sampling_params``, ``lora_request``, ``prompt_adapter_request``,
``streaming``, ``kv_cache_retention_config``, ``disaggregated_params`` and, in
later releases, ``scheduling_params`` (attention-DP placement) and
``cache_salt`` ("If specified, KV cache will be salted with the provided
string to limit the kv cache reuse to the requests with the same string"):
no request priority, which is why ``priority`` is IGNORED below. The
request's cache scope goes in as ``cache_salt`` (only when it is not the
shared scope, so releases without the argument still serve unscoped
requests). Unverified: this backend has never run.

Status codes: what :func:`generate_args` raises, all InvalidRequestError:
:func:`services.engine.validation.validate_request`'s (INVALID_ARGUMENT /
OUT_OF_RANGE), and INVALID_ARGUMENT naming a REFUSED field
(:mod:`.sampling_map`, :func:`.speculative_map.check_request_speculation`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from services.engine.config import EngineConfig
from services.engine.tensorrt_llm_backend.sampling_map import (
    IMPLEMENTED_FEATURES,
    REFUSAL_REASONS,
    FieldRule,
    Handling,
    SamplingSpec,
    sampling_spec,
)
from services.engine.tensorrt_llm_backend.speculative_map import check_request_speculation
from services.engine.types import ModelInfo, SequenceRequest
from services.engine.validation import refuse_unimplemented, validate_request

#: Every ``SequenceRequest`` field, by name.
REQUEST_FIELDS: dict[str, FieldRule] = {
    "request_id": FieldRule(Handling.ELSEWHERE, "the backend's key for the running "
                            "result: ``cancel(request_id)`` calls its ``abort()``; "
                            "TensorRT-LLM numbers requests itself"),
    "prompt_token_ids": FieldRule(Handling.MAPPED, "``generate_async``'s first argument, "
                                  "a list of ids (``skip_tokenizer_init``: no text)"),
    "sampling": FieldRule(Handling.MAPPED, "``sampling_params``, field by field in "
                          ":data:`.sampling_map.SAMPLING_FIELDS`"),
    "priority": FieldRule(Handling.IGNORED, "advisory scheduling: the router's admission "
                          "already orders the classes (interactive before batch) before a "
                          "request reaches an engine; ``generate_async`` takes no per-request "
                          "priority, so here a batch request is scheduled like an interactive "
                          "one (no preemption by class either)"),
    "speculative": FieldRule(Handling.REFUSED, "anything but the engine's own method and "
                             "count: TensorRT-LLM fixes speculation when the LLM is built"),
    "tenant": FieldRule(Handling.IGNORED, "it scopes what an engine learns across requests; "
                        "this backend learns nothing across requests (NGram runs with "
                        "``is_public_pool=False``, no suffix decoding); its prefix cache "
                        "is scoped by ``cache_scope``"),
    "cache_scope": FieldRule(Handling.MAPPED, "``generate_async``'s ``cache_salt`` (the "
                             "prefix cache reuses KV only between requests of one scope); "
                             "not passed for the shared scope"),
}


@dataclass(frozen=True)
class GenerateArgs:
    """What ``llm.generate_async`` is called with for one request.

    Attributes:
      prompt_token_ids: the prompt (``inputs``), as the list the LLM API takes.
      sampling: the ``SamplingParams`` (and ``GuidedDecodingParams``) kwargs.
      cache_salt: ``generate_async``'s ``cache_salt``: the request's cache
        scope, None for the shared scope (the argument is then left out).
    """

    prompt_token_ids: list[int]
    sampling: SamplingSpec
    cache_salt: str | None = None


def generate_args(request: SequenceRequest, info: ModelInfo, config: EngineConfig,
                  rng: random.Random | None = None) -> GenerateArgs:
    """Checks ``request`` against the served model and TensorRT-LLM, and maps it.

    Args:
      request: the request as the engine service converted it.
      info: the served model (limits, vocabulary, EOS ids).
      config: the engine's options (its speculative method and count).
      rng: draws the seed of an unseeded sampled request (default: ``random``).

    Raises:
      InvalidRequestError: see the module's status codes.
    """
    validate_request(request, info)
    refuse_unimplemented(request.sampling, IMPLEMENTED_FEATURES, "tensorrt_llm",
                         reasons=REFUSAL_REASONS)
    check_request_speculation(request.speculative, config)
    return GenerateArgs(list(request.prompt_token_ids),
                        sampling_spec(request.sampling, info.eos_token_ids, info.vocab_size,
                                      rng),
                        request.cache_scope or None)
