"""Hypothesis strategies and case runners for fuzzing the mesh's public edges.

One copy, shared by the CI test (tests/e2e/test_mesh_fuzz.py, 2,000 cases)
and the soak script (benchmarks/fuzz_soak.py, --cases 100000). A case is one
of:

* ``("grpc", GenerateRequest)``: ``Generate`` through Envoy, random fields and
  sizes (unicode text, huge repeated ``stop`` / ``logit_bias`` / ``messages``,
  out-of-range numbers, unknown enum values);
* ``("raw", bytes)``: random bytes as the ``Generate`` request body (invalid
  UTF-8 in strings, truncated fields, unknown field numbers);
* ``("json", bytes)``: ``POST /v1/generate`` bodies (Envoy's transcoder), JSON
  with lone surrogates (``\\ud800``), wrong types, junk;
* ``("openai", bytes)``: ``POST /v1/chat/completions`` bodies likewise;
* ``("stream", [actions])``: a ``GenerateStream`` script of starts, cancels
  (right or wrong id, 0-200 ms after a start or once its first tokens
  arrived) and pauses, then a half-close or an abrupt client cancel.

:func:`run_case` sends a case and returns a :class:`CaseResult`; the caller
asserts :func:`check` (no INTERNAL / UNKNOWN / HTTP 5xx from a reset or a
bug, every call ended within its deadline).

Valid-looking requests ask for at most 16 tokens, so a case costs
milliseconds on CPU (a refused one ~2 ms, one that generates ~45 ms, plus
~6 ms of Hypothesis' own per case, measured on a quiet 2-core machine) and a
stream script at most its pauses (0.2 s) more. Inputs stay huge (past every
limit), so what bounds a case's prefill is the mesh it runs on: a chat past
the context window is trimmed to fit it, so on a model's own 8,192 tokens one
case could prefill ~8k tokens (28-32 s on 2 cores, past
:data:`CALL_DEADLINE_S`). The fuzzed mesh therefore runs with
:data:`MESH_ENGINE_ARGS` (a :data:`MAX_MODEL_LEN`-token window): every case's
prefill is at most that many tokens, whatever Hypothesis draws.
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

import grpc
from hypothesis import strategies as st

from llmesh.v1 import common_pb2, generation_pb2, generation_pb2_grpc

#: Every call must end (final message or status) within this many seconds.
CALL_DEADLINE_S = 20.0
#: The fuzzed mesh's context window in tokens: no case prefills more (a chat
#: past it is trimmed to fit, a longer prompt refused; tests/e2e/test_mesh_fuzz.py
#: times the costliest case each run).
MAX_MODEL_LEN = 512
#: The engine flags of a mesh that is fuzzed (the CI test's and the soak's).
MESH_ENGINE_ARGS = ("--max-model-len", str(MAX_MODEL_LEN))
#: The statuses that mean a crash or a bug, never a refusal.
BAD_CODES = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)

INT32 = (-(2**31), 2**31 - 1)

# ------------------------------------------------------------------ values

_special = st.sampled_from([
    "", " ", "\x00", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "\ufffd", "\u202e",
    "🙂" * 3, "é" * 5, "\n\n", "a" * 300, "日本語", "\t\r\n", "\U0010ffff"])
#: Text as protobuf can carry it (no lone surrogates: a str field must be valid UTF-8).
texts = st.one_of(st.text(max_size=40), _special)
#: Up to 200,000 characters (a prompt or one stop string past every limit).
big_texts = st.one_of(texts, st.builds(lambda s, n: (s * n)[:200_000], texts,
                                       st.integers(1, 4000)))
odd_floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.sampled_from([0.0, -0.0, 1.0, 0.5, -1.0, 2.0, 1e-30, 3.4e38, math.nan, math.inf]))
small_ints = st.integers(-3, 8)
any_int32 = st.one_of(small_ints, st.integers(*INT32))


def _opt(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.none(), strategy)


def _huge_or_small(strategy: st.SearchStrategy[Any], huge: int) -> st.SearchStrategy[list[Any]]:
    """Lists of 0-4 items, or (one in eight) of up to ``huge`` repeats."""
    return st.one_of(
        st.lists(strategy, max_size=4), st.lists(strategy, max_size=4),
        st.lists(strategy, max_size=4), st.lists(strategy, max_size=4),
        st.lists(strategy, max_size=4), st.lists(strategy, max_size=4),
        st.lists(strategy, max_size=4),
        st.builds(lambda v, n: [v] * n, strategy, st.integers(5, huge)))


@st.composite
def sampling_params(draw: st.DrawFn) -> common_pb2.SamplingParams:
    """Random sampling fields; ``max_tokens`` mostly 0..4 (cheap), sometimes wild."""
    fields: dict[str, Any] = {}
    for name, strategy in (
            ("temperature", odd_floats), ("top_p", odd_floats), ("top_k", any_int32),
            ("seed", st.integers(0, 2**64 - 1)), ("logprobs", any_int32),
            ("prompt_logprobs", st.one_of(small_ints, any_int32)), ("n", small_ints),
            ("presence_penalty", odd_floats), ("frequency_penalty", odd_floats),
            ("repetition_penalty", odd_floats), ("min_tokens", any_int32)):
        if draw(st.integers(0, 3)) == 0:
            fields[name] = draw(strategy)
    # Never unset (the router's default is hundreds of tokens) nor a valid
    # large value: a case must stay cheap.
    fields["max_tokens"] = draw(st.one_of(st.integers(0, 4), st.integers(0, 4),
                                          st.integers(0, 4), st.integers(INT32[0], -1),
                                          st.integers(1 << 20, INT32[1])))
    params = common_pb2.SamplingParams(**fields)
    # huge lists repeat short texts (a few MB at most: the gRPC message limit)
    params.stop.extend(draw(st.one_of(st.lists(big_texts, max_size=3),
                                      _huge_or_small(texts, 5000))))
    params.stop_token_ids.extend(draw(_huge_or_small(any_int32, 20000)))
    params.ignore_eos = draw(st.booleans())
    params.include_stop_str_in_output = draw(st.booleans())
    for token, bias in draw(st.one_of(
            st.dictionaries(any_int32, odd_floats, max_size=4),
            st.builds(lambda n, b: {i: b for i in range(n)}, st.integers(0, 20000),
                      odd_floats))).items():
        params.logit_bias[token] = bias
    constraint = draw(st.integers(0, 9))
    if constraint == 0:
        params.structured_output.json_schema = draw(big_texts)
    elif constraint == 1:
        params.structured_output.regex = draw(texts)
    elif constraint == 2:
        params.structured_output.choice.choices.extend(draw(st.lists(texts, max_size=3)))
    elif constraint == 3:
        params.structured_output.grammar = draw(texts)
    elif constraint == 4:
        params.structured_output.json_object = draw(st.booleans())
    return params


@st.composite
def generate_requests(draw: st.DrawFn) -> generation_pb2.GenerateRequest:
    """A random ``GenerateRequest``."""
    request = generation_pb2.GenerateRequest(
        request_id=draw(st.one_of(st.just(""), st.just(""), texts)),
        model=draw(st.one_of(st.just(""), st.just(""), st.just(""), texts)),
        sampling=draw(sampling_params()),
        priority=draw(st.one_of(st.integers(0, 2), any_int32)),
        bypass_cache=draw(st.booleans()))
    kind = draw(st.integers(0, 4))
    if kind <= 1:
        request.prompt = draw(big_texts)
    elif kind <= 3:
        messages = draw(st.one_of(
            st.lists(st.tuples(st.sampled_from(["user", "assistant", "system"]), big_texts),
                     max_size=2),
            _huge_or_small(st.tuples(
                st.one_of(st.sampled_from(["user", "assistant", "system"]), texts), texts),
                3000)))
        request.chat.messages.extend(common_pb2.ChatMessage(role=r, content=c)
                                     for r, c in messages)
        request.chat.allow_special_tokens = draw(st.booleans())
    if draw(st.integers(0, 5)) == 0:
        request.speculative.method = draw(st.one_of(st.integers(0, 3), any_int32))
        if draw(st.booleans()):
            request.speculative.num_speculative_tokens = draw(any_int32)
    return request


@st.composite
def plausible_requests(draw: st.DrawFn) -> generation_pb2.GenerateRequest:
    """A ``GenerateRequest`` inside every documented range (so it generates):
    random unicode input, stop strings, logit bias, seeds, a few tokens."""
    sampling = common_pb2.SamplingParams(
        max_tokens=draw(st.integers(1, 3)),
        temperature=draw(st.floats(0.0, 2.0)),
        top_p=draw(st.floats(0.01, 1.0)), top_k=draw(st.integers(0, 50)),
        seed=draw(st.integers(0, 2**64 - 1)), n=draw(st.integers(1, 2)),
        logprobs=draw(st.integers(0, 5)), ignore_eos=draw(st.booleans()),
        include_stop_str_in_output=draw(st.booleans()))
    sampling.stop.extend(draw(st.lists(st.text(min_size=1, max_size=8), max_size=3)))
    for token, bias in draw(st.dictionaries(st.integers(0, 40000),
                                            st.floats(-100.0, 100.0),
                                            max_size=3)).items():
        sampling.logit_bias[token] = bias
    request = generation_pb2.GenerateRequest(sampling=sampling,
                                             bypass_cache=draw(st.booleans()))
    if draw(st.booleans()):
        request.prompt = draw(st.text(min_size=1, max_size=60))
    else:
        request.chat.messages.extend(
            common_pb2.ChatMessage(role=role, content=content) for role, content in draw(
                st.lists(st.tuples(st.sampled_from(["user", "assistant", "system"]),
                                   st.text(max_size=60)), min_size=1, max_size=3)))
    return request


#: ``sampling { max_tokens: 1 }`` (field 5 holding field 5 = 1): appended to
#: every raw body, so one that parses never runs the default hundreds of tokens.
_ONE_TOKEN = b"\x2a\x02\x28\x01"

#: Raw request bodies: mutated valid messages or random bytes.
raw_bodies = st.builds(lambda body: body + _ONE_TOKEN, st.one_of(
    st.binary(max_size=200),
    st.builds(lambda r, cut: r.SerializeToString()[:cut], generate_requests(),
              st.integers(0, 400)),
    # a string field (prompt, 3) whose bytes are not UTF-8
    st.builds(lambda b: b"\x1a" + bytes([len(b)]) + b, st.binary(min_size=1, max_size=100))))

#: JSON values of every shape, lone surrogates included.
_json_strings = st.one_of(st.text(max_size=30), st.sampled_from(
    ["\ud800", "a\udfffb", "\udc00\ud800", "\x00", "🙂"]),
    st.text(alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), max_size=5))
_json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), odd_floats,
              _json_strings),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(_json_strings, inner, max_size=4)),
    max_leaves=12)
#: Small, or not a valid count (a case must stay cheap: never the default).
_json_max_tokens = st.one_of(st.integers(0, 3), st.integers(0, 3), st.sampled_from(
    ["3", -1, 1.5, True, [], {}, 2**40, "\ud800", 1e300]))
_generate_keys = ["chat", "model", "request_id", "priority", "bypass_cache", "speculative",
                  "max_tokens", "stop", "temperature"]
_sampling_keys = ["stop", "logit_bias", "temperature", "top_p", "top_k", "n",
                  "seed", "logprobs", "stop_token_ids", "min_tokens", "maxTokens"]


def _dumps(value: Any) -> bytes:
    """JSON with lone surrogates written as ``\\uXXXX`` escapes (ensure_ascii)."""
    return json.dumps(value, ensure_ascii=True, allow_nan=True).encode()


@st.composite
def generate_json_bodies(draw: st.DrawFn) -> bytes:
    """``POST /v1/generate`` bodies."""
    body: dict[str, Any] = {}
    for key in draw(st.lists(st.sampled_from(_generate_keys), max_size=4, unique=True)):
        body[key] = draw(_json_values)
    if draw(st.booleans()):
        body["prompt"] = draw(_json_strings)
        body["sampling"] = {k: draw(_json_values) for k in draw(
            st.lists(st.sampled_from(_sampling_keys), max_size=3, unique=True))}
        body["sampling"]["max_tokens"] = draw(_json_max_tokens)
        if draw(st.integers(0, 7)) == 0:
            body["sampling"]["stop"] = ["x" * draw(st.integers(1, 50))] * draw(
                st.integers(1, 5000))
    raw = _dumps(draw(st.one_of(st.just(body), st.just(body), _json_values)))
    mangle = draw(st.integers(0, 7))
    if mangle == 0:
        raw = raw[:draw(st.integers(0, len(raw)))]
    elif mangle == 1:
        raw = raw.replace(b"\\ud", b"\xed\xa0")  # raw surrogate bytes (invalid UTF-8)
    return raw


@st.composite
def openai_bodies(draw: st.DrawFn) -> bytes:
    """``POST /v1/chat/completions`` bodies."""
    body: dict[str, Any] = {
        "model": draw(st.one_of(st.just(""), _json_strings, _json_values)),
        "messages": draw(st.one_of(
            st.lists(st.fixed_dictionaries({"role": st.one_of(
                st.sampled_from(["user", "system", "assistant"]), _json_strings),
                "content": st.one_of(_json_strings, _json_values)}), max_size=3),
            st.builds(lambda c, n: [{"role": "user", "content": c}] * n, _json_strings,
                      st.integers(1, 3000)),
            _json_values)),
        "max_tokens": draw(_json_max_tokens),
    }
    for key in draw(st.lists(st.sampled_from(
            ["stop", "logit_bias", "temperature", "top_p", "n", "seed", "stream", "logprobs",
             "top_logprobs", "presence_penalty", "response_format", "user"]),
            max_size=4, unique=True)):
        body[key] = draw(_json_values)
    if draw(st.integers(0, 7)) == 0:
        body["logit_bias"] = {str(i): 1.0 for i in range(draw(st.integers(1, 20000)))}
    raw = _dumps(body)
    if draw(st.integers(0, 7)) == 0:
        raw = raw[:draw(st.integers(0, len(raw)))]
    return raw


#: Pauses (seconds) between a script's steps: a cancel racing its start.
_SHORT_PAUSES = [0.0, 0.001, 0.005, 0.02]
#: The longest pause before a cancel (seconds): past the first token (TTFT
#: through Envoy is ~20-50 ms on the CPU mesh), inside a 4-16 token answer.
#: Not on a loaded machine (TTFT 0.2-2 s at load ~10 on 2 cores), hence
#: the ``("first_tokens", None)`` step.
CANCEL_PAUSE_MAX_S = 0.2
#: The longest a ``first_tokens`` step waits (seconds) for the first tokens or
#: the end of the stream (a refused start ends it).
FIRST_TOKENS_WAIT_S = CALL_DEADLINE_S / 2


@st.composite
def stream_scripts(draw: st.DrawFn) -> list[tuple[str, Any]]:
    """A ``GenerateStream`` script: ("start", request) / ("cancel", id) /
    ("sleep", seconds) / ("first_tokens", None) steps, then ("close", None)
    or ("abort", None).

    One script in four opens with a start that generates (4-16 tokens, EOS
    ignored), then a pause of 0-200 ms (:data:`CANCEL_PAUSE_MAX_S`) or
    (twice as often) a wait for its first tokens, and a cancel of the running generation:
    a cancel before, at and after the first tokens, the last whatever the
    machine's speed. Other pauses are 0-20 ms, so a case stays well under a
    second on a quiet machine.
    """
    steps: list[tuple[str, Any]] = []
    if draw(st.integers(0, 3)) == 0:
        steps += [("start", generation_pb2.GenerateRequest(
                      prompt="Say " + draw(texts), bypass_cache=True,
                      sampling=common_pb2.SamplingParams(
                          max_tokens=draw(st.integers(4, 16)), ignore_eos=True))),
                  draw(st.one_of(st.tuples(st.just("sleep"),
                                           st.floats(0.0, CANCEL_PAUSE_MAX_S)),
                                 st.just(("first_tokens", None)),
                                 st.just(("first_tokens", None)))),
                  ("cancel", "")]
    for _ in range(draw(st.integers(0 if steps else 1, 4 - len(steps) // 2))):
        step = draw(st.integers(0, 3))
        if step == 0:
            steps.append(("start", draw(generate_requests())))
        elif step == 1:
            steps.append(("start", generation_pb2.GenerateRequest(
                prompt=draw(texts), sampling=common_pb2.SamplingParams(
                    max_tokens=draw(st.integers(1, 6)), ignore_eos=True), bypass_cache=True)))
        elif step == 2:
            steps.append(("cancel", draw(st.one_of(st.just(""), texts))))
        else:
            steps.append(("sleep", draw(st.sampled_from(_SHORT_PAUSES))))
    steps.append((draw(st.sampled_from(["close", "close", "abort"])), None))
    return steps


cases = st.one_of(
    st.tuples(st.just("grpc"), plausible_requests()),
    st.tuples(st.just("grpc"), generate_requests()),
    st.tuples(st.just("grpc"), generate_requests()),
    st.tuples(st.just("raw"), raw_bodies),
    st.tuples(st.just("json"), generate_json_bodies()),
    st.tuples(st.just("openai"), openai_bodies()),
    st.tuples(st.just("stream"), stream_scripts()),
)

# ------------------------------------------------------------------ running


@dataclass
class CaseResult:
    """How one case ended.

    Attributes:
      kind: the case's kind.
      outcome: the gRPC status name, ``OK``, or ``HTTP <status>``.
      seconds: wall time of the case.
      detail: the status message or response body start.
      cancelled_after_tokens: a stream script sent its first cancel after
        token-carrying messages had arrived (a cancel of a running generation).
    """

    kind: str
    outcome: str
    seconds: float
    detail: str = ""
    cancelled_after_tokens: bool = False


def check(result: CaseResult) -> str | None:
    """Why ``result`` is a failure (crash status, 5xx, too slow), or None."""
    if result.outcome in ("INTERNAL", "UNKNOWN"):
        return f"{result.kind}: {result.outcome}: {result.detail}"
    if result.outcome.startswith("HTTP 5") and result.outcome not in ("HTTP 503", "HTTP 504"):
        return f"{result.kind}: {result.outcome}: {result.detail}"
    if result.outcome in ("HTTP 503", "HTTP 504") and "upstream" in result.detail:
        return f"{result.kind}: Envoy lost the upstream: {result.detail}"
    if result.seconds > CALL_DEADLINE_S:
        return f"{result.kind}: took {result.seconds:.1f} s"
    return None


class Target:
    """Where cases go: Envoy's ingress (gRPC and HTTP)."""

    def __init__(self, ingress_address: str) -> None:
        self.address = ingress_address
        self.channel = grpc.insecure_channel(ingress_address, options=[
            ("grpc.max_send_message_length", 64 << 20)])
        self.stub = generation_pb2_grpc.GenerationServiceStub(self.channel)
        self.raw_generate = self.channel.unary_stream(
            "/llmesh.v1.GenerationService/Generate",
            request_serializer=lambda body: body,
            response_deserializer=generation_pb2.GenerateResponse.FromString)

    def close(self) -> None:
        self.channel.close()


def _drain(call: Any, tokens: list[int] | None = None) -> tuple[str, str]:
    """Reads ``call`` to its end; returns (status name, message). Appends the
    number of token ids of each message that carries some to ``tokens``."""
    try:
        for message in call:
            if tokens is not None:
                response = getattr(message, "response", message)
                if response.token_ids:
                    tokens.append(len(response.token_ids))
    except grpc.RpcError as err:
        return err.code().name, err.details() or ""
    return "OK", ""


def _post(url: str, body: bytes) -> tuple[str, str]:
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=CALL_DEADLINE_S) as response:
            response.read()
            return f"HTTP {response.status}", ""
    except urllib.error.HTTPError as err:
        return f"HTTP {err.code}", err.read()[:300].decode(errors="replace")


def _run_stream(target: Target, steps: list[tuple[str, Any]]) -> tuple[str, str, bool]:
    """Plays ``steps``; returns (status name, message, whether the first
    cancel went out after token-carrying messages had arrived)."""
    import queue
    import threading

    outbox: queue.Queue[generation_pb2.GenerateStreamRequest | None] = queue.Queue()
    call = target.stub.GenerateStream(iter(outbox.get, None), timeout=CALL_DEADLINE_S)
    result: list[tuple[str, str]] = []
    tokens: list[int] = []
    reader = threading.Thread(target=lambda: result.append(_drain(call, tokens)), daemon=True)
    reader.start()
    after_tokens: bool | None = None
    for action, value in steps:
        if action == "start":
            outbox.put(generation_pb2.GenerateStreamRequest(start=value))
        elif action == "cancel":
            if after_tokens is None:
                after_tokens = bool(tokens)
            outbox.put(generation_pb2.GenerateStreamRequest(
                cancel=generation_pb2.CancelGeneration(request_id=value)))
        elif action == "sleep":
            time.sleep(value)
        elif action == "first_tokens":
            limit = time.monotonic() + FIRST_TOKENS_WAIT_S
            while not tokens and not result and time.monotonic() < limit:
                time.sleep(0.002)
        elif action == "close":
            outbox.put(None)
        else:  # abort: the client goes away mid-stream
            call.cancel()
            outbox.put(None)
    reader.join(CALL_DEADLINE_S + 5)
    if not result:
        return "HUNG", "the stream did not end", bool(after_tokens)
    code, detail = result[0]
    if code == "CANCELLED" and steps[-1][0] == "abort":
        code, detail = "OK", ""
    return code, detail, bool(after_tokens)


def run_case(target: Target, case: tuple[str, Any]) -> CaseResult:
    """Sends one case; returns how it ended."""
    kind, value = case
    started = time.monotonic()
    if kind == "grpc":
        outcome, detail = _drain(target.stub.Generate(value, timeout=CALL_DEADLINE_S))
    elif kind == "raw":
        outcome, detail = _drain(target.raw_generate(value, timeout=CALL_DEADLINE_S))
    elif kind == "json":
        outcome, detail = _post(f"http://{target.address}/v1/generate", value)
    elif kind == "openai":
        outcome, detail = _post(f"http://{target.address}/v1/chat/completions", value)
    else:
        outcome, detail, after_tokens = _run_stream(target, value)
        return CaseResult(kind, outcome, time.monotonic() - started, detail, after_tokens)
    return CaseResult(kind, outcome, time.monotonic() - started, detail)
