"""SamplingOptions.from_pb: validation and normalisation shared by router, cache and engine."""

from __future__ import annotations

import grpc
import pytest

from llmesh.v1 import common_pb2
from services.common.sampling import InvalidRequestError, SamplingOptions


def convert(**fields: object) -> SamplingOptions:
    return SamplingOptions.from_pb(common_pb2.SamplingParams(**fields),
                                   default_max_tokens=16, max_tokens_cap=100, vocab_size=1000)


def test_unset_fields_take_the_greedy_defaults() -> None:
    options = convert()
    assert (options.temperature, options.top_p, options.top_k, options.seed,
            options.max_tokens) == (0.0, 1.0, 0, None, 16)
    assert options.greedy and options.deterministic


@pytest.mark.parametrize("tiny", [1e-40, 1e-30, 9e-6])
def test_a_temperature_too_small_to_divide_by_is_greedy(tiny: float) -> None:
    assert convert(temperature=tiny).temperature == 0.0


def test_a_usable_temperature_is_kept() -> None:
    options = convert(temperature=0.8, seed=7)
    assert options.temperature == pytest.approx(0.8) and not options.greedy
    assert options.deterministic


@pytest.mark.parametrize(
    ("fields", "field", "code"),
    [
        ({"temperature": -0.1}, "sampling.temperature", grpc.StatusCode.INVALID_ARGUMENT),
        ({"temperature": float("nan")}, "sampling.temperature", grpc.StatusCode.INVALID_ARGUMENT),
        ({"temperature": float("inf")}, "sampling.temperature", grpc.StatusCode.INVALID_ARGUMENT),
        ({"top_p": 0.0}, "sampling.top_p", grpc.StatusCode.INVALID_ARGUMENT),
        ({"top_p": 1.01}, "sampling.top_p", grpc.StatusCode.INVALID_ARGUMENT),
        ({"top_k": -1}, "sampling.top_k", grpc.StatusCode.INVALID_ARGUMENT),
        ({"max_tokens": 0}, "sampling.max_tokens", grpc.StatusCode.INVALID_ARGUMENT),
        ({"max_tokens": 101}, "sampling.max_tokens", grpc.StatusCode.OUT_OF_RANGE),
        ({"stop": ["ok", ""]}, "sampling.stop", grpc.StatusCode.INVALID_ARGUMENT),
        ({"stop_token_ids": [1000]}, "sampling.stop_token_ids", grpc.StatusCode.INVALID_ARGUMENT),
        ({"stop_token_ids": [-1]}, "sampling.stop_token_ids", grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
def test_each_bad_field_is_named_with_its_status(fields: dict[str, object], field: str,
                                                 code: grpc.StatusCode) -> None:
    with pytest.raises(InvalidRequestError) as info:
        convert(**fields)
    assert info.value.field == field and info.value.code == code
    assert str(info.value).startswith(field + ":")


def test_stop_token_id_messages_say_what_is_wrong_with_or_without_a_vocabulary() -> None:
    """A negative id is refused as negative whether or not the caller knows the
    vocabulary (the engine service does not: its backend checks the range)."""
    for vocab_size in (None, 1000):
        with pytest.raises(InvalidRequestError) as info:
            SamplingOptions.from_pb(common_pb2.SamplingParams(stop_token_ids=[5, -3]),
                                    default_max_tokens=1, max_tokens_cap=100,
                                    vocab_size=vocab_size)
        assert str(info.value) == ("sampling.stop_token_ids: token id -3 is negative "
                                   "(ids are >= 0)")
    with pytest.raises(InvalidRequestError, match=r"outside the vocabulary \[0, 1000\)"):
        convert(stop_token_ids=[1000])


def test_round_trip_through_protobuf_is_exact() -> None:
    options = convert(temperature=0.5, top_p=0.9, top_k=40, seed=3, max_tokens=50,
                      stop=["\n\n"], stop_token_ids=[2], ignore_eos=True)
    assert SamplingOptions.from_pb(options.to_pb(), default_max_tokens=1,
                                   max_tokens_cap=100) == options


SO = common_pb2.StructuredOutput


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"logprobs": 21}, "sampling.logprobs", "[0, 20]"),
        ({"logprobs": -1}, "sampling.logprobs", "[0, 20]"),
        ({"prompt_logprobs": 21}, "sampling.prompt_logprobs", "[0, 20]"),
        ({"n": 0}, "sampling.n", "[1, 16]"),
        ({"n": 17}, "sampling.n", "[1, 16]"),
        ({"presence_penalty": 2.5}, "sampling.presence_penalty", "[-2, 2]"),
        ({"frequency_penalty": float("nan")}, "sampling.frequency_penalty", "[-2, 2]"),
        ({"repetition_penalty": 0.0}, "sampling.repetition_penalty", "(0, 10]"),
        ({"repetition_penalty": 11.0}, "sampling.repetition_penalty", "(0, 10]"),
        ({"min_tokens": 17}, "sampling.min_tokens", "max_tokens = 16"),
        # issue 30, bug 4: a choice cannot be lengthened; min_tokens was ignored
        ({"min_tokens": 2, "structured_output": SO(choice=common_pb2.ChoiceConstraint(
            choices=["yes", "no"]))}, "sampling.min_tokens",
         "cannot be honoured beside a choice constraint (sampling.structured_output.choice)"),
        ({"logit_bias": {1000: 1.0}}, "sampling.logit_bias", "outside the vocabulary"),
        ({"logit_bias": {-1: 1.0}}, "sampling.logit_bias", "outside the vocabulary"),
        ({"logit_bias": {3: 101.0}}, "sampling.logit_bias", "[-100, 100]"),
        ({"logit_bias": {i: 1.0 for i in range(301)}}, "sampling.logit_bias", "at most 300"),
        ({"structured_output": SO(json_schema="")},
         "sampling.structured_output.json_schema", "must not be empty"),
        ({"structured_output": SO(json_schema="{")},
         "sampling.structured_output.json_schema", "not valid JSON"),
        ({"structured_output": SO(json_schema="[1]")},
         "sampling.structured_output.json_schema", "object or a boolean"),
        ({"structured_output": SO(regex=" ")}, "sampling.structured_output.regex",
         "must not be empty"),
        ({"structured_output": SO(json_object=False)},
         "sampling.structured_output.json_object", "set it to true"),
        ({"structured_output": SO(choice=common_pb2.ChoiceConstraint())},
         "sampling.structured_output.choice.choices", "at least one"),
        ({"structured_output": SO(choice=common_pb2.ChoiceConstraint(choices=["a", ""]))},
         "sampling.structured_output.choice.choices", "non-empty"),
    ],
)
def test_each_bad_new_field_is_named(fields: dict[str, object], field: str,
                                     message: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        convert(**fields)
    assert info.value.field == field and message in str(info.value)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_the_new_fields_round_trip_and_make_a_request_not_plain() -> None:
    fields = [{"logprobs": 0}, {"prompt_logprobs": 3}, {"n": 4}, {"presence_penalty": 0.5},
              {"frequency_penalty": -0.5}, {"repetition_penalty": 1.2}, {"min_tokens": 2},
              {"logit_bias": {7: -100.0, 3: 2.5}}, {"include_stop_str_in_output": True},
              {"structured_output": SO(regex="[ab]+")},
              {"structured_output": SO(json_object=True)},
              {"structured_output": SO(choice=common_pb2.ChoiceConstraint(choices=["x"]))},
              {"structured_output": SO(grammar='start: "a"')},
              {"structured_output": SO(json_schema='{"type": "object"}')}]
    for one in fields:
        options = convert(**one)
        assert not options.plain, one
        again = SamplingOptions.from_pb(options.to_pb(), default_max_tokens=1,
                                        max_tokens_cap=100, vocab_size=1000)
        assert again == options, one
    assert convert().plain and convert(temperature=1.0, stop=["x"]).plain
    assert convert(logit_bias={7: -100.0, 3: 2.5}).logit_bias == ((3, 2.5), (7, -100.0))


def test_each_choice_has_its_own_seed() -> None:
    assert [convert(n=3, seed=2**64 - 2).choice_seed(i) for i in range(3)] == [2**64 - 2,
                                                                                2**64 - 1, 0]
    assert convert(n=3).choice_seed(1) is None
