"""Router events formatted as OpenAI bodies: n choices, logprobs, usage, errors.

Built from constructed router events (``Delta`` / ``Finished`` with logprobs and
choice indexes), so the format is right the moment the engine sends them.
"""

from __future__ import annotations

import dataclasses

import grpc

from services.common.logprobs import PositionLogprobs, TokenLogprob
from services.common.sampling import FinishReason
from services.common.wire.engine_stream import Usage
from services.router.generation import Delta, Finished
from services.router.openai_format import (
    ResponseBuilder,
    error_for_status,
    token_bytes,
)
from services.router.openai_protocol import Endpoint
from services.router.prompt_echo import EchoedPrompt


def position(token_id: int, token: str, logprob: float, *alts: tuple[int, str, float]
             ) -> PositionLogprobs:
    top = tuple(TokenLogprob(i, lp, rank + 1, t) for rank, (i, t, lp) in enumerate(alts))
    return PositionLogprobs(TokenLogprob(token_id, logprob, 1, token), top)


HELLO = position(5, "Hel", -0.1, (5, "Hel", -0.1), (6, "Hi", -2.5))
LO = position(7, "lo", -0.2, (7, "lo", -0.2), (8, "la", -1.7))


def n_events() -> list[Delta | Finished]:
    """Two choices interleaved, each ending on its own."""
    return [
        Delta("Hel", (5,), (HELLO,), (position(2, "A", -3.0, (9, "The", -1.0)),), index=0),
        Delta("Yes", (11,), (), index=1),
        Delta("lo", (7,), (LO,), index=0),
        Finished(FinishReason.LENGTH, "", Usage(4, 2, 3), index=0),
        Finished(FinishReason.STOP, "", Usage(4, 1, 3), index=1),
    ]


def test_chat_response_has_each_choice_with_its_finish_reason_and_summed_usage():
    builder = ResponseBuilder(Endpoint.CHAT, "r1", "m", logprobs=True)
    for event in n_events():
        builder.add(event)
    body = builder.response()
    assert body["id"] == "chatcmpl-r1" and body["object"] == "chat.completion"
    first, second = body["choices"]
    assert first["message"] == {"role": "assistant", "content": "Hello"}
    assert (first["index"], first["finish_reason"]) == (0, "length")
    assert (second["index"], second["finish_reason"]) == (1, "stop")
    assert second["message"]["content"] == "Yes"
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 3}}
    content = first["logprobs"]["content"]
    assert [c["token"] for c in content] == ["Hel", "lo"]
    assert content[0]["logprob"] == -0.1 and content[0]["bytes"] == list(b"Hel")
    assert content[0]["top_logprobs"][1] == {"token": "Hi", "logprob": -2.5,
                                             "bytes": list(b"Hi")}
    assert body["prompt_logprobs"] == [None, {"2": {"logprob": -3.0, "rank": 1,
                                                    "decoded_token": "A"},
                                              "9": {"logprob": -1.0, "rank": 1,
                                                    "decoded_token": "The"}}]


def test_completion_logprobs_have_openai_legacy_shape():
    builder = ResponseBuilder(Endpoint.COMPLETIONS, "r2", "m", logprobs=True)
    for event in n_events()[:4]:
        builder.add(event)
    choice = builder.response()["choices"][0]
    assert choice["text"] == "Hello"
    assert choice["logprobs"] == {
        "tokens": ["Hel", "lo"], "token_logprobs": [-0.1, -0.2],
        "top_logprobs": [{"Hel": -0.1, "Hi": -2.5}, {"lo": -0.2, "la": -1.7}],
        "text_offset": [0, 3]}
    assert choice["prompt_logprobs"][0] is None


def test_without_logprobs_asked_they_are_null():
    builder = ResponseBuilder(Endpoint.CHAT, "r", "m")
    builder.add(Delta("x", (1,)))
    builder.add(Finished(FinishReason.STOP, "", Usage(1, 1)))
    assert builder.response()["choices"][0]["logprobs"] is None


def test_stream_chunks_carry_the_choice_index_role_once_and_a_usage_chunk():
    builder = ResponseBuilder(Endpoint.CHAT, "r3", "m", logprobs=True, include_usage=True)
    chunks = [c for e in n_events() for c in builder.chunks(e)]
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in chunks)
    assert [c["choices"][0]["index"] for c in chunks] == [0, 1, 0, 0, 1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Hel"}
    assert chunks[1]["choices"][0]["delta"] == {"role": "assistant", "content": "Yes"}
    assert chunks[2]["choices"][0]["delta"] == {"content": "lo"}
    assert chunks[2]["choices"][0]["logprobs"]["content"][0]["token"] == "lo"
    assert "prompt_logprobs" in chunks[0] and "prompt_logprobs" not in chunks[2]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None,
                                                                  "length", "stop"]
    assert chunks[3]["choices"][0]["delta"] == {}
    last = builder.usage_chunk()
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3
    assert builder.finished_choices() == 2


def test_completion_stream_chunks_have_text_and_offsets():
    builder = ResponseBuilder(Endpoint.COMPLETIONS, "r4", "m", logprobs=True)
    first, second = (c for e in (n_events()[0], n_events()[2]) for c in builder.chunks(e))
    assert first["object"] == "text_completion" and "usage" not in first
    assert first["choices"][0]["text"] == "Hel"
    assert second["choices"][0]["logprobs"]["text_offset"] == [3]


#: "a🙂日本ok": the emoji (F0 9F 99 82) in two byte-fragment tokens, CJK whole.
SPLIT_EMOJI = [Delta("a", (1,), (position(1, "a", -0.1),)),
               Delta("", (2,), (position(2, "bytes:\\xf0\\x9f", -0.2),)),
               Delta("\U0001F642\u65e5\u672cok", (3, 4, 5),
                     (position(3, "bytes:\\x99\\x82", -0.3), position(4, "\u65e5\u672c", -0.4),
                      position(5, "ok", -0.5))),
               Finished(FinishReason.LENGTH, "", Usage(2, 5))]


def test_text_offsets_count_characters_not_the_bytes_spelling():
    """Bug 3 of issue 30: a ``bytes:\\xNN`` token advanced the offset by its
    14-character spelling. Each fragment of the emoji starts where the emoji
    does; the tokens after it index the text exactly."""
    builder = ResponseBuilder(Endpoint.COMPLETIONS, "r5", "m", logprobs=True)
    for event in SPLIT_EMOJI:
        builder.add(event)
    choice = builder.response()["choices"][0]
    text, offsets = choice["text"], choice["logprobs"]["text_offset"]
    assert text == "a\U0001F642\u65e5\u672cok" and offsets == [0, 1, 1, 2, 4]
    for token, offset in zip(choice["logprobs"]["tokens"], offsets):
        assert token.startswith("bytes:") or text[offset:].startswith(token)
    streamed = ResponseBuilder(Endpoint.COMPLETIONS, "r5", "m", logprobs=True)
    chunks = [c for e in SPLIT_EMOJI[:3] for c in streamed.chunks(e)]
    assert [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]] == offsets


def test_tokens_of_a_stop_string_cut_from_the_text_start_at_its_end():
    builder = ResponseBuilder(Endpoint.COMPLETIONS, "r6", "m", logprobs=True)
    builder.add(Delta("ab", (1, 2), (position(1, "ab", -0.1), position(2, "X", -0.2))))
    builder.add(Delta("", (3,), (position(3, "YZ", -0.3),)))
    builder.add(Finished(FinishReason.STOP, "XYZ", Usage(2, 3)))
    assert builder.response()["choices"][0]["logprobs"]["text_offset"] == [0, 2, 2]


def test_an_echoed_prompt_leads_text_and_logprobs_with_offsets_into_its_markup():
    # Gemma-like: a BOS whose text is its markup, then half an emoji per token.
    echo = EchoedPrompt((2, 5, 30, 31), ("<bos>", "Hel", "bytes:\\xf0\\x9f", "bytes:\\x9a\\x80"),
                        "<bos>Hel\U0001f680")
    scored = (position(5, "Hel", -1.5, (5, "Hel", -1.5)), position(30, "bytes:\\xf0\\x9f", -2.0),
              position(31, "bytes:\\x9a\\x80", -0.01))
    events = [Delta("lo", (7,), (LO,), scored), Finished(FinishReason.LENGTH, "", Usage(4, 1, 0))]
    body = ResponseBuilder(Endpoint.COMPLETIONS, "r", "m", logprobs=True, echo=echo,
                           show_prompt_logprobs=False)
    for event in events:
        body.add(event)
    choice = body.response()["choices"][0]
    assert choice["text"] == "<bos>Hel\U0001f680lo" and "prompt_logprobs" not in choice
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == ["<bos>", "Hel", "bytes:\\xf0\\x9f", "bytes:\\x9a\\x80", "lo"]
    assert logprobs["token_logprobs"] == [None, -1.5, -2.0, -0.01, -0.2]
    assert logprobs["top_logprobs"][0] is None and logprobs["top_logprobs"][1] == {"Hel": -1.5}
    assert logprobs["text_offset"] == [0, 5, 8, 8, 9]  # both emoji halves at the emoji
    alone = ResponseBuilder(Endpoint.COMPLETIONS, "r", "m", logprobs=True,
                            echo=dataclasses.replace(echo, only=True))
    for event in events:
        alone.add(event)
    only = alone.response()["choices"][0]
    assert only["text"] == "<bos>Hel\U0001f680" and len(only["logprobs"]["tokens"]) == 4
    assert len(only["prompt_logprobs"]) == 4  # vLLM's field where the client asked


def streamed_choices(builder: ResponseBuilder, events: list[Delta | Finished]
                     ) -> dict[int, dict]:
    """Each choice's streamed chunks joined: text, logprobs lists, finish."""
    joined: dict[int, dict] = {}
    for chunk in (c for e in events for c in builder.chunks(e)):
        (body,) = chunk["choices"]
        got = joined.setdefault(body["index"], {"text": "", "finish_reason": None,
                                                "logprobs": {"tokens": [], "token_logprobs": [],
                                                             "top_logprobs": [],
                                                             "text_offset": []}})
        got["text"] += body["text"]
        got["finish_reason"] = got["finish_reason"] or body["finish_reason"]
        for key, values in (body["logprobs"] or {}).items():
            got["logprobs"][key] += values
    return joined


def test_a_streamed_echo_joins_to_the_response_for_every_choice_and_max_tokens_0():
    # Choice 1 speaks before choice 0 brings the prompt's logprobs: it waits for them.
    echo = EchoedPrompt((2, 5, 30), ("<bos>", "Hel", "lo"), "<bos>Hello")
    scored = (position(5, "Hel", -1.5, (5, "Hel", -1.5)),
              position(30, "lo", -2.0, (30, "lo", -2.0)))
    events = [Delta("Yes", (11,), (position(11, "Yes", -0.3, (11, "Yes", -0.3)),), index=1),
              Delta("Hel", (5,), (HELLO,), scored, index=0),
              Finished(FinishReason.STOP, "", Usage(3, 1), index=1),
              Delta("lo", (7,), (LO,), index=0),
              Finished(FinishReason.LENGTH, "", Usage(3, 2), index=0)]
    for only in (False, True):
        shape = {"logprobs": True, "echo": dataclasses.replace(echo, only=only),
                 "show_prompt_logprobs": False}
        whole = ResponseBuilder(Endpoint.COMPLETIONS, "r", "m", **shape)
        for event in events:
            whole.add(event)
        expected = {c["index"]: {k: c[k] for k in ("text", "logprobs", "finish_reason")}
                    for c in whole.response()["choices"]}
        streamed = ResponseBuilder(Endpoint.COMPLETIONS, "r", "m", **shape)
        assert streamed_choices(streamed, events) == expected
        assert expected[0]["text"] == "<bos>Hello" + ("" if only else "Hello")
        assert expected[1]["text"] == "<bos>Hello" + ("" if only else "Yes")
        assert expected[1]["logprobs"]["token_logprobs"][:3] == [None, -1.5, -2.0]
        assert expected[0]["logprobs"]["text_offset"] == [0, 5, 8, 10, 13][:3 if only else 5]
    # A choice that finishes with nothing streams its prompt, then its finish.
    alone = ResponseBuilder(Endpoint.COMPLETIONS, "r", "m", echo=echo)
    chunks = alone.chunks(Finished(FinishReason.STOP, "", Usage(3, 0)))
    assert [c["choices"][0]["text"] for c in chunks] == ["<bos>Hello", ""]
    assert "prompt_logprobs" not in chunks[0]


def test_token_bytes_decodes_byte_escapes():
    assert token_bytes("é") == [0xC3, 0xA9]
    assert token_bytes("bytes:\\xe2\\x80") == [0xE2, 0x80]


def test_errors_map_status_param_and_retry_after():
    bad = error_for_status(grpc.StatusCode.OUT_OF_RANGE, "max_tokens: too many",
                           param="max_tokens")
    assert (bad.status, bad.body()["error"]["param"]) == (400, "max_tokens")
    assert bad.body()["error"]["type"] == "invalid_request_error"
    busy = error_for_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "full", retry_after_s=3)
    assert busy.status == 429 and busy.headers() == {"Retry-After": "3"}
    model = error_for_status(grpc.StatusCode.INVALID_ARGUMENT, "no", unknown_model=True)
    assert (model.status, model.body()["error"]["code"]) == (404, "model_not_found")
    assert error_for_status(grpc.StatusCode.UNAVAILABLE, "x").status == 503
    assert error_for_status(grpc.StatusCode.DEADLINE_EXCEEDED, "x").status == 504
    assert error_for_status(grpc.StatusCode.UNIMPLEMENTED, "x").status == 500  # never 501
    assert error_for_status(grpc.StatusCode.INTERNAL, "x").status == 500
