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
