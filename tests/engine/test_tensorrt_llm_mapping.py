"""The TensorRT-LLM backend's pure mappings, without TensorRT-LLM: sampling
options → ``SamplingParams`` kwargs (and every refusal), every request field
classified (mapped, elsewhere, refused, ignored) with each claim checked on
``generate_args``, engine flags → ``speculative_config`` and ``LLM(...)`` kwargs."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import torch

from services.common.sampling import (
    ConstraintKind,
    InvalidRequestError,
    Priority,
    SamplingOptions,
    SpeculativeMethod,
    SpeculativeOptions,
    StructuredOutput,
)
from services.engine.config import EngineConfig
from services.engine.factory import create_backend
from services.engine.tensorrt_llm_backend.llm_args import KV_EVENT_BUFFER, llm_spec
from services.engine.tensorrt_llm_backend.request_map import REQUEST_FIELDS, generate_args
from services.engine.tensorrt_llm_backend.sampling_map import (
    IMPLEMENTED_FEATURES,
    REFUSAL_REASONS,
    SAMPLING_FIELDS,
    FieldRule,
    Handling,
    choice_regex,
    sampling_spec,
)
from services.engine.tensorrt_llm_backend.speculative_map import (
    SpeculativeSpec,
    check_request_speculation,
    speculative_spec,
)
from services.engine.types import ModelInfo, SequenceRequest
from services.engine.validation import OPTIONAL_FEATURES, refuse_unimplemented

EOS = (2,)
VOCAB = 100


def params(**options: object) -> dict:
    return sampling_spec(SamplingOptions(**options), EOS, VOCAB,  # type: ignore[arg-type]
                         random.Random(0)).params


def test_greedy_is_top_k_1_without_temperature_or_seed() -> None:
    p = params(max_tokens=7)
    assert (p["top_k"], p["top_p"], p["temperature"], p["seed"]) == (1, None, None, None)
    assert (p["max_tokens"], p["end_id"], p["pad_id"], p["n"]) == (7, 2, 2, 1)
    assert (p["detokenize"], p["include_stop_str_in_output"], p["ignore_eos"]) == (
        False, True, False)


def test_sampling_fields_map_one_to_one() -> None:
    p = params(temperature=0.7, top_p=0.9, top_k=40, seed=11)
    assert (p["temperature"], p["top_p"], p["top_k"], p["seed"]) == (0.7, 0.9, 40, 11)
    off = params(temperature=1.0, top_p=1.0, top_k=0, seed=3)
    assert (off["top_p"], off["top_k"]) == (None, None)


def test_an_unseeded_sampled_request_gets_a_fresh_seed() -> None:
    # TensorRT-LLM's default seed is 0: without a drawn one every request would repeat.
    first = sampling_spec(SamplingOptions(temperature=1.0), EOS, VOCAB, random.Random(1))
    second = sampling_spec(SamplingOptions(temperature=1.0), EOS, VOCAB, random.Random(2))
    assert first.params["seed"] != second.params["seed"]
    assert 0 <= first.params["seed"] < 2**63


def test_stop_ids_then_the_models_other_eos_ids_unless_ignore_eos() -> None:
    spec = sampling_spec(SamplingOptions(stop_token_ids=(9, 5)), (2, 7, 9), VOCAB)
    assert (spec.params["end_id"], spec.params["stop_token_ids"]) == (2, [9, 5, 7])
    spec = sampling_spec(SamplingOptions(stop_token_ids=(9,), ignore_eos=True), (2, 7), VOCAB)
    assert (spec.params["stop_token_ids"], spec.params["ignore_eos"]) == ([9], True)
    assert params()["stop_token_ids"] is None


def test_penalties_and_min_tokens_map_and_stay_unset_when_neutral() -> None:
    p = params(presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.2,
               min_tokens=4)
    assert (p["presence_penalty"], p["frequency_penalty"], p["repetition_penalty"],
            p["min_tokens"]) == (0.5, -0.25, 1.2, 4)
    p = params()
    assert (p["presence_penalty"], p["frequency_penalty"], p["repetition_penalty"],
            p["min_tokens"]) == (None, None, None, None)


def test_logit_bias_becomes_a_dense_embedding_bias() -> None:
    bias = params(logit_bias=((3, 1.5), (97, -100.0)))["embedding_bias"]
    assert bias.dtype == torch.float32 and bias.shape == (VOCAB,)
    assert (bias[3].item(), bias[97].item(), bias.abs().sum().item()) == (1.5, -100.0, 101.5)
    assert params()["embedding_bias"] is None


def test_logprobs_zero_asks_for_one_and_keeps_only_the_chosen() -> None:
    spec = sampling_spec(SamplingOptions(logprobs=0), EOS, VOCAB)
    assert (spec.params["logprobs"], spec.keep_logprobs) == (1, 0)
    spec = sampling_spec(SamplingOptions(logprobs=5), EOS, VOCAB)
    assert (spec.params["logprobs"], spec.keep_logprobs) == (5, 5)
    spec = sampling_spec(SamplingOptions(), EOS, VOCAB)
    assert (spec.params["logprobs"], spec.keep_logprobs) == (None, None)


def test_n_maps_when_sampled_and_unseeded() -> None:
    assert params(n=3, temperature=0.8)["n"] == 3


@pytest.mark.parametrize(("kind", "spec", "choices", "expected"), [
    (ConstraintKind.JSON_SCHEMA, '{"type": "object"}', (), {"json": '{"type": "object"}'}),
    (ConstraintKind.JSON_OBJECT, "", (), {"json_object": True}),
    (ConstraintKind.REGEX, "[0-9]+", (), {"regex": "[0-9]+"}),
    (ConstraintKind.GRAMMAR, 'root ::= "yes" | "no"', (), {"grammar": 'root ::= "yes" | "no"'}),
    (ConstraintKind.CHOICE, "", ("a.b", "(c)|d"), {"regex": r"(a\.b|\(c\)\|d)"}),
])
def test_structured_output_becomes_guided_decoding(kind: ConstraintKind, spec: str,
                                                   choices: tuple[str, ...],
                                                   expected: dict) -> None:
    constraint = StructuredOutput(kind, spec, choices)
    result = sampling_spec(SamplingOptions(structured_output=constraint), EOS, VOCAB)
    assert result.guided_decoding == expected
    assert sampling_spec(SamplingOptions(), EOS, VOCAB).guided_decoding is None


def test_choice_regex_escapes_every_metacharacter() -> None:
    import re

    choices = ("1+1=2?", "[x]{2}", "a^b$c", "back\\slash", "plain words")
    pattern = re.compile(choice_regex(choices))
    assert all(pattern.fullmatch(c) for c in choices)
    assert not pattern.fullmatch("11=2") and not pattern.fullmatch("xx")


@pytest.mark.parametrize(("options", "field", "message"), [
    (dict(n=2), "sampling.n", "greedy decoding"),
    (dict(n=2, temperature=1.0, seed=5), "sampling.n", "seeds choice i with seed \\+ i"),
    (dict(min_tokens=3, stop_token_ids=(9,)), "sampling.min_tokens", "only end_id"),
    (dict(structured_output=StructuredOutput(ConstraintKind.GRAMMAR, 'start: "a"')),
     "sampling.structured_output.grammar", "Lark grammars are not accepted"),
])
def test_what_tensorrt_llm_cannot_honour_is_invalid_argument(options: dict, field: str,
                                                              message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message) as caught:
        sampling_spec(SamplingOptions(**options), EOS, VOCAB)  # type: ignore[arg-type]
    assert (caught.value.field, caught.value.code) == (field, grpc.StatusCode.INVALID_ARGUMENT)


def test_min_tokens_beside_a_second_eos_is_refused_unless_eos_is_ignored() -> None:
    with pytest.raises(InvalidRequestError, match="second EOS"):
        sampling_spec(SamplingOptions(min_tokens=2), (2, 7), VOCAB)
    spec = sampling_spec(SamplingOptions(min_tokens=2, ignore_eos=True), (2, 7), VOCAB)
    assert spec.params["min_tokens"] == 2


def test_prompt_logprobs_is_the_one_unimplemented_feature_and_invalid_argument() -> None:
    assert set(OPTIONAL_FEATURES) - IMPLEMENTED_FEATURES == {"prompt_logprobs"}
    with pytest.raises(InvalidRequestError, match="streams the generated tokens") as caught:
        refuse_unimplemented(SamplingOptions(prompt_logprobs=1), IMPLEMENTED_FEATURES,
                             "tensorrt_llm", reasons=REFUSAL_REASONS)
    assert (caught.value.field, caught.value.code) == (
        "sampling.prompt_logprobs", grpc.StatusCode.INVALID_ARGUMENT)
    refuse_unimplemented(SamplingOptions(logprobs=2, n=2, temperature=1.0, min_tokens=1,
                                         logit_bias=((1, 1.0),)),
                         IMPLEMENTED_FEATURES, "tensorrt_llm", reasons=REFUSAL_REASONS)


# ---- speculative_config ------------------------------------------------------------------


def spec_of(**fields: object) -> SpeculativeSpec | None:
    config = EngineConfig(backend="tensorrt_llm", **fields)  # type: ignore[arg-type]
    return speculative_spec(config)


def test_speculative_config_per_method() -> None:
    assert spec_of(speculative_method="none") is None
    assert spec_of() is None  # auto: TensorRT-LLM speculates only when chosen
    assert EngineConfig().resolved_speculative_method() == "suffix"  # the torch backend's auto
    with pytest.raises(ValueError, match="suffix"):  # the torch backend's alone
        spec_of(speculative_method="suffix")
    assert spec_of(speculative_method="ngram", num_speculative_tokens=4, ngram_max=3) == \
        SpeculativeSpec("NGramDecodingConfig", dict(max_draft_len=4, max_matching_ngram_size=3,
                                                    is_public_pool=False))
    assert spec_of(speculative_method="draft", draft_model_path=Path("/m/draft")) == \
        SpeculativeSpec("DraftTargetDecodingConfig",
                        dict(max_draft_len=3, speculative_model_dir="/m/draft"))
    assert spec_of(speculative_method="eagle3", num_speculative_tokens=5,
                   draft_model_path=Path("/m/eagle3")) == \
        SpeculativeSpec("EagleDecodingConfig", dict(max_draft_len=5,
                                                    speculative_model_dir="/m/eagle3",
                                                    eagle3_one_model=True))
    assert spec_of(speculative_method="mtp", num_speculative_tokens=2) == \
        SpeculativeSpec("MTPDecodingConfig", dict(num_nextn_predict_layers=2))


@pytest.mark.parametrize(("fields", "message"), [
    (dict(speculative_method="eagle3"), "--speculative-method eagle3 needs --draft-model-path"),
    (dict(speculative_method="draft"), "--speculative-method draft needs --draft-model-path"),
    (dict(speculative_method="draft", draft_model_path=Path("/m/d.Q4_1.gguf")),
     "is a GGUF file"),
    (dict(speculative_method="medusa"), "unknown to the tensorrt_llm backend"),
])
def test_speculative_config_errors_name_the_flag(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        spec_of(**fields)


def test_a_request_cannot_choose_other_speculation_than_the_engines() -> None:
    config = EngineConfig(backend="tensorrt_llm", speculative_method="ngram",
                          num_speculative_tokens=3)
    check_request_speculation(SpeculativeOptions(), config)
    check_request_speculation(SpeculativeOptions(SpeculativeMethod.NGRAM, 3), config)
    for options, field in ((SpeculativeOptions(SpeculativeMethod.NONE), "speculative.method"),
                           (SpeculativeOptions(None, 2), "speculative.num_speculative_tokens")):
        with pytest.raises(InvalidRequestError) as caught:
            check_request_speculation(options, config)
        assert (caught.value.field, caught.value.code) == (
            field, grpc.StatusCode.INVALID_ARGUMENT)


def test_the_backend_refuses_bad_speculative_flags_when_built() -> None:
    with pytest.raises(ValueError, match="eagle3 needs --draft-model-path"):
        create_backend(EngineConfig(backend="tensorrt_llm", speculative_method="eagle3"))


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_the_torch_backend_refuses_eagle3_and_mtp(method: str) -> None:
    with pytest.raises(ValueError, match=f"{method} is implemented by the tensorrt_llm backend"):
        create_backend(EngineConfig(speculative_method=method))


# ---- LLM(...) ------------------------------------------------------------------------------


def test_llm_kwargs_from_the_engine_config() -> None:
    config = EngineConfig(backend="tensorrt_llm", max_num_seqs=8, dtype="bfloat16",
                          block_size=32, gpu_memory_fraction=0.7, speculative_method="none")
    spec = llm_spec(config, Path("/models/llama"), 4096)
    assert spec.kwargs == dict(
        model="/models/llama", skip_tokenizer_init=True, max_seq_len=4096, max_batch_size=8,
        max_num_tokens=8192, dtype="bfloat16", enable_chunked_prefill=True,
        guided_decoding_backend="xgrammar", enable_iter_perf_stats=True)
    assert spec.kv_cache_config == dict(enable_block_reuse=True,
                                        event_buffer_max_size=KV_EVENT_BUFFER,
                                        free_gpu_memory_fraction=0.7, tokens_per_block=32)
    assert spec.cuda_graph_config == dict(batch_sizes=[1, 2, 4, 8], enable_padding=True)
    assert spec.speculative is None


def test_llm_kwargs_follow_eager_graph_sizes_chunking_caching_and_budget() -> None:
    config = EngineConfig(backend="tensorrt_llm", enforce_eager=True,
                          enable_chunked_prefill=False, enable_prefix_caching=False,
                          max_num_batched_tokens=2048)
    spec = llm_spec(config, Path("/m"), 1024)
    assert spec.cuda_graph_config is None
    assert (spec.kwargs["enable_chunked_prefill"], spec.kwargs["max_num_tokens"]) == (False, 2048)
    assert (spec.kv_cache_config["enable_block_reuse"],
            spec.kv_cache_config["event_buffer_max_size"]) == (False, 0)
    sized = llm_spec(EngineConfig(cuda_graph_sizes=(16, 1, 4), speculative_method="ngram"),
                     Path("/m"), 1024)
    assert sized.cuda_graph_config == dict(batch_sizes=[1, 4, 16], enable_padding=True)
    assert sized.speculative == SpeculativeSpec(
        "NGramDecodingConfig", dict(max_draft_len=3, max_matching_ngram_size=4,
                                    is_public_pool=False))


# ---- every request field is classified, and each classification holds ------------------

INFO = ModelInfo(model="m", max_model_len=64, vocab_size=VOCAB, eos_token_ids=EOS,
                 backend="tensorrt_llm")
#: A sampled request: greedy would make top_p, top_k and seed moot.
BASE_SAMPLING = SamplingOptions(temperature=0.8, max_tokens=16)
BASE_REQUEST = SequenceRequest("r1", (5, 6, 7), BASE_SAMPLING)
#: Per SamplingOptions field, a value other than BASE_SAMPLING's that is valid on its own.
SAMPLING_SAMPLES: dict[str, object] = {
    "temperature": 0.3, "top_p": 0.9, "top_k": 40, "seed": 11, "max_tokens": 7,
    "stop": ("x",), "stop_token_ids": (9,), "ignore_eos": True, "logprobs": 2,
    "prompt_logprobs": 1, "n": 2, "presence_penalty": 0.5, "frequency_penalty": 0.5,
    "repetition_penalty": 1.2, "min_tokens": 2, "logit_bias": ((3, 1.5),),
    "include_stop_str_in_output": True,
    "structured_output": StructuredOutput(ConstraintKind.JSON_OBJECT),
}
#: Per SequenceRequest field, a value other than BASE_REQUEST's.
REQUEST_SAMPLES: dict[str, object] = {
    "request_id": "r2", "prompt_token_ids": (5, 6, 8),
    "sampling": replace(BASE_SAMPLING, max_tokens=9), "priority": Priority.BATCH,
    "speculative": SpeculativeOptions(SpeculativeMethod.NGRAM), "tenant": "acme",
    "cache_scope": "f" * 64,
}


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _mapped(request: SequenceRequest) -> tuple:
    """``generate_args`` of ``request`` as comparable plain values (a fixed seed draw)."""
    args = generate_args(request, INFO, EngineConfig(backend="tensorrt_llm"),
                         random.Random(0))
    params = {k: v.tolist() if isinstance(v, torch.Tensor) else v
              for k, v in args.sampling.params.items()}
    return (args.prompt_token_ids, params, args.sampling.guided_decoding,
            args.sampling.keep_logprobs, args.cache_salt)


def test_every_sampling_and_request_field_is_classified() -> None:
    # A field added to either dataclass fails here until it has a rule (and a sample below).
    assert set(SAMPLING_FIELDS) == _field_names(SamplingOptions)
    assert set(REQUEST_FIELDS) == _field_names(SequenceRequest)
    assert set(SAMPLING_SAMPLES) == _field_names(SamplingOptions)
    assert set(REQUEST_SAMPLES) == _field_names(SequenceRequest)
    assert all(rule.note for rule in [*SAMPLING_FIELDS.values(), *REQUEST_FIELDS.values()])
    assert REQUEST_FIELDS["priority"].handling is Handling.IGNORED
    assert "advisory" in REQUEST_FIELDS["priority"].note
    assert IMPLEMENTED_FEATURES == frozenset(OPTIONAL_FEATURES) - {"prompt_logprobs"}
    assert REFUSAL_REASONS == {"prompt_logprobs": SAMPLING_FIELDS["prompt_logprobs"].note}


def _check_claim(rule: FieldRule, base: SequenceRequest, changed: SequenceRequest,
                 prefix: str) -> None:
    if rule.handling is Handling.REFUSED:
        with pytest.raises(InvalidRequestError) as caught:
            generate_args(changed, INFO, EngineConfig(backend="tensorrt_llm"))
        assert caught.value.field.startswith(prefix)
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    elif rule.handling is Handling.MAPPED:
        assert _mapped(changed) != _mapped(base)
    else:  # ELSEWHERE, IGNORED: TensorRT-LLM gets exactly what it gets without the field
        assert _mapped(changed) == _mapped(base)


@pytest.mark.parametrize("name", sorted(SAMPLING_SAMPLES))
def test_each_sampling_field_does_what_its_rule_says(name: str) -> None:
    changed = replace(BASE_REQUEST, sampling=replace(BASE_SAMPLING,
                                                     **{name: SAMPLING_SAMPLES[name]}))
    _check_claim(SAMPLING_FIELDS[name], BASE_REQUEST, changed, f"sampling.{name}")


@pytest.mark.parametrize("name", sorted(REQUEST_SAMPLES))
def test_each_request_field_does_what_its_rule_says(name: str) -> None:
    changed = replace(BASE_REQUEST, **{name: REQUEST_SAMPLES[name]})
    _check_claim(REQUEST_FIELDS[name], BASE_REQUEST, changed, name)


def test_a_field_claimed_mapped_but_dropped_would_fail() -> None:
    # The check itself can fail: stop strings never reach TensorRT-LLM, so a rule
    # calling them MAPPED is caught.
    changed = replace(BASE_REQUEST, sampling=replace(BASE_SAMPLING, stop=("x",)))
    with pytest.raises(AssertionError):
        _check_claim(FieldRule(Handling.MAPPED, "wrong"), BASE_REQUEST, changed, "sampling.stop")
