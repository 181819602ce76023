"""Engine flags → TensorRT-LLM's ``speculative_config``, and the per-request check.

TensorRT-LLM picks its speculative decoding when the ``LLM`` is built, from one
of the decoding configs of ``tensorrt_llm.llmapi`` (example
https://nvidia.github.io/TensorRT-LLM/1.0.0/examples/llm_speculative_decoding.html,
fields in ``tensorrt_llm/llmapi/llm_args.py``, reference
https://nvidia.github.io/TensorRT-LLM/llm-api/reference.html):

| ``--speculative-method`` | config | kwargs from the flags |
| --- | --- | --- |
| ``none`` | no ``speculative_config`` | |
| ``ngram`` | ``NGramDecodingConfig`` | ``max_draft_len`` = ``--num-speculative-tokens``, ``max_matching_ngram_size`` = ``--ngram-max``, ``is_public_pool=False`` (each request looks up its own tokens, as our prompt lookup does) |
| ``draft`` | ``DraftTargetDecodingConfig`` | ``max_draft_len``, ``speculative_model_dir`` = ``--draft-model-path`` (required) |
| ``eagle3`` | ``EagleDecodingConfig`` | ``max_draft_len``, ``speculative_model_dir`` = ``--draft-model-path`` (the EAGLE3 head, required), ``eagle3_one_model=True`` |
| ``mtp`` | ``MTPDecodingConfig`` | ``num_nextn_predict_layers`` = ``--num-speculative-tokens`` (one draft token per MTP module) |

``speculative_model_dir`` is the 1.0 name; later releases call the field
``speculative_model`` and still accept the old name as an alias.

Pure: no ``tensorrt_llm`` import; the backend looks the class up by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc

from services.common.sampling import InvalidRequestError, SpeculativeOptions
from services.engine.config import EngineConfig

_CLASSES = {"ngram": "NGramDecodingConfig", "draft": "DraftTargetDecodingConfig",
            "eagle3": "EagleDecodingConfig", "mtp": "MTPDecodingConfig"}


@dataclass(frozen=True)
class SpeculativeSpec:
    """One decoding config of ``tensorrt_llm.llmapi``.

    Attributes:
      class_name: its class in ``tensorrt_llm.llmapi`` (e.g. ``NGramDecodingConfig``).
      kwargs: its keyword arguments (plain values).
    """

    class_name: str
    kwargs: dict[str, Any]


def speculative_spec(config: EngineConfig) -> SpeculativeSpec | None:
    """The ``speculative_config`` of ``config``; None with method ``none``.

    Raises:
      ValueError: an unknown method; ``draft`` or ``eagle3`` without
        ``--draft-model-path``, or with a GGUF file (TensorRT-LLM reads Hugging
        Face checkpoint directories).
    """
    method = config.resolved_speculative_method()
    if method == "none":
        return None
    if method not in _CLASSES:
        raise ValueError(f"--speculative-method {method!r} is unknown to the tensorrt_llm "
                         f"backend; choose none or one of {sorted(_CLASSES)}")
    k = config.num_speculative_tokens
    if method == "ngram":
        kwargs: dict[str, Any] = dict(max_draft_len=k, max_matching_ngram_size=config.ngram_max,
                                      is_public_pool=False)
    elif method == "mtp":
        kwargs = dict(num_nextn_predict_layers=k)
    else:
        kwargs = dict(max_draft_len=k, speculative_model_dir=_draft_dir(config))
        if method == "eagle3":
            kwargs["eagle3_one_model"] = True
    return SpeculativeSpec(_CLASSES[method], kwargs)


def _draft_dir(config: EngineConfig) -> str:
    path = config.draft_model_path
    method = config.resolved_speculative_method()
    what = "an EAGLE3 draft head" if method == "eagle3" else "a draft model"
    if path is None:
        raise ValueError(f"--speculative-method {method} needs "
                         f"--draft-model-path: {what} (a Hugging Face checkpoint directory "
                         "or hub id)")
    if path.suffix == ".gguf":
        raise ValueError(f"--draft-model-path {path} is a GGUF file; the tensorrt_llm backend "
                         f"reads Hugging Face checkpoints: pass {what}'s directory")
    return str(path)


def check_request_speculation(options: SpeculativeOptions, config: EngineConfig) -> None:
    """Refuses a request that asks for other speculation than the engine's:
    TensorRT-LLM fixes it when the engine starts.

    Raises:
      InvalidRequestError: INVALID_ARGUMENT naming ``speculative.method`` or
        ``speculative.num_speculative_tokens``.
    """
    method = config.resolved_speculative_method()
    if options.method is not None and options.method.value != method:
        raise InvalidRequestError(
            "speculative.method",
            f"the tensorrt_llm backend runs the engine's speculative method "
            f"({method}) for every request; leave it unset",
            grpc.StatusCode.INVALID_ARGUMENT)
    if (options.num_speculative_tokens is not None
            and options.num_speculative_tokens != config.num_speculative_tokens):
        raise InvalidRequestError(
            "speculative.num_speculative_tokens",
            f"the tensorrt_llm backend speculates the engine's "
            f"{config.num_speculative_tokens} tokens for every request; leave it unset",
            grpc.StatusCode.INVALID_ARGUMENT)
