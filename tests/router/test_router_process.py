"""The router as a real process (``python -m services.router``) in front of the
in-process fakes (served from a thread of the test process): how it drains
and how it starts.

* SIGTERM ends an idle ``GenerateStream`` session at once (UNAVAILABLE, the
  drain message), lets a session with a running generation get its whole
  output, then ends it the same way; the router exits long before
  ``--drain-seconds``;
* a second SIGTERM during the drain stops at once (``drain_forced``);
* with only ``dns:///`` engines and no address for the name, the router
  serves (health SERVING), answers UNAVAILABLE ("none is known"), and routes
  to an engine once the name resolves to it;
* a failed start is one ``start_failed`` line and exit status 1.

Timing margins are generous (2 shared CPUs): a router starts in ~2-5 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmesh.v1 import (
    common_pb2,
    engine_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
    tokenizer_pb2_grpc,
)
from services.cli.mesh import REPO_ROOT, child_env, log_tail

from tests.router.dns_stub import DnsStub
from tests.router.router_fakes import FakeEngine, FakeTokenizer, serve

NAME = "engines.llmesh.test"
REPLY = "The quick brown fox jumps over the lazy dog."


class Upstreams:
    """A fake tokenizer and engine on an event loop in a thread of this process."""

    def __init__(self) -> None:
        self.engine = FakeEngine(REPLY, max_model_len=512)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self._servers: list[grpc.aio.Server] = []
        self.tokenizer_target = self._serve(
            tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server, FakeTokenizer())
        self.engine_target = self._serve(
            engine_pb2_grpc.add_EngineServiceServicer_to_server, self.engine)

    def _serve(self, add, servicer) -> str:  # noqa: ANN001
        server, target = asyncio.run_coroutine_threadsafe(serve(add, servicer),
                                                          self.loop).result(30)
        self._servers.append(server)
        return target

    def close(self) -> None:
        async def stop() -> None:
            await asyncio.gather(*(server.stop(None) for server in self._servers))
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@pytest.fixture()
def upstreams() -> Iterator[Upstreams]:
    fakes = Upstreams()
    yield fakes
    fakes.close()


class Router:
    """``python -m services.router`` with its log in ``log_path``."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        self.port_file = tmp_path / "router.json"
        self.log_path = tmp_path / "router.log"
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "services.router", "--port", "0", "--metrics-port", "-1",
             "--port-file", str(self.port_file), *args],
            cwd=REPO_ROOT, env=child_env(), stdout=self._log, stderr=subprocess.STDOUT)
        self.address = ""

    def wait_bound(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.port_file.exists() or not self.port_file.read_text():
            assert self.process.poll() is None, log_tail(self.log_path)
            assert time.monotonic() < deadline, "no port file"
            time.sleep(0.05)
        self.address = f"127.0.0.1:{json.loads(self.port_file.read_text())['grpc_port']}"

    def health(self) -> int | None:
        with grpc.insecure_channel(self.address) as channel:
            try:
                return health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=2).status
            except grpc.RpcError:
                return None

    def wait_serving(self, timeout: float = 60.0) -> None:
        self.wait_bound(timeout)
        deadline = time.monotonic() + timeout
        while self.health() != health_pb2.HealthCheckResponse.SERVING:
            assert self.process.poll() is None, log_tail(self.log_path)
            assert time.monotonic() < deadline, "not SERVING"
            time.sleep(0.1)

    def log_events(self) -> list[str]:
        events = []
        for line in self.log_path.read_text().splitlines():
            try:
                events.append(json.loads(line).get("event", ""))
            except ValueError:
                events.append(line)
        return events

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self._log.close()


def start_request(prompt: str, max_tokens: int = 200) -> generation_pb2.GenerateStreamRequest:
    return generation_pb2.GenerateStreamRequest(start=generation_pb2.GenerateRequest(
        prompt=prompt, bypass_cache=True,
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens)))


class Session:
    """A ``GenerateStream`` call read in a thread: ``send`` writes a message,
    ``responses`` collects what came, ``status`` is its end (None: open)."""

    def __init__(self, address: str) -> None:
        self._channel = grpc.insecure_channel(address)
        self._outbox: queue.Queue[generation_pb2.GenerateStreamRequest | None] = queue.Queue()
        self.responses: list[generation_pb2.GenerateResponse] = []
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.ended_at: float | None = None
        self._call = generation_pb2_grpc.GenerationServiceStub(self._channel).GenerateStream(
            iter(self._outbox.get, None), timeout=300)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for message in self._call:
                self.responses.append(message.response)
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as err:
            self.code, self.details = err.code(), err.details()
        self.ended_at = time.monotonic()

    def send(self, message: generation_pb2.GenerateStreamRequest) -> None:
        self._outbox.put(message)

    def text(self) -> str:
        return "".join(r.text for r in self.responses)

    def finished(self) -> bool:
        return any(r.finish_reason for r in self.responses)

    def wait_ended(self, timeout: float) -> None:
        self._thread.join(timeout)
        assert self.code is not None, f"the stream did not end within {timeout:g} s"

    def close(self) -> None:
        self._outbox.put(None)
        self._call.cancel()
        self._channel.close()


def wait_for(condition, timeout: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} not within {timeout:g} s"
        time.sleep(0.02)


def test_drain_ends_idle_sessions_at_once_and_busy_ones_after_their_generation(
        tmp_path: Path, upstreams: Upstreams) -> None:
    upstreams.engine.step_delay = 0.1  # the reply takes ~4.5 s
    router = Router(tmp_path, "--tokenizer", upstreams.tokenizer_target,
                    "--engine", upstreams.engine_target, "--drain-seconds", "60")
    idle = busy = None
    try:
        router.wait_serving()
        idle, busy = Session(router.address), Session(router.address)
        busy.send(start_request("tell me"))
        wait_for(lambda: busy.responses, 30, "the first delta")
        signalled = time.monotonic()
        router.process.send_signal(signal.SIGTERM)

        idle.wait_ended(10)
        assert idle.code == grpc.StatusCode.UNAVAILABLE
        assert "draining" in idle.details and "reconnect" in idle.details
        assert idle.ended_at is not None and idle.ended_at - signalled < 5
        # The running generation finishes whole, then the session ends UNAVAILABLE.
        busy.wait_ended(30)
        assert busy.text() == REPLY and busy.finished()
        assert busy.code == grpc.StatusCode.UNAVAILABLE and "draining" in busy.details
        assert router.process.wait(30) == 0
        assert time.monotonic() - signalled < 30  # far from --drain-seconds 60
        assert "drained" in router.log_events()
    finally:
        for session in (idle, busy):
            if session is not None:
                session.close()
        router.close()


@contextlib.contextmanager
def draining_router(tmp_path: Path, upstreams: Upstreams, step_delay: float,
                    drain_s: float) -> Iterator[tuple[Router, Session]]:
    """A router draining (SIGTERM sent, ``draining`` logged) while a session's
    generation runs on it (the fake engine's ``step_delay`` per character)."""
    upstreams.engine.step_delay = step_delay
    router = Router(tmp_path, "--tokenizer", upstreams.tokenizer_target,
                    "--engine", upstreams.engine_target, "--drain-seconds", f"{drain_s:g}")
    busy = None
    try:
        router.wait_serving()
        busy = Session(router.address)
        busy.send(start_request("tell me"))
        wait_for(lambda: busy.responses, 30, "the first delta")
        router.process.send_signal(signal.SIGTERM)
        wait_for(lambda: "draining" in router.log_events(), 10, "the drain")
        yield router, busy
    finally:
        if busy is not None:
            busy.close()
        router.close()


def test_a_new_session_during_the_drain_is_refused(tmp_path: Path,
                                                   upstreams: Upstreams) -> None:
    # The reply takes ~9 s: the drain lasts that long.
    with draining_router(tmp_path, upstreams, 0.2, 60) as (router, busy):
        late = Session(router.address)
        try:
            late.send(start_request("and me"))
            late.wait_ended(10)
            assert late.code == grpc.StatusCode.UNAVAILABLE and not late.responses
        finally:
            late.close()
        busy.wait_ended(30)
        assert busy.text() == REPLY
        assert router.process.wait(30) == 0


def test_a_second_sigterm_stops_the_drain_at_once(tmp_path: Path,
                                                   upstreams: Upstreams) -> None:
    # ~90 s of output: it outlives the test.
    with draining_router(tmp_path, upstreams, 2.0, 120) as (router, busy):
        time.sleep(1.0)
        assert router.process.poll() is None  # the generation holds the drain
        forced = time.monotonic()
        router.process.send_signal(signal.SIGTERM)
        router.process.wait(15)
        assert time.monotonic() - forced < 10
        busy.wait_ended(10)
        assert busy.code != grpc.StatusCode.OK
        assert "drain_forced" in router.log_events()


def test_dns_engines_that_are_not_up_yet_do_not_fail_the_start(
        tmp_path: Path, upstreams: Upstreams) -> None:
    dns = DnsStub()  # no record for NAME yet: NXDOMAIN
    port = upstreams.engine_target.rsplit(":", 1)[1]
    router = Router(tmp_path, "--tokenizer", upstreams.tokenizer_target,
                    "--engine", f"dns:///{NAME}:{port}", "--dns-nameserver", dns.address,
                    "--engine-resolve-interval", "0.2", "--startup-timeout", "5")
    try:
        router.wait_serving()
        assert "no_engine_known" in router.log_events()
        request = generation_pb2.GenerateRequest(prompt="hi", bypass_cache=True)
        with grpc.insecure_channel(router.address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Generate(request, timeout=10))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "no engine replica is serving (none is known" in refused.value.details()
            time.sleep(6)  # past --startup-timeout: still serving
            assert router.process.poll() is None
            dns.records[NAME] = ["127.0.0.1"]

            def answers() -> bool:
                try:
                    return "".join(r.text for r in stub.Generate(request, timeout=10)) == REPLY
                except grpc.RpcError as err:
                    assert err.code() == grpc.StatusCode.UNAVAILABLE, err
                    return False
            wait_for(answers, 30, "a routed request")
            models = stub.ListModels(generation_pb2.ListModelsRequest(), timeout=10)
            assert [m.id for m in models.models] == ["fake-model"]
    finally:
        router.close()
        dns.stop()


def test_a_failed_start_is_one_line_and_exit_status_1(tmp_path: Path,
                                                      upstreams: Upstreams) -> None:
    router = Router(tmp_path, "--tokenizer", upstreams.tokenizer_target,
                    "--engine", "127.0.0.1:1", "--startup-timeout", "2")
    try:
        assert router.process.wait(60) == 1
        text = router.log_path.read_text()
        assert "Traceback" not in text, text
        failed = [json.loads(line) for line in text.splitlines() if "start_failed" in line]
        assert len(failed) == 1 and "127.0.0.1:1" in failed[0]["error"], text
    finally:
        router.close()
