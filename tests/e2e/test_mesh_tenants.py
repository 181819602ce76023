"""API keys and per-tenant limits on the real mesh (Envoy, router with
``--api-keys``, tokenizer, one torch engine, SmolLM2): UNAUTHENTICATED / 401
for a missing or wrong key on gRPC, the OpenAI endpoint and the JSON
transcoder; PERMISSION_DENIED / 403 for a model the tenant may not use; a
tenant over its tokens per minute refused with a hint while another is
served; a SIGHUP reload taking effect without ending a stream in flight;
caches scoped by tenant (response cache, coalescing, prefix cache: over gRPC
and the OpenAI endpoint, a tenant never reuses another's work, nor learns of
it from ``cached`` or the cached prompt tokens; a ``cache_group`` shares; a
``cache_salt`` scopes further); and no key, key hash or prompt text in any
log or metrics page of the run."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmesh.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from services.cli.main import client_examples
from services.cli.mesh import Mesh
from services.router.api_keys import hash_key
from tests.e2e.overload_client import Outcome, long_request, run_one
from tests.e2e.shared_mesh import SharedMesh

pytestmark = pytest.mark.mesh

KEYS = {"alpha": "lmk_alpha-0a1b2c3d4e5f", "beta": "lmk_beta-6a7b8c9d0e1f",
        "narrow": "lmk_narrow-1f2e3d4c5b", "old": "lmk_old-9z8y7x6w5v", "new": "lmk_new-5v6w7x8y9z",
        "zeta": "lmk_zeta-3c4d5e6f7a8b", "acme1": "lmk_acme1-8b7a6f5e4d",
        "acme2": "lmk_acme2-4d5e6f7a8b"}
#: A key no tenant holds (the unauthenticated cases send it).
WRONG_KEY = "lmk_not-a-key"
#: alpha's tokens per minute: one request of 120 max_tokens fits, two do not.
ALPHA_TPM = 250
#: Text that must never reach a log line or a metric (prompts are private).
SECRET_PROMPT = "Quokka-7731 says"


def write_keys(path: Path, *, gamma_key: str) -> None:
    path.write_text(json.dumps({"tenants": [
        {"id": "alpha", "keys": [hash_key(KEYS["alpha"])],
         "limits": {"tokens_per_minute": ALPHA_TPM}},
        {"id": "beta", "keys": [hash_key(KEYS["beta"])]},
        {"id": "narrow", "keys": [hash_key(KEYS["narrow"])], "models": ["another-model"]},
        {"id": "gamma", "keys": [hash_key(gamma_key)]},
        # zeta's caches are its own (as beta's); acme-1 and acme-2 share theirs
        {"id": "zeta", "keys": [hash_key(KEYS["zeta"])]},
        {"id": "acme-1", "keys": [hash_key(KEYS["acme1"])], "cache_group": "acme"},
        {"id": "acme-2", "keys": [hash_key(KEYS["acme2"])], "cache_group": "acme"},
    ]}))


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    write_keys(path, gamma_key=KEYS["old"])
    return path


@pytest.fixture(scope="module")
def mesh(small_window_engine: SharedMesh, keys_file: Path) -> Mesh:
    """test_mesh_faults's engine (512-token window; conftest.py), the
    router restarted with the keys file (test_mesh_fuzz takes the mesh over next)."""
    return small_window_engine.get(["--api-keys", str(keys_file)])


def auth(tenant: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {KEYS[tenant]}"),)


def request(max_tokens: int, tag: str) -> generation_pb2.GenerateRequest:
    req = long_request(max_tokens, tag)
    req.prompt = f"{SECRET_PROMPT} {tag}:"
    return req


def http(url: str, body: dict | None, headers: dict[str, str]) -> tuple[int, dict, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data,
                                 headers={"content-type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=60) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, {k.lower(): v for k, v in err.headers.items()}, json.loads(err.read())


def metrics_text(address: str) -> str:
    return urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()


def counter(mesh: Mesh, name: str, **labels: str) -> float:
    want = "".join(f'(?=[^}}]*{k}="{re.escape(v)}")' for k, v in labels.items())
    body = metrics_text(mesh.router.metrics_address)
    match = re.search(rf"^{re.escape(name)}\{{{want}[^}}]*\}} (\S+)$", body, re.M)
    return float(match.group(1)) if match else 0.0


def test_a_missing_or_wrong_key_is_unauthenticated_on_every_edge(mesh: Mesh) -> None:
    with grpc.insecure_channel(mesh.ingress_address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        for metadata, message in [
                ((), "missing API key: send 'authorization: Bearer <key>'"),
                ((("authorization", f"Bearer {WRONG_KEY}"),), "invalid API key"),
                ((("x-api-key", WRONG_KEY), ("x-tenant-id", "alpha")), "invalid API key")]:
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(request(2, "u"), timeout=30, metadata=metadata or None))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert info.value.details().startswith(message)
        with pytest.raises(grpc.RpcError) as info:
            stub.ListModels(generation_pb2.ListModelsRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # x-api-key works as well as the bearer header.
        models = stub.ListModels(generation_pb2.ListModelsRequest(), timeout=10,
                                 metadata=(("x-api-key", KEYS["beta"]),)).models
        assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]
    with grpc.insecure_channel(mesh.router.grpc_address) as channel:  # health stays open
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="llmesh.v1.GenerationService"), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    chat = {"model": "SmolLM2-135M-Instruct", "max_tokens": 2,
            "messages": [{"role": "user", "content": SECRET_PROMPT}]}
    status, _, body = http(f"{mesh.http_url}/v1/chat/completions", chat, {})
    assert status == 401 and body["error"]["code"] == "missing_api_key"
    assert body["error"]["type"] == "invalid_request_error"
    status, _, body = http(f"{mesh.http_url}/v1/chat/completions", chat,
                           {"authorization": f"Bearer {WRONG_KEY}"})
    assert (status, body["error"]["message"]) == (401, "invalid API key")
    # Envoy's JSON transcoder maps UNAUTHENTICATED to 401 too.
    status, _, body = http(f"{mesh.http_url}/v1/generate", {"prompt": SECRET_PROMPT}, {})
    assert status == 401 and body["code"] == grpc.StatusCode.UNAUTHENTICATED.value[0]
    status, _, _ = http(f"{mesh.http_url}/v1/generate",
                        {"prompt": SECRET_PROMPT, "sampling": {"max_tokens": 2}},
                        {"authorization": f"Bearer {KEYS['beta']}"})
    assert status == 200


def test_the_examples_llmesh_up_prints_with_api_keys_work_with_a_key(mesh: Mesh) -> None:
    lines = client_examples(mesh.ingress_address, "Name a colour.", api_keys=True)
    assert lines[0].startswith("export LLMESH_API_KEY=")
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    env = {**os.environ, "PATH": path, "LLMESH_API_KEY": KEYS["beta"]}
    env.pop("LLMESH_URL", None)
    for line in lines[1:]:
        done = subprocess.run(line, shell=True, capture_output=True, text=True, timeout=60,
                              env=env)
        assert done.returncode == 0, (line, done.stderr)
        assert "nauthenticated" not in done.stdout + done.stderr, line
    models = subprocess.run(lines[4], shell=True, capture_output=True, text=True, timeout=30,
                            env=env, check=True)
    assert json.loads(models.stdout)["data"][0]["id"] == "SmolLM2-135M-Instruct"
    # Without the key the same lines are refused; the CLI says what to set.
    denied = subprocess.run(lines[4], shell=True, capture_output=True, text=True, timeout=30,
                            env={**env, "LLMESH_API_KEY": ""})
    assert json.loads(denied.stdout)["error"]["code"] == "missing_api_key"
    denied = subprocess.run(lines[1], shell=True, capture_output=True, text=True, timeout=30,
                            env={**env, "LLMESH_API_KEY": ""})
    assert denied.returncode == 1 and "UNAUTHENTICATED" in denied.stderr
    assert "export LLMESH_API_KEY=<key>" in denied.stderr


def test_a_model_the_tenant_may_not_use_is_permission_denied(mesh: Mesh) -> None:
    with grpc.insecure_channel(mesh.ingress_address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request(2, "n"), timeout=30, metadata=auth("narrow")))
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert info.value.details() == ("tenant 'narrow' may not use model "
                                        "'SmolLM2-135M-Instruct'; its keys allow 'another-model'")
        assert not stub.ListModels(generation_pb2.ListModelsRequest(), timeout=10,
                                   metadata=auth("narrow")).models
    status, _, body = http(f"{mesh.http_url}/v1/completions",
                           {"model": "SmolLM2-135M-Instruct", "prompt": "x", "max_tokens": 2},
                           {"x-api-key": KEYS["narrow"]})
    assert status == 403 and body["error"]["code"] == "model_not_allowed"


def test_a_tenant_over_its_tokens_per_minute_is_refused_while_another_is_served(
        mesh: Mesh) -> None:
    async def scenario() -> None:
        async with grpc.aio.insecure_channel(mesh.ingress_address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            started = asyncio.Event()
            # alpha's first request reserves prompt + 120 of its 250 tokens per minute.
            first = stub.Generate(request(120, "a1"), timeout=120, metadata=auth("alpha"))
            await first.read()
            over = run_one(stub, request(120, "a2"), metadata=auth("alpha"))
            # beta's key with alpha's x-tenant-id: the key decides, beta is served.
            other = run_one(stub, request(12, "b1"),
                            metadata=(*auth("beta"), ("x-tenant-id", "alpha")),
                            first_token=started, first_token_count=1)
            refused, served = await asyncio.gather(over, other)
            assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.details
            assert "tenant 'alpha'" in refused.details and "tokens_per_minute" in refused.details
            assert refused.retry_after_ms is not None and 1 <= refused.retry_after_ms <= 60_000
            assert served.code == grpc.StatusCode.OK and served.tokens == 12
            # HTTP: the same refusal is a 429 with Retry-After (seconds).
            status, headers, body = await asyncio.to_thread(
                http, f"{mesh.http_url}/v1/completions",
                {"model": "SmolLM2-135M-Instruct", "prompt": SECRET_PROMPT, "max_tokens": 120},
                {"authorization": f"Bearer {KEYS['alpha']}"})
            assert status == 429 and 1 <= int(headers["retry-after"]) <= 60, body
            # Cancelling the first returns its unused reservation at once (once
            # the router has seen the cancel: a few ms after the client sent it).
            first.cancel()
            for _ in range(40):
                retried = await run_one(stub, request(120, "a3"), metadata=auth("alpha"),
                                        timeout=1.5)
                if retried.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    break
                await asyncio.sleep(0.05)
            assert retried.code in (grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED)
            assert retried.tokens >= 1, retried.details

    asyncio.run(scenario())
    assert counter(mesh, "llmesh:tenant_limited_total", tenant="alpha",
                   limit="tokens_per_minute") >= 2
    assert counter(mesh, "llmesh:tenant_requests_total", tenant="beta", outcome="length") >= 1


def test_sighup_reloads_the_keys_while_a_stream_started_before_runs_to_its_end(
        mesh: Mesh, keys_file: Path) -> None:
    async def scenario() -> None:
        async with grpc.aio.insecure_channel(mesh.ingress_address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            started = asyncio.Event()
            long = asyncio.create_task(run_one(stub, request(96, "g1"), metadata=auth("old"),
                                               first_token=started, first_token_count=1))
            await asyncio.wait_for(started.wait(), 60)
            write_keys(keys_file, gamma_key=KEYS["new"])
            os.kill(mesh.router.pid, signal.SIGHUP)
            deadline = time.monotonic() + 20
            while counter(mesh, "llmesh:api_key_reloads_total", outcome="ok") < 1:
                assert time.monotonic() < deadline, "the router did not reload"
                await asyncio.sleep(0.05)
            fresh = await run_one(stub, request(2, "g2"), metadata=auth("new"))
            stale = await run_one(stub, request(2, "g3"), metadata=auth("old"))
            assert fresh.code == grpc.StatusCode.OK and fresh.tokens == 2, fresh.details
            assert stale.code == grpc.StatusCode.UNAUTHENTICATED
            assert not long.done()
            outcome = await long
            assert outcome.code == grpc.StatusCode.OK and outcome.tokens == 96
            # A bad file: the old table stays, the failure is counted.
            keys_file.write_text('{"tenants": [{"id": "gamma", "keys": ["' + KEYS["new"] + '"]}]}')
            os.kill(mesh.router.pid, signal.SIGHUP)
            while counter(mesh, "llmesh:api_key_reloads_total", outcome="error") < 1:
                assert time.monotonic() < deadline + 20, "no reload failure counted"
                await asyncio.sleep(0.05)
            again = await run_one(stub, request(2, "g4"), metadata=auth("new"))
            assert again.code == grpc.StatusCode.OK

    asyncio.run(scenario())
    write_keys(keys_file, gamma_key=KEYS["new"])


#: A private memo (~150 tokens): its blocks fill the prefix cache of whoever sends it.
MEMO = ("Board memo, strictly confidential. The merger with Northwind closes on the third "
        "of March at a price of forty-one dollars a share; the press release stays embargoed "
        "until the regulator signs. Layoffs in the Lisbon office are planned for April and "
        "the staff will be told on the first Monday of that month. The new chief financial "
        "officer is Dana Whitlock, hired from Contoso, and her contract includes a signing "
        "bonus of two hundred thousand dollars. Do not forward this memo to anyone outside "
        "the board.")


def memo_prompt(tag: str, question: str) -> str:
    """A raw prompt (no chat template) that starts with ``tag``: no earlier
    request of any scope shares its first block."""
    return f"[{tag}] {MEMO} Question: {question} Answer:"


def greedy_prompt(text: str, *, max_tokens: int = 2, cache_salt: str | None = None,
                  speculative: bool = True) -> generation_pb2.GenerateRequest:
    """A greedy, cacheable raw-prompt request."""
    req = generation_pb2.GenerateRequest(
        prompt=text, bypass_cache=False,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                           ignore_eos=True))
    if cache_salt is not None:
        req.cache_salt = cache_salt
    if not speculative:
        req.speculative.method = common_pb2.SPECULATIVE_METHOD_NONE
    return req


def last_message(stub: generation_pb2_grpc.GenerationServiceStub, tenant: str,
                 req: generation_pb2.GenerateRequest) -> generation_pb2.GenerateResponse:
    """The last message of ``req`` sent with ``tenant``'s key."""
    *_, last = stub.Generate(req, timeout=120, metadata=auth(tenant))
    return last


def test_the_response_and_prefix_caches_are_scoped_by_tenant_over_grpc(mesh: Mesh) -> None:
    tag = uuid.uuid4().hex[:8]
    asked = memo_prompt(tag, "When does the merger close?")
    with grpc.insecure_channel(mesh.ingress_address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        first = last_message(stub, "beta", greedy_prompt(asked))
        assert not first.cached and first.usage.cached_prompt_tokens == 0
        # zeta sends beta's exact request: no stored answer, no cached block
        other = last_message(stub, "zeta", greedy_prompt(asked))
        assert not other.cached
        assert other.usage.cached_prompt_tokens == 0
        assert other.usage.prompt_tokens == first.usage.prompt_tokens > 100
        # beta repeating gets its own answer back, and its own prefix
        again = last_message(stub, "beta", greedy_prompt(asked))
        assert again.cached and again.usage.cached_prompt_tokens == again.usage.prompt_tokens
        follow_up = last_message(stub, "beta", greedy_prompt(
            memo_prompt(tag, "Who is the new chief financial officer?")))
        assert not follow_up.cached
        # the memo's full blocks: 112 tokens, or 96 when the random tag tokenizes so
        # that the shared part ends before the 7th block (7 of 300 tags; CI saw one)
        assert 96 <= follow_up.usage.cached_prompt_tokens < follow_up.usage.prompt_tokens
        # a cache_salt scopes further within the tenant (beta's entries stay beta's own)
        salted = last_message(stub, "beta", greedy_prompt(asked, cache_salt=f"salt-{tag}"))
        assert not salted.cached and salted.usage.cached_prompt_tokens == 0
        salted = last_message(stub, "beta", greedy_prompt(asked, cache_salt=f"salt-{tag}"))
        assert salted.cached
        # tenants of one cache group share: both caches answer acme-2 from acme-1's work
        shared = memo_prompt(f"{tag}-acme", "Where are the layoffs?")
        assert not last_message(stub, "acme1", greedy_prompt(shared)).cached
        hit = last_message(stub, "acme2", greedy_prompt(shared))
        assert hit.cached and hit.usage.cached_prompt_tokens == hit.usage.prompt_tokens
        prefix = last_message(stub, "acme2", greedy_prompt(
            memo_prompt(f"{tag}-acme", "How large is the signing bonus?")))
        assert not prefix.cached and prefix.usage.cached_prompt_tokens >= 96  # as above
        # the salt is checked at the edge, naming the field
        with pytest.raises(grpc.RpcError) as info:
            last_message(stub, "beta", greedy_prompt(asked, cache_salt=""))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("cache_salt")


def test_the_openai_endpoint_reports_no_cached_tokens_of_another_tenant(mesh: Mesh) -> None:
    tag = uuid.uuid4().hex[:8]
    asked = memo_prompt(tag, "How much is a share?")

    def complete(tenant: str, prompt: str, **extra: object) -> openai.types.Completion:
        with openai.OpenAI(base_url=f"{mesh.http_url}/v1", api_key=KEYS[tenant],
                           max_retries=0) as client:
            return client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt,
                                             max_tokens=2, temperature=0.0,
                                             extra_body=extra or None)

    def cached_tokens(completion: openai.types.Completion) -> int:
        assert completion.usage is not None and completion.usage.prompt_tokens_details
        return completion.usage.prompt_tokens_details.cached_tokens or 0

    assert cached_tokens(complete("beta", asked)) == 0
    assert cached_tokens(complete("zeta", asked)) == 0  # beta's answer and blocks stay beta's
    repeated = complete("beta", asked)
    assert repeated.usage is not None
    assert cached_tokens(repeated) == repeated.usage.prompt_tokens  # its own stored answer
    assert 100 <= cached_tokens(complete("beta", memo_prompt(tag, "Who is hired?")))
    assert cached_tokens(complete("beta", asked, cache_salt=f"s-{tag}")) == 0
    shared = memo_prompt(f"{tag}-acme", "When are the staff told?")
    complete("acme1", shared)
    grouped = complete("acme2", shared)
    assert grouped.usage is not None and cached_tokens(grouped) == grouped.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as info:
        complete("beta", asked, cache_salt="x" * 257)
    assert info.value.body["param"] == "cache_salt"  # type: ignore[index]


def test_identical_requests_of_two_tenants_are_not_coalesced(mesh: Mesh) -> None:
    async def pair(first: str, second: str, text: str) -> list[Outcome]:
        async with grpc.aio.insecure_channel(mesh.ingress_address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            req = greedy_prompt(text, max_tokens=24, speculative=False)
            return list(await asyncio.gather(run_one(stub, req, metadata=auth(first)),
                                             run_one(stub, req, metadata=auth(second))))

    def coalesced() -> float:
        return counter(mesh, "llmesh:router_coalesced_requests_total")

    tag = uuid.uuid4().hex[:8]
    before = coalesced()
    outcomes = asyncio.run(pair("beta", "zeta", f"[{tag}] Count slowly from one to fifty:"))
    assert [o.code for o in outcomes] == [grpc.StatusCode.OK] * 2
    assert outcomes[0].token_ids == outcomes[1].token_ids  # the same answer, computed twice
    assert coalesced() == before, "zeta's request joined beta's generation"
    # the same tenant twice, and two tenants of one cache group, do share one generation
    for first, second, suffix in [("beta", "beta", "b"), ("acme1", "acme2", "g")]:
        before = coalesced()
        outcomes = asyncio.run(pair(first, second, f"[{tag}{suffix}] Count from one to fifty:"))
        assert [o.code for o in outcomes] == [grpc.StatusCode.OK] * 2
        assert coalesced() == before + 1, (first, second)


def test_no_key_no_key_hash_and_no_prompt_text_in_any_log_or_metrics_page(mesh: Mesh) -> None:
    pages = {name: metrics_text(service.metrics_address)
             for name, service in mesh.services.items()}
    pages["envoy"] = urllib.request.urlopen(f"{mesh.admin_url}/stats/prometheus",
                                            timeout=5).read().decode()
    files = {str(p): p.read_bytes().decode(errors="replace")
             for p in Path(mesh.run_dir).rglob("*") if p.is_file()}
    assert any("router" in name for name in files)
    assert 'tenant="alpha"' in pages["router"]
    # A key's SHA-256 names the key as well as the key does (docs/api-keys.md):
    # its hex digest (with or without the file's "sha256:" prefix) is a secret
    # too, for the keys in the file and for the wrong one the router looked up.
    keys = [*KEYS.values(), WRONG_KEY]
    secrets = [*keys, *(hash_key(k).removeprefix("sha256:") for k in keys), SECRET_PROMPT]
    for where, text in {**pages, **files}.items():
        for secret in secrets:
            assert secret not in text, f"{secret[:8]}... appears in {where}"
    router_log = "\n".join(text for name, text in files.items() if "router" in Path(name).name)
    assert re.search(r'"tenant":\s*"alpha"', router_log), "log lines carry the tenant id"
