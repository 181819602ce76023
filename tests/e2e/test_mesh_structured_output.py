"""Structured output through Envoy and the router's gRPC API, real SmolLM2 engine."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import pytest

from llmesh.v1 import common_pb2
from tests.e2e.mesh_client import chat_request, generate

pytestmark = pytest.mark.mesh

#: Nested objects, enums and arrays, kept short (at most ~30 tokens) so that 20
#: samples stay cheap on a 2-CPU machine.
ORDER = {
    "type": "object",
    "properties": {
        "who": {
            "type": "object",
            "properties": {
                "tier": {"enum": ["gold", "silver", "bronze"]},
                "age": {"type": "integer", "minimum": 1, "maximum": 99},
            },
            "required": ["tier", "age"],
            "additionalProperties": False,
        },
        "skus": {"type": "array", "items": {"enum": ["A1", "B2", "C3"]},
                 "minItems": 1, "maxItems": 3},
    },
    "required": ["who", "skus"],
    "additionalProperties": False,
}


def constrained(content: str, constraint: common_pb2.StructuredOutput, **sampling):
    return chat_request(content, structured_output=constraint, **sampling)


def test_twenty_seeded_samples_at_temperature_1_all_validate_against_a_nested_schema(
        ingress_channel: grpc.Channel) -> None:
    schema = common_pb2.StructuredOutput(json_schema=json.dumps(ORDER))
    requests = [constrained("Write an order as JSON.", schema, temperature=1.0, seed=seed,
                            max_tokens=40) for seed in range(20)]
    with ThreadPoolExecutor(20) as pool:
        results = list(pool.map(lambda r: generate(ingress_channel, r, timeout=300), requests))
    outputs = [r.text for r in results]
    for result in results:
        assert result.last is not None
        assert result.last.finish_reason == common_pb2.FINISH_REASON_STOP, result.text
        jsonschema.validate(json.loads(result.text), ORDER)
    assert len(set(outputs)) >= 5, outputs  # sampled, not one answer 20 times


def test_regex_and_choice_constraints_shape_the_answer(ingress_channel: grpc.Channel) -> None:
    phone = generate(ingress_channel, constrained(
        "Invent a phone number.", common_pb2.StructuredOutput(regex=r"\+1 [0-9]{3}-[0-9]{4}"),
        max_tokens=24))
    assert re.fullmatch(r"\+1 [0-9]{3}-[0-9]{4}", phone.text), phone.text
    choices = ["Berlin", "Madrid", "Paris", "Rome"]
    city = generate(ingress_channel, constrained(
        "What is the capital of France?",
        common_pb2.StructuredOutput(choice=common_pb2.ChoiceConstraint(choices=choices)),
        max_tokens=8))
    assert city.text in choices  # free text here is a sentence ("The capital of …")
    assert city.last is not None and city.last.finish_reason == common_pb2.FINISH_REASON_STOP


def test_an_invalid_schema_is_invalid_argument_naming_the_problem(
        ingress_channel: grpc.Channel) -> None:
    bad = common_pb2.StructuredOutput(
        json_schema='{"type": "object", "properties": {"a": {"type": "strng"}}}')
    with pytest.raises(grpc.RpcError) as info:
        generate(ingress_channel, constrained("Hi", bad, max_tokens=8))
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.structured_output.json_schema" in info.value.details()
    assert "strng" in info.value.details()
