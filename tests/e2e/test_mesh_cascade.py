"""The cascade through Envoy on a mesh with two models (issue 34): SmolLM2-135M-
Instruct (``smollm2``, small) and the Gemma 3 270M base model (``gemma3``,
large), the router started with ``--cascade smollm2,gemma3`` (alias ``auto``).

The prompts were chosen by measuring SmolLM2's greedy mean token logprob over
its first 6 tokens (the answer: ``max_tokens`` 6 < the window): the counting
prompt scores about -0.07 nats and stays on the small model; "My favourite
obscure word is" scores about -2.1 and is escalated at the -1.0 threshold.
Gemma's vocabulary differs from SmolLM2's, so an escalated answer that
matches Gemma's direct answer token for token holds no SmolLM2 token.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import grpc
import pytest
from llmesh.v1 import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
)

from services.cli.mesh import Mesh
from tests.e2e.mesh_client import BidiSession, Collected, collect
from tests.e2e.shared_mesh import SharedMesh
from tests.e2e.test_mesh_e2e import wait_engine_idle

pytestmark = pytest.mark.mesh

EASY = "1, 2, 3, 4, 5,"
HARD = "My favourite obscure word is"
#: A window longer than every short answer here (the rule sees the whole
#: answer) and than a deadline test's 0.8 s of small-model decoding.
WINDOW = 96
CASCADE_ARGS = ["--cascade", "smollm2,gemma3", "--cascade-window", str(WINDOW),
                "--cascade-min-mean-logprob", "-1.0", "--cascade-max-prompt-tokens", "48"]
IDLE_WITHIN_S = 10.0


@pytest.fixture(scope="module")
def cascade_mesh(two_model_mesh: SharedMesh) -> Mesh:
    """The shared two-model mesh, its router restarted with the cascade; this
    module is its last user (it stops it)."""
    mesh = two_model_mesh.get(CASCADE_ARGS)
    yield mesh
    two_model_mesh.stop()


@pytest.fixture(scope="module")
def channel(cascade_mesh: Mesh) -> grpc.Channel:
    with grpc.insecure_channel(cascade_mesh.ingress_address) as channel:
        grpc.channel_ready_future(channel).result(timeout=10)
        yield channel


@pytest.fixture(scope="module")
def engines(cascade_mesh: Mesh) -> list[engine_pb2_grpc.EngineServiceStub]:
    """The small and the large model's engine."""
    channels = [grpc.insecure_channel(cascade_mesh.services[name].grpc_address)
                for name in ("engine-0", "engine-gemma3-0")]
    yield [engine_pb2_grpc.EngineServiceStub(c) for c in channels]
    for c in channels:
        c.close()


def request(prompt: str, model: str = "auto", max_tokens: int = 6,
            **sampling: object) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        model=model, prompt=prompt, bypass_cache=True,
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, **sampling))


def run(channel: grpc.Channel, req: generation_pb2.GenerateRequest,
        metadata: tuple[tuple[str, str], ...] = ()) -> tuple[list, Collected]:
    """Every response of one Generate call, and the call collected."""
    responses = list(generation_pb2_grpc.GenerationServiceStub(channel).Generate(
        req, timeout=120, metadata=metadata))
    return responses, collect(iter(responses))


def assert_idle(engines: list[engine_pb2_grpc.EngineServiceStub]) -> None:
    """Both engines end with nothing running and every KV block free."""
    for engine in engines:
        assert wait_engine_idle(engine, within_s=IDLE_WITHIN_S) < IDLE_WITHIN_S
        assert engine.GetLoad(engine_pb2.GetLoadRequest(), timeout=5).kv_cache_usage == 0.0


def test_the_rule_keeps_an_easy_prompt_and_escalates_a_hard_one_always_alike(
        channel: grpc.Channel, cascade_mesh: Mesh) -> None:
    _, small = run(channel, request(EASY, "smollm2"))
    _, large = run(channel, request(HARD, "gemma3", max_tokens=4))
    _, small_hard = run(channel, request(HARD, "smollm2", max_tokens=4))
    # Naming a model bypasses the cascade: its answer has no path.
    assert small.last.model == "smollm2" and not small.last.HasField("cascade")
    for _ in range(2):  # a greedy request takes the same path every time
        responses, kept = run(channel, request(EASY))
        assert responses[0].model == kept.last.model == "smollm2"
        assert not kept.last.cascade.escalated and kept.last.cascade.reason == "confident"
        assert kept.last.cascade.mean_logprob > -1.0
        assert (kept.text, kept.token_ids) == (small.text, small.token_ids)
        responses, escalated = run(channel, request(HARD, max_tokens=4))
        assert escalated.last.cascade.escalated
        assert escalated.last.cascade.reason == "low_confidence"
        assert escalated.last.cascade.mean_logprob < -1.0
        # Per message: the first names the large model, none carries a
        # small-model token (Gemma's ids and text, token for token).
        assert responses[0].model == "gemma3" and responses[0].cascade.escalated
        assert all(r.model in ("", "gemma3") for r in responses)
        assert (escalated.text, escalated.token_ids) == (large.text, large.token_ids)
        assert escalated.text != small_hard.text
    with urllib.request.urlopen(
            f"http://{cascade_mesh.services['router'].metrics_address}/metrics") as page:
        metrics = page.read().decode()
    assert ('llmesh:cascade_escalations_total{model_name="auto",reason="low_confidence"} 2.0'
            in metrics)
    assert 'llmesh:cascade_held_back_seconds_count{model_name="auto"} 4.0' in metrics
    assert 'llmesh:cascade_discarded_tokens_total{model_name="auto"} 8.0' in metrics


def test_openai_edge_names_the_model_and_path(cascade_mesh: Mesh) -> None:
    def post(body: dict) -> tuple[dict[str, str], bytes]:
        req = urllib.request.Request(f"{cascade_mesh.http_url}/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as reply:
            return dict(reply.headers), reply.read()

    headers, body = post({"model": "auto", "prompt": EASY, "max_tokens": 6,
                          "temperature": 0})
    assert json.loads(body)["model"] == "smollm2"
    assert headers["x-llmesh-cascade-path"] == "small; reason=confident"
    headers, body = post({"model": "auto", "prompt": HARD, "max_tokens": 3,
                          "temperature": 0, "stream": True})
    chunks = [json.loads(line[6:]) for line in body.decode().splitlines()
              if line.startswith("data: {")]
    assert chunks and {c["model"] for c in chunks} == {"gemma3"}
    assert headers["x-llmesh-model"] == "gemma3"
    assert headers["x-llmesh-cascade-path"] == "escalated; reason=low_confidence"
    with urllib.request.urlopen(f"{cascade_mesh.http_url}/v1/models", timeout=10) as reply:
        assert [m["id"] for m in json.loads(reply.read())["data"]] == [
            "smollm2", "gemma3", "auto"]
    # QA: echo and token ids took the small model's ids to the large one (noise).
    for body, param in (({"prompt": HARD, "echo": True}, "echo"),
                        ({"prompt": [1, 2, 3]}, "prompt")):
        with pytest.raises(urllib.error.HTTPError) as refused:
            post({"model": "auto", "max_tokens": 3, **body})
        assert refused.value.code == 400
        assert param in json.loads(refused.value.read())["error"]["param"]


def test_prompt_rule_and_mode_skip_the_window(channel: grpc.Channel) -> None:
    long_prompt = " ".join(["one two three four five six seven eight"] * 8)
    _, direct = run(channel, request(long_prompt, max_tokens=1))
    assert direct.last.model == "gemma3" and direct.last.cascade.reason == "prompt_tokens"
    assert not direct.last.cascade.escalated and direct.last.cascade.held_back_tokens == 0
    _, small = run(channel, request(HARD, max_tokens=2), (("x-llmesh-cascade", "small"),))
    assert small.last.model == "smollm2" and small.last.cascade.reason == "mode_small"
    with pytest.raises(grpc.RpcError) as misplaced:
        run(channel, generation_pb2.GenerateRequest(
            model="smollm2", prompt=EASY, cascade=generation_pb2.CASCADE_MODE_SMALL))
    assert misplaced.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert misplaced.value.details().startswith("cascade:")


def test_cancel_in_the_window_ends_both_generations(
        channel: grpc.Channel, engines: list[engine_pb2_grpc.EngineServiceStub]) -> None:
    session = BidiSession(channel)
    session.start(request(EASY, max_tokens=200, ignore_eos=True))
    deadline = time.monotonic() + 30
    while engines[0].GetLoad(engine_pb2.GetLoadRequest(), timeout=5).num_running == 0:
        assert time.monotonic() < deadline, "the small generation never started"
        time.sleep(0.01)
    session.cancel()  # the small model is decoding its window: nothing was sent
    final = session.next()
    session.close()
    assert final.finish_reason == common_pb2.FINISH_REASON_CANCELLED and not final.token_ids
    assert final.usage.completion_tokens == 0  # nothing was released
    assert_idle(engines)


def test_deadline_in_the_window_ends_both_generations(
        channel: grpc.Channel, engines: list[engine_pb2_grpc.EngineServiceStub]) -> None:
    call = generation_pb2_grpc.GenerationServiceStub(channel).Generate(
        request(EASY, max_tokens=200, ignore_eos=True), timeout=0.8)
    with pytest.raises(grpc.RpcError) as late:
        next(call)  # the window is held back, then dropped: no message comes
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_idle(engines)
