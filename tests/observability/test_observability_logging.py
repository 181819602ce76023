"""structlog JSON logging of the server kit, and the request id at one hop.

The logging configuration is process-wide, so it is exercised in a child
process; the cache hop is served in-process with its log events captured.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import structlog
from prometheus_client import CollectorRegistry

from llmesh.v1 import cache_pb2
from services.cache.metrics import CacheMetrics
from services.cache.service import CacheService
from services.cache.store import MemoryStore
from services.common.grpc_util import (
    call_headers,
    request_id_from,
    request_id_metadata,
    request_id_of,
)
from services.common.logging import REQUEST_ID_METADATA_KEY
from tests.cache.helpers import make_key, make_response, serve

CHILD = textwrap.dedent('''
    import logging, threading, warnings
    import structlog
    from services.common.logging import bind_request_id, configure_logging

    log = configure_logging("svc", "info")
    bind_request_id("rid-1")
    log.info("hello", n=1)
    log.debug("hidden_debug")
    logging.getLogger("somelib").warning("lib says %s", "hi")
    logging.getLogger("somelib").info("hidden_info")
    warnings.warn("careful")
    worker = threading.Thread(target=lambda: structlog.get_logger().info("from_thread"))
    worker.start(); worker.join()
    def boom():
        raise RuntimeError("thread failed")
    crasher = threading.Thread(target=boom, name="crasher")
    crasher.start(); crasher.join()
    raise ValueError("main failed")
''')


def _child_lines() -> tuple[list[dict], str]:
    result = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                            timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 1, result.stderr  # the uncaught ValueError
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    return [json.loads(line) for line in lines], result.stderr  # every line is JSON


def test_every_line_is_json_with_service_level_and_time() -> None:
    records, stderr = _child_lines()
    events = [r["event"] for r in records]
    assert events == ["hello", "lib says hi", records[2]["event"], "from_thread",
                      "uncaught_exception", "uncaught_exception"], stderr
    assert "careful" in records[2]["event"] and records[2]["logger"] == "py.warnings"
    for record in records:
        assert record["service"] == "svc"
        assert record["level"] in ("info", "warning", "critical")
        assert record["timestamp"].endswith("Z")


def test_request_id_and_foreign_loggers() -> None:
    records, _ = _child_lines()
    by_event = {r["event"]: r for r in records}
    assert by_event["hello"]["request_id"] == "rid-1" and by_event["hello"]["n"] == 1
    assert by_event["lib says hi"]["logger"] == "somelib"
    assert by_event["lib says hi"]["request_id"] == "rid-1"  # same task context
    assert "request_id" not in by_event["from_thread"]  # a thread has its own context
    crashes = [r for r in records if r["event"] == "uncaught_exception"]
    assert crashes[0]["thread"] == "crasher" and "RuntimeError: thread failed" in crashes[0][
        "exception"]
    assert "ValueError: main failed" in crashes[1]["exception"]


class _Context:
    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata


def test_request_id_from_metadata_or_new() -> None:
    assert request_id_metadata("abc") == ((REQUEST_ID_METADATA_KEY, "abc"),)
    assert request_id_from(_Context((("x-request-id", "abc"),))) == "abc"  # type: ignore[arg-type]
    given = request_id_from(_Context((("x-request-id", "abc"),)), "given")  # type: ignore[arg-type]
    assert given == "given"
    made = request_id_from(_Context(()))  # type: ignore[arg-type]
    assert len(made) == 32 and made != request_id_from(_Context(()))  # type: ignore[arg-type]
    # the same rules over metadata read once (call_headers), as the router reads it
    assert request_id_of({"x-request-id": "abc"}) == "abc"
    assert request_id_of({"x-request-id": "abc"}, "given") == "given"
    assert len(request_id_of({"x-request-id": ""})) == 32


def test_call_headers_keep_each_keys_first_value() -> None:
    context = _Context((("x-tenant-id", "a"), ("traceparent", "t"), ("x-tenant-id", "b"),
                        ("x-trace-bin", b"\x01")))  # type: ignore[arg-type]
    assert call_headers(context) == {  # type: ignore[arg-type]
        "x-tenant-id": "a", "traceparent": "t", "x-trace-bin": "b'\\x01'"}
    assert call_headers(_Context(())) == {}  # type: ignore[arg-type]


async def test_cache_binds_the_request_id_of_the_metadata() -> None:
    service = CacheService(MemoryStore(), metrics=CacheMetrics.create(CollectorRegistry()))
    with structlog.testing.capture_logs(
            processors=[structlog.contextvars.merge_contextvars]) as logs:
        async with serve(service) as stub:
            metadata = request_id_metadata("cache-rid")
            await stub.PutCachedResponse(cache_pb2.PutCachedResponseRequest(
                key=make_key(), response=make_response()), metadata=metadata)
            reply = await stub.GetCachedResponse(cache_pb2.GetCachedResponseRequest(
                key=make_key()), metadata=metadata)
            assert reply.found
            await stub.GetCachedResponse(cache_pb2.GetCachedResponseRequest(key=make_key()),
                                         metadata=request_id_metadata("other-rid"))
    per_request = [(e["event"], e.get("request_id")) for e in logs
                   if e["event"] in ("cache_put", "cache_hit")]
    assert per_request == [("cache_put", "cache-rid"), ("cache_hit", "cache-rid"),
                           ("cache_hit", "other-rid")]
    assert all("hi there" not in json.dumps(e, default=str) for e in logs)  # no text


async def test_cache_binds_each_batched_stores_request_id() -> None:
    service = CacheService(MemoryStore(), metrics=CacheMetrics.create(CollectorRegistry()))
    with structlog.testing.capture_logs(
            processors=[structlog.contextvars.merge_contextvars]) as logs:
        async with serve(service) as stub:
            call = stub.PutCachedResponses()
            await call.write(cache_pb2.PutCachedResponsesRequest(stores=[
                cache_pb2.CachedResponseStore(store_id=i, request_id=rid, put=(
                    cache_pb2.PutCachedResponseRequest(key=make_key((i,)),
                                                       response=make_response())))
                for i, rid in ((1, "first-rid"), (2, "second-rid"), (3, "x" * 500))]))
            await call.read()
            call.cancel()
    assert [e.get("request_id") for e in logs if e["event"] == "cache_put"] == [
        "first-rid", "second-rid", "x" * 128]  # a caller's overlong id is cut



async def test_cache_binds_each_batched_lookups_request_id() -> None:
    service = CacheService(MemoryStore(), metrics=CacheMetrics.create(CollectorRegistry()))
    async with serve(service) as stub:
        await stub.PutCachedResponse(cache_pb2.PutCachedResponseRequest(
            key=make_key(), response=make_response()))
        with structlog.testing.capture_logs(
                processors=[structlog.contextvars.merge_contextvars]) as logs:
            call = stub.GetCachedResponses()
            await call.write(cache_pb2.GetCachedResponsesRequest(lookups=[
                cache_pb2.CachedResponseLookup(lookup_id=i, request_id=rid, key=make_key())
                for i, rid in ((1, "first-rid"), (2, "x" * 500))]))
            answered = 0
            while answered < 2:
                answered += len((await call.read()).results)
            call.cancel()
    assert sorted(e.get("request_id") for e in logs if e["event"] == "cache_hit") == [
        "first-rid", "x" * 128]  # a caller's overlong id is cut
