"""OpenAI bodies with lone surrogate escapes are refused INVALID_ARGUMENT, not
an internal error (found by tests/e2e/test_mesh_fuzz.py)."""

from __future__ import annotations

import pytest

from services.common.sampling import InvalidRequestError
from services.router.openai_protocol import Endpoint, parse_request


@pytest.mark.parametrize("body", [
    b'{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}',
    b'{"messages": [{"role": "user", "content": "a\\udfffb"}], "max_tokens": 1}',
    b'{"messages": [{"role": "user", "content": "hi"}], "\\udc00": 1}',
])
def test_a_lone_surrogate_escape_is_refused_naming_the_body(body: bytes) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        parse_request(Endpoint.CHAT, body)
    assert caught.value.field == "body" and "surrogate" in str(caught.value)


def test_a_surrogate_pair_is_a_character() -> None:
    parsed = parse_request(Endpoint.CHAT, b'{"messages": [{"role": "user", '
                           b'"content": "\\ud83d\\ude42"}], "max_tokens": 1}')
    assert [m.content for m in parsed.generate.chat.messages] == ["\U0001F642"]
