"""API keys and tenant limits in the router over real gRPC and its HTTP server,
against the in-process fake tokenizer / engine / cache (no model): statuses
on both edges, reservations settled however a request ends, a stream's
tenant, and a reload. The real mesh through Envoy:
tests/e2e/test_mesh_tenants.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import aiohttp
import grpc
import openai
import pytest
import structlog.testing
from prometheus_client import CollectorRegistry

from llmesh.v1 import cache_pb2, common_pb2, generation_pb2
from services.router.api_keys import hash_key
from services.router.metrics import RouterMetrics
from services.router.tenancy import Tenancy
from tests.router.test_router_service import (
    REPLY,
    collect,
    greedy,
    make_mesh,
    read_generation,
    start,
    text_of,
    wait_for,
)

KEYS = {"alpha": "lmk_alpha-key", "beta": "lmk_beta-key", "narrow": "lmk_narrow-key",
        "org1": "lmk_org1-key", "org2": "lmk_org2-key"}


def write_keys(path: Path, alpha_limits: dict[str, int]) -> None:
    path.write_text(json.dumps({"tenants": [
        {"id": "alpha", "keys": [hash_key(KEYS["alpha"])], "limits": alpha_limits},
        {"id": "beta", "keys": [hash_key(KEYS["beta"])]},
        {"id": "narrow", "keys": [hash_key(KEYS["narrow"])], "models": ["other"]},
        {"id": "org1", "keys": [hash_key(KEYS["org1"])], "cache_group": "org"},
        {"id": "org2", "keys": [hash_key(KEYS["org2"])], "cache_group": "org"},
    ]}))


@contextlib.asynccontextmanager
async def served(tmp_path: Path, mesh_config: dict | None = None, **alpha_limits: int):
    """The fake mesh with keys on and the HTTP server; yields (mesh, base url).
    ``mesh_config``: more :func:`make_mesh` arguments."""
    keys = tmp_path / "keys.json"
    write_keys(keys, alpha_limits)
    async with make_mesh(openai_port=0, api_keys=str(keys), **(mesh_config or {})) as mesh:
        ports = await mesh.router.listen_extra("127.0.0.1")
        yield mesh, f"http://127.0.0.1:{ports['openai_port']}"


def auth(tenant: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {KEYS[tenant]}"),)


async def test_the_openai_client_gets_401_403_and_only_its_models(tmp_path: Path) -> None:
    async with served(tmp_path) as (_, base):
        for key, error in [("lmk_wrong", openai.AuthenticationError),
                           (KEYS["narrow"], openai.PermissionDeniedError)]:
            async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=key,
                                          max_retries=0) as client:
                with pytest.raises(error) as info:
                    await client.chat.completions.create(
                        model="fake-model", messages=[{"role": "user", "content": "hi"}])
            assert info.value.body["type"] == "invalid_request_error"  # type: ignore[index]
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=KEYS["narrow"],
                                      max_retries=0) as client:
            assert (await client.models.list()).data == []
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=KEYS["alpha"],
                                      max_retries=0) as client:
            assert [m.id for m in (await client.models.list()).data] == ["fake-model"]
            chat = await client.chat.completions.create(
                model="fake-model", messages=[{"role": "user", "content": "hi"}])
            assert chat.choices[0].message.content == REPLY
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{base}/v1/models") as reply:
                body = await reply.json()
                assert reply.status == 401 and body["error"]["code"] == "missing_api_key"


async def test_max_concurrent_refuses_on_both_edges_while_another_tenant_runs(
        tmp_path: Path) -> None:
    async with served(tmp_path, max_concurrent=1) as (mesh, base):
        mesh.engines[0].step_delay = 0.03
        running = mesh.stub.Generate(generation_pb2.GenerateRequest(prompt="a"),
                                     metadata=auth("alpha"))
        assert (await running.read()).token_ids
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(prompt="b"),
                                             metadata=auth("alpha")))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert info.value.details().startswith(
            "tenant 'alpha' has 1 requests in flight, its max_concurrent limit is 1")
        assert int(dict(info.value.trailing_metadata())["retry-after-ms"]) >= 1
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{base}/v1/completions", json={"prompt": "c"},
                                    headers={"x-api-key": KEYS["alpha"]}) as reply:
                assert reply.status == 429 and int(reply.headers["Retry-After"]) >= 1
        other = await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(prompt="d"),
                                                 metadata=auth("beta")))
        assert other[-1].finish_reason
        while await running.read() is not grpc.aio.EOF:
            pass
        assert mesh.metric("llmesh:tenant_limited_total", tenant="alpha",
                           limit="max_concurrent") == 2


async def test_each_tenant_has_its_own_cache_scope_and_a_cache_group_shares_one(
        tmp_path: Path) -> None:
    async with served(tmp_path) as (mesh, _):
        starts = mesh.engines[0].log.starts

        async def ask(tenant: str, salt: str | None = None,
                      metadata: tuple[tuple[str, str], ...] = ()) -> bool:
            """Whether the answer came from the response cache."""
            req = generation_pb2.GenerateRequest(prompt="private memo", sampling=greedy())
            if salt is not None:
                req.cache_salt = salt
            done = await collect(mesh.stub.Generate(req, metadata=(*auth(tenant), *metadata)))
            return done[-1].cached

        assert not await ask("alpha")
        alpha_scope = starts[-1].cache_scope
        assert len(alpha_scope) == 64
        # beta (even claiming to be alpha: the key decides) misses alpha's entry
        assert not await ask("beta", metadata=(("x-tenant-id", "alpha"),))
        assert len(starts) == 2 and starts[-1].cache_scope not in ("", alpha_scope)
        assert await ask("alpha") and len(starts) == 2
        # a cache_salt scopes further: a miss, then its own hit
        assert not await ask("alpha", salt="s1")
        assert starts[-1].cache_scope not in ("", alpha_scope)
        assert await ask("alpha", salt="s1")
        # one group, one scope
        assert not await ask("org1")
        assert await ask("org2")
        keys = [cache_pb2.CacheKey.FromString(key) for key in mesh.cache.store]
        assert len({key.cache_scope for key in keys}) == len(keys) == 4


async def test_identical_requests_coalesce_only_within_a_cache_scope(tmp_path: Path) -> None:
    async with served(tmp_path) as (mesh, _):
        mesh.engines[0].step_delay = 0.02  # both requests arrive while the first runs
        starts = mesh.engines[0].log.starts
        for number, (first, second, computed) in enumerate(
                [("alpha", "beta", 2), ("org1", "org2", 1), ("beta", "beta", 1)]):
            before = len(starts)
            req = generation_pb2.GenerateRequest(prompt=f"memo {number}", sampling=greedy())
            await asyncio.gather(*(collect(mesh.stub.Generate(req, metadata=auth(tenant)))
                                   for tenant in (first, second)))
            assert len(starts) - before == computed, (first, second)


async def test_without_keys_x_tenant_id_scopes_the_caches(tmp_path: Path) -> None:
    async with make_mesh() as mesh:
        starts = mesh.engines[0].log.starts
        for tenant in ("t1", "t2", None, "t1"):
            metadata = () if tenant is None else (("x-tenant-id", tenant),)
            await collect(mesh.stub.Generate(
                generation_pb2.GenerateRequest(prompt="memo", sampling=greedy()),
                metadata=metadata or None))
        # t1, t2 and no tenant (the shared scope, "") each computed; t1's repeat hit
        assert len(starts) == 3
        assert starts[2].cache_scope == "" and starts[0].cache_scope != starts[1].cache_scope


async def test_reservations_settle_however_the_request_ends(tmp_path: Path) -> None:
    async with served(tmp_path, tokens_per_minute=10_000) as (mesh, _):
        limiter = mesh.router.tenancy.limiter
        mesh.engines[0].step_delay = 0.02
        done = await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(
            prompt="q", sampling=greedy(max_tokens=100)), metadata=auth("alpha")))
        usage = done[-1].usage
        assert limiter.usage("alpha").tokens_in_window == (usage.prompt_tokens
                                                           + usage.completion_tokens)
        billed = limiter.usage("alpha").tokens_in_window
        cancelled = mesh.stub.Generate(generation_pb2.GenerateRequest(
            prompt="r", sampling=greedy(max_tokens=200, ignore_eos=True)), metadata=auth("alpha"))
        await cancelled.read()
        assert limiter.usage("alpha").reserved_tokens > 200
        cancelled.cancel()
        await wait_for(lambda: limiter.usage("alpha").in_flight == 0)
        assert limiter.usage("alpha").reserved_tokens == 0
        assert billed < limiter.usage("alpha").tokens_in_window < billed + 100
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(
                prompt="s", sampling=greedy(max_tokens=200, ignore_eos=True)),
                metadata=auth("alpha"), timeout=0.3))
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await wait_for(lambda: limiter.usage("alpha").in_flight == 0)
        assert limiter.usage("alpha").reserved_tokens == 0
        assert mesh.metric("llmesh:tenant_tokens_total", tenant="alpha", kind="prompt") > 0


async def test_a_stream_authenticates_once_and_its_turns_are_its_tenants(
        tmp_path: Path) -> None:
    async with served(tmp_path) as (mesh, _):
        call = mesh.stub.GenerateStream()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            # The router may refuse the call before the first message is
            # written: then the write raises the status (CI, stop 43).
            await call.write(start("one"))
            await call.read()
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        call = mesh.stub.GenerateStream(metadata=(*auth("beta"), ("x-tenant-id", "alpha")))
        for prompt in ("one", "two"):
            await call.write(start(prompt, sampling=greedy(max_tokens=2)))
            await read_generation(call)
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK
        assert mesh.metric("llmesh:tenant_requests_total", tenant="beta", outcome="length") == 2
        assert mesh.metric("llmesh:auth_failures_total", reason="missing_key") == 1


async def test_a_bad_reload_keeps_the_old_keys(tmp_path: Path) -> None:
    async with served(tmp_path) as (mesh, _):
        (tmp_path / "keys.json").write_text('{"tenants": [{"id": "x", "keys": ["lmk_raw"]}]}')
        assert not mesh.router.tenancy.reload()
        assert mesh.metric("llmesh:api_key_reloads_total", outcome="error") == 1
        assert (await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(prompt="q"),
                                                 metadata=auth("alpha"))))[-1].finish_reason
        write_keys(tmp_path / "keys.json", {})
        (tmp_path / "keys.json").write_text((tmp_path / "keys.json").read_text().replace(
            hash_key(KEYS["alpha"]), hash_key("lmk_rotated")))
        assert mesh.router.tenancy.reload()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(prompt="q"),
                                             metadata=auth("alpha")))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert (await collect(mesh.stub.Generate(
            generation_pb2.GenerateRequest(prompt="q"),
            metadata=(("x-api-key", "lmk_rotated"),))))[-1].finish_reason


async def test_another_authorization_scheme_is_named_without_echoing_the_header(
        tmp_path: Path) -> None:
    async with served(tmp_path) as (mesh, _):
        for value, says in [("Basic Zm9vOmJhcg==", "is not 'Bearer <key>'"),
                            (KEYS["alpha"], "is not 'Bearer <key>'"),  # a bare key
                            ("Bearer ", "Bearer token is empty"),
                            ("bearer", "Bearer token is empty")]:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(mesh.stub.Generate(generation_pb2.GenerateRequest(prompt="q"),
                                                 metadata=(("authorization", value),)))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert says in info.value.details()
            assert KEYS["alpha"] not in info.value.details() and "Zm9v" not in info.value.details()
        assert mesh.metric("llmesh:auth_failures_total", reason="missing_key") == 4


async def test_a_key_file_that_lets_no_one_in_is_loaded_with_a_warning(tmp_path: Path) -> None:
    async with served(tmp_path) as (mesh, _):
        (tmp_path / "keys.json").write_text(json.dumps({"tenants": [
            {"id": "acme", "keys": []},
            {"id": "beta", "keys": [hash_key(KEYS["beta"])]}]}))
        with structlog.testing.capture_logs() as logs:
            assert mesh.router.tenancy.reload()
        assert {"event": "api_keys_tenants_without_keys", "tenants": ["acme"],
                "effect": "no call can act as these tenants",
                "log_level": "warning"} in logs
        (tmp_path / "keys.json").write_text(json.dumps({"tenants": [{"id": "acme", "keys": []}]}))
        with structlog.testing.capture_logs() as logs:
            assert mesh.router.tenancy.reload()
        events = {entry["event"]: entry for entry in logs}
        assert events["api_keys_none"]["log_level"] == "warning"
        assert "UNAUTHENTICATED" in events["api_keys_none"]["effect"]


async def test_the_start_warns_of_tenants_no_key_reaches_once_logging_is_set_up(
        tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"tenants": [{"id": "ghost", "keys": []},
                                            {"id": "beta", "keys": [hash_key(KEYS["beta"])]}]}))
    with structlog.testing.capture_logs() as logs:
        Tenancy(keys, RouterMetrics(CollectorRegistry()))
    assert logs == []
    with structlog.testing.capture_logs() as logs:
        async with make_mesh(api_keys=str(keys)) as mesh:
            # Not from the constructor (before the service kit configures
            # JSON logging): from start(), exactly once.
            warned = [e for e in logs if e["event"] == "api_keys_tenants_without_keys"]
            assert [e["tenants"] for e in warned] == [["ghost"]]
            assert mesh.router.tenancy.enabled
            assert not [e for e in logs if e["event"] == "api_keys_unknown_models"]
            # A tenant listing a model the mesh does not serve: said at reload.
            keys.write_text(json.dumps({"tenants": [
                {"id": "beta", "keys": [hash_key(KEYS["beta"])],
                 "models": ["fake-model", "gpt-9", "*"]},
                {"id": "narrow", "keys": [hash_key(KEYS["narrow"])], "models": ["other"]}]}))
            assert mesh.router.tenancy.reload()
            unknown = [e for e in logs if e["event"] == "api_keys_unknown_models"]
            assert [(e["tenants"], e["served"]) for e in unknown] == [
                ({"beta": ["gpt-9"], "narrow": ["other"]}, ["fake-model"])]


async def test_a_history_summary_runs_as_its_tenant_once_it_is_under_its_limit(
        tmp_path: Path) -> None:
    """Issue 34: the summary the router writes for a tenant's chat is that
    tenant's work: it waits while the tenant is at ``max_concurrent`` (here
    held by the very turn that called for it), then runs under its limits and
    is counted in its metrics. Before, it started at once, uncounted."""
    from services.cache.metrics import CacheMetrics
    from services.cache.service import CacheService
    from services.cache.store import MemoryStore
    from services.router.history.settings import HistorySettings

    cache = CacheService(MemoryStore(), metrics=CacheMetrics.create(CollectorRegistry()))
    config = dict(cache_servicer=cache, max_model_len=4096,
                  history=HistorySettings(budgets={"": 160}, summary_max_tokens=16))
    async with served(tmp_path, config, max_concurrent=1) as (mesh, _):
        engine = mesh.engines[0]
        engine.step_delay = 0.02

        def summaries() -> int:
            return sum(s.request_id.endswith(".history") for s in engine.log.starts)

        messages = [common_pb2.ChatMessage(role="system", content="Be brief.")]
        for number in range(2):  # the second turn passes the budget's high-water mark
            messages.append(common_pb2.ChatMessage(role="user", content=f"{number}" * 40))
            call = mesh.stub.Generate(generation_pb2.GenerateRequest(
                chat=generation_pb2.Chat(messages=messages),
                sampling=greedy(max_tokens=30, ignore_eos=True)), metadata=auth("alpha"))
            responses = []
            async for response in call:
                if not response.finish_reason and len(responses) == 20:
                    assert summaries() == 0  # the turn holds alpha's only slot
                responses.append(response)
            messages.append(common_pb2.ChatMessage(role="assistant",
                                                   content=text_of(responses)))
        engine.step_delay = 0.05  # the summary's 16 steps take ~0.8 s
        await wait_for(lambda: summaries() == 1, timeout=5)
        # The running summary holds no slot: the tenant's next turn is served
        # (it was refused: "1 requests in flight, its max_concurrent limit is 1").
        messages.append(common_pb2.ChatMessage(role="user", content="next"))
        turn = [r async for r in mesh.stub.Generate(generation_pb2.GenerateRequest(
            chat=generation_pb2.Chat(messages=messages),
            sampling=greedy(max_tokens=2, ignore_eos=True)), metadata=auth("alpha"))]
        assert turn[-1].finish_reason
        await wait_for(lambda: mesh.metric("llmesh:history_compactions_total",
                                           model_name="fake-model", outcome="stored") == 1,
                       timeout=5)
        assert sum(mesh.metric("llmesh:tenant_requests_total", tenant="alpha", outcome=o)
                   for o in ("stop", "length")) == 4  # three turns and the summary
        assert mesh.router.tenancy.limiter.usage("alpha").in_flight == 0
