"""The engine refuses, never ignores, a sampling feature its backend does not
implement (services.engine.validation.refuse_unimplemented)."""

from __future__ import annotations

import grpc
import pytest

from services.common.sampling import ConstraintKind, SamplingOptions, StructuredOutput
from services.engine.validation import (
    OPTIONAL_FEATURES,
    refuse_unimplemented,
    used_features,
)

USES = {
    "logprobs": SamplingOptions(logprobs=0),
    "prompt_logprobs": SamplingOptions(prompt_logprobs=2),
    "n": SamplingOptions(n=2),
    "presence_penalty": SamplingOptions(presence_penalty=0.1),
    "frequency_penalty": SamplingOptions(frequency_penalty=0.1),
    "repetition_penalty": SamplingOptions(repetition_penalty=1.1),
    "min_tokens": SamplingOptions(min_tokens=1),
    "logit_bias": SamplingOptions(logit_bias=((1, 1.0),)),
    "structured_output": SamplingOptions(
        structured_output=StructuredOutput(ConstraintKind.REGEX, "a+")),
}


def test_every_optional_feature_is_detected_on_its_own() -> None:
    assert set(USES) == set(OPTIONAL_FEATURES)
    for name, options in USES.items():
        assert used_features(options) == [name]
    assert used_features(SamplingOptions(temperature=1.0, seed=3, stop=("x",))) == []


@pytest.mark.parametrize("name", OPTIONAL_FEATURES)
def test_an_unimplemented_feature_is_invalid_argument_naming_the_field(name: str) -> None:
    """INVALID_ARGUMENT, as vLLM's 400: UNIMPLEMENTED became a 501 that the
    official OpenAI client retried twice (issue 30, bug 5)."""
    with pytest.raises(Exception) as info:
        refuse_unimplemented(USES[name], frozenset(), "demo")
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.field == f"sampling.{name}" and "demo engine backend" in str(info.value)
    refuse_unimplemented(USES[name], frozenset({name}), "demo")  # implemented: accepted
