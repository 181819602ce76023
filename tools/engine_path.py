"""Measures, at run time, what a token goes through on its way from the
engine core to the client (issue 32's counts, from a run rather than a
reading): inside the engine up to the ``Multiplex`` wire, then inside the
router up to the client's ``GenerateResponse``.

One in-process engine (the torch backend over a tiny random Llama, so no
model file is read) serves a real ``Multiplex`` call on a loopback gRPC port:

* **forms**: one request with ``max_tokens=1``; a profile hook on every
  thread records each value handed to a Python function as an argument,
  built (an ``__init__`` returning) or returned by one, whose ``token_ids``
  is exactly the generated token, and the forms are the distinct types in
  order of first appearance (merging two values of one type is not a new
  form; the gRPC runtime's own C serialization is not seen; a bare tuple or
  list of ids is the datum itself, not counted);
* **router forms**: the same for one ``Generate`` of one token through a
  router's gRPC service in this process (the profile hook on its thread
  alone), over the same kind of engine and the router tests' fake tokenizer
  served on another thread: from the engine's wire message to
  ``GenerateResponse``. The total, engine core to client, counts the wire
  message (both ends hold it) once and every other form on each side, a type
  the router decodes into again included (a new copy in another process);
* **tasks and queues per open request**: ``--streams`` requests held open on
  the call (long ``max_tokens``); the asyncio tasks of the process's loop and
  the live ``asyncio.Queue`` objects are counted then and once the call is
  idle, divided by the streams.

Usage: ``python -m tools.engine_path [--streams 8]``, or through
``python tools/code_stats.py --engine-path``. Run it with ``PYTHONPATH`` set to
a checkout to measure that checkout's engine (the call is the wire's, so any
version of the engine answers it).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import gc
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

#: The tiny model's vocabulary; prompts use ids from 2 (1 is EOS).
_VOCAB = 64


@dataclass(frozen=True)
class EnginePath:
    """What one run measured.

    Attributes:
      forms: the types a generated token took, engine core to wire, in order.
      router_forms: the types it took in the router, from the wire message
        (``llmesh.v1.SequenceUpdate``) to the client's (``GenerateResponse``).
      tasks_per_stream: asyncio tasks per open request (beyond an idle call's).
      queues_per_stream: live ``asyncio.Queue`` objects per open request.
    """

    forms: tuple[str, ...]
    tasks_per_stream: float
    queues_per_stream: float
    router_forms: tuple[str, ...] = ()

    @property
    def client_forms(self) -> tuple[str, ...]:
        """The forms engine core to client: the engine's, then the router's
        (the wire message, which both ends see, counted once)."""
        router = self.router_forms
        if router and self.forms and router[0] == self.forms[-1]:
            router = router[1:]
        return self.forms + router


def tiny_backend(step_observer: Callable[[Any], None] | None = None) -> Any:
    """A torch backend over a tiny random Llama (no model file) and its config."""
    import torch

    from services.engine.config import EngineConfig
    from services.engine.torch_backend.backend import TorchBackend
    from services.engine.torch_backend.llama_config import LlamaConfig
    from services.engine.torch_backend.model import LlamaModel

    config = LlamaConfig(name="tiny", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=8, intermediate_size=64, vocab_size=_VOCAB,
                         rope_theta=10000.0, rms_norm_eps=1e-5, context_length=512,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_ids=(1,))
    torch.manual_seed(0)
    model = LlamaModel(config).eval().requires_grad_(False)
    engine = EngineConfig(backend="torch", dtype="float32", quantization="none",
                          max_model_len=512, kv_cache_bytes=8 << 20,
                          speculative_method="none", adaptive_threads=False)
    return TorchBackend(engine, step_observer=step_observer, model=model), engine


def multiplex_start(stream_id: int, request_id: str, max_tokens: int) -> Any:
    """A ``MultiplexStart`` of a 4-token prompt, EOS ignored."""
    from llmesh.v1 import common_pb2, engine_pb2

    return engine_pb2.MultiplexStart(stream_id=stream_id, request=engine_pb2.EngineRequest(
        request_id=request_id, prompt_token_ids=[2, 3, 4, 5],
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)))


class _FormRecorder:
    """A profile hook keeping (type, token ids) of each value with one id."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, tuple[int, ...]]] = []
        #: Recording (the hook stays installed on the engine thread).
        self.active = False

    def hook(self, frame: FrameType, event: str, arg: object) -> Callable[..., Any] | None:
        if not self.active:
            return None
        if event == "call":  # the arguments a function is handed (only those: a
            # resumed coroutine's other locals may still hold an earlier request's)
            code = frame.f_code
            names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
            local = frame.f_locals
            for name in names:
                self._note(local.get(name))
        elif event == "return":  # what a function built or returned
            self._note(frame.f_locals.get("self") if frame.f_code.co_name == "__init__"
                       else arg)
        return None

    def _note(self, value: object) -> None:
        ids = getattr(value, "token_ids", None)
        if ids is None or isinstance(ids, (str, bytes)):
            return
        try:
            if len(ids) != 1:
                return
            ids = tuple(ids)
        except TypeError:
            return
        kind = type(value)
        name = getattr(getattr(value, "DESCRIPTOR", None), "full_name", None)
        self.seen.append((name or f"{kind.__module__}.{kind.__qualname__}", ids))

    def forms(self, token_id: int) -> tuple[str, ...]:
        ordered: dict[str, None] = {}
        for name, ids in self.seen:
            if ids == (token_id,):
                ordered.setdefault(name, None)
        return tuple(ordered)


@contextlib.asynccontextmanager
async def tiny_engine(step_observer: Callable[[Any], None] | None = None,
                      thread_profile: Callable[..., Any] | None = None) -> AsyncIterator[Any]:
    """An EngineService over :func:`tiny_backend`, started and served on a
    loopback port; yields a stub to it. ``thread_profile``: a profile hook for
    the threads started while the engine starts (its engine thread)."""
    import grpc

    from llmesh.v1 import engine_pb2_grpc

    async with served_engine(step_observer, thread_profile) as target:
        async with grpc.aio.insecure_channel(target) as channel:
            yield engine_pb2_grpc.EngineServiceStub(channel)


@contextlib.asynccontextmanager
async def served_engine(step_observer: Callable[[Any], None] | None = None,
                        thread_profile: Callable[..., Any] | None = None
                        ) -> AsyncIterator[str]:
    """The engine of :func:`tiny_engine` with gRPC health SERVING (a router
    waits for it); yields its ``host:port``."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_health.v1.health import aio as health_aio
    from prometheus_client import CollectorRegistry

    from services.engine.metrics import EngineMetrics
    from services.engine.service import EngineService

    metrics = EngineMetrics(CollectorRegistry())
    backend, config = tiny_backend(lambda stats: _observe(metrics, step_observer, stats))
    service = EngineService(backend, config, metrics=metrics)
    if thread_profile is not None:
        threading.setprofile(thread_profile)
    try:
        await service.start()
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
    server = grpc.aio.server()
    service.register(server)
    health = health_aio.HealthServicer()
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)
        await service.close()


def _observe(metrics: Any, step_observer: Callable[[Any], None] | None, stats: Any) -> None:
    metrics.observe_step(stats)
    if step_observer is not None:
        step_observer(stats)


async def _measure(streams: int) -> EnginePath:
    import grpc

    from llmesh.v1 import engine_pb2

    recorder = _FormRecorder()
    async with tiny_engine(thread_profile=recorder.hook) as stub:
        call = stub.Multiplex()
        # Warm the call up (its tasks exist before anything is counted).
        await call.write(engine_pb2.MultiplexRequest(starts=[multiplex_start(1, "warm", 1)]))
        await _until_finished(call, {1})
        sys.setprofile(recorder.hook)
        recorder.active = True
        try:
            await call.write(engine_pb2.MultiplexRequest(
                starts=[multiplex_start(2, "form", 1)]))
            token_ids = await _until_finished(call, {2})
        finally:
            recorder.active = False
            sys.setprofile(None)
        idle = _counts()
        ids = set(range(10, 10 + streams))
        await call.write(engine_pb2.MultiplexRequest(
            starts=[multiplex_start(i, f"open-{i}", 400) for i in ids]))
        await _until_streaming(call, ids)
        busy = _counts()
        await call.write(engine_pb2.MultiplexRequest(cancels=sorted(ids)))
        await _until_finished(call, ids)
        await call.done_writing()
        while await call.read() is not grpc.aio.EOF:
            pass
    (token_id,) = token_ids
    return EnginePath(recorder.forms(token_id), (busy[0] - idle[0]) / streams,
                      (busy[1] - idle[1]) / streams)


def _counts() -> tuple[int, int]:
    gc.collect()
    queues = sum(type(o) is asyncio.Queue for o in gc.get_objects())
    return len(asyncio.all_tasks()), queues


async def _until_finished(call: Any, ids: set[int]) -> list[int]:
    """Reads until every stream of ``ids`` ended; the token ids they carried."""
    left, tokens = set(ids), []
    async with asyncio.timeout(60):
        while left:
            for update in (await call.read()).updates:
                tokens.extend(update.token_ids)
                if update.finish_reason or update.status_code:
                    left.discard(update.stream_id)
    return tokens


async def _until_streaming(call: Any, ids: set[int]) -> None:
    """Reads until every stream of ``ids`` has delivered a token."""
    left = set(ids)
    async with asyncio.timeout(60):
        while left:
            for update in (await call.read()).updates:
                if update.token_ids:
                    left.discard(update.stream_id)


def measure(streams: int = 8) -> EnginePath:
    """Runs the measurement (a few seconds: a tiny model on the CPU)."""
    path = asyncio.run(_measure(streams))
    with _upstreams_in_thread() as (engine, tokenizer):
        router_forms = asyncio.run(_router_forms(engine, tokenizer))
    return dataclasses.replace(path, router_forms=router_forms)


@contextlib.contextmanager
def _upstreams_in_thread() -> Iterator[tuple[str, str]]:
    """The engine of :func:`served_engine` and the router tests' fake
    tokenizer (``tests/router/router_fakes.py``: one token per character)
    served on their own event loop and thread, so that a profile hook on the
    calling thread sees the router alone; yields their targets."""
    from llmesh.v1 import tokenizer_pb2_grpc
    from tests.router.router_fakes import FakeTokenizer, serve

    started: concurrent.futures.Future[tuple[str, str, asyncio.Event]] = \
        concurrent.futures.Future()

    async def upstreams() -> None:
        stop = asyncio.Event()
        async with served_engine() as engine:
            server, tokenizer = await serve(
                tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server, FakeTokenizer())
            started.set_result((engine, tokenizer, stop))
            await stop.wait()
            await server.stop(None)

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(upstreams(),))
    thread.start()
    try:
        engine, tokenizer, stop = started.result(timeout=60)
        yield engine, tokenizer
    finally:
        if started.done():
            loop.call_soon_threadsafe(stop.set)
        thread.join(60)
        loop.close()


async def _router_forms(engine: str, tokenizer: str) -> tuple[str, ...]:
    """The forms one generated token takes in a router (its gRPC service in
    this process, over ``engine`` and ``tokenizer``), from the engine's wire
    message to the client's ``GenerateResponse``: one ``Generate`` of one
    token (prompt ids given, so the token is the only one in flight)."""
    import grpc
    from prometheus_client import CollectorRegistry

    from llmesh.v1 import common_pb2, generation_pb2, generation_pb2_grpc
    from services.router.metrics import RouterMetrics
    from services.router.service import RouterConfig, RouterService

    router = RouterService(RouterConfig(tokenizer=tokenizer, engines=(engine,),
                                        startup_timeout=60),
                           metrics=RouterMetrics(CollectorRegistry()))
    await router.start()
    server = grpc.aio.server()
    router.register(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    recorder = _FormRecorder()
    request = generation_pb2.GenerateRequest(
        prompt_tokens=generation_pb2.PromptTokens(token_ids=[2, 3, 4, 5]),
        sampling=common_pb2.SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            async with asyncio.timeout(60):
                await _generated(stub, request)  # warm: the router's engine call opens
                sys.setprofile(recorder.hook)
                recorder.active = True
                try:
                    token_ids = await _generated(stub, request)
                finally:
                    recorder.active = False
                    sys.setprofile(None)
    finally:
        await server.stop(None)
        await router.close()
    (token_id,) = token_ids
    return recorder.forms(token_id)


async def _generated(stub: Any, request: Any) -> list[int]:
    """The token ids of one ``Generate`` call's responses."""
    return [i async for response in stub.Generate(request) for i in response.token_ids]


def report(path: EnginePath) -> list[str]:
    return [f"{len(path.client_forms)} forms of a token, engine core to client: "
            + " -> ".join(path.client_forms),
            f"  {len(path.forms)} in the engine (core to wire): " + " -> ".join(path.forms),
            f"  {len(path.router_forms)} in the router (wire to client): "
            + " -> ".join(path.router_forms),
            f"{path.tasks_per_stream:g} asyncio tasks and {path.queues_per_stream:g} "
            "asyncio queues per open Multiplex request"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=8, help="requests held open")
    args = parser.parse_args(argv)
    print("\n".join(report(measure(args.streams))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
