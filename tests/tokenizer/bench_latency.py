"""Latency of the tokenizer service over gRPC on loopback.

Runs ``python -m services.tokenizer`` (SmolLM2) as its own process and times
sequential calls from one long-lived ``grpc.aio`` channel, as the router makes
them: GetTokenizerInfo (no work: the unary gRPC floor), Tokenize of ~100 and ~2,000 tokens of English text, ApplyChatTemplate of
a four-message conversation, and one Detokenize step (one id sent on an open
stream, its text received):

    python tests/tokenizer/bench_latency.py [--calls 500] [--runs 5]

Prints, per call, the median of the runs' medians and p99s in microseconds.
Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "services" / "gen")]

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from llmesh.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc  # noqa: E402

from services.common.grpc_util import make_channel  # noqa: E402

PROSE = ("The mesh exists to make latency low, so its own cost is a number we watch. "
         "Each hop is HTTP/2 on loopback; channels and streams are long-lived and reused. ")


def launch(port_file: Path) -> tuple[subprocess.Popen, int]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "services/gen")]))
    process = subprocess.Popen(
        [sys.executable, "-m", "services.tokenizer", "--port", "0", "--metrics-port", "-1",
         "--log-level", "warning", "--port-file", str(port_file)],
        cwd=ROOT, env=env, stderr=subprocess.DEVNULL)
    while not port_file.exists() or not port_file.read_text():
        time.sleep(0.02)
    return process, json.loads(port_file.read_text())["grpc_port"]


async def wait_serving(channel: grpc.aio.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    while True:
        try:
            status = (await health.Check(health_pb2.HealthCheckRequest())).status
        except grpc.aio.AioRpcError:
            status = None
        if status == health_pb2.HealthCheckResponse.SERVING:
            return
        await asyncio.sleep(0.05)


async def text_of(stub: tokenizer_pb2_grpc.TokenizerServiceStub, tokens: int) -> str:
    """English text of about ``tokens`` tokens."""
    ids = (await stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=PROSE * (tokens // 30 + 2))))
    stream = stub.Detokenize()
    await stream.write(tokenizer_pb2.DetokenizeRequest(token_ids=ids.token_ids[:tokens],
                                                       flush=True))
    text = (await stream.read()).text
    await stream.done_writing()
    return text


async def time_calls(call: Callable[[], Awaitable[object]], calls: int) -> list[float]:
    samples = []
    for _ in range(calls):
        started = time.perf_counter()
        await call()
        samples.append(time.perf_counter() - started)
    return samples


async def bench(port: int, calls: int, runs: int) -> dict[str, tuple[float, float]]:
    channel = make_channel(f"127.0.0.1:{port}")
    await wait_serving(channel)
    stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
    short = tokenizer_pb2.TokenizeRequest(text=await text_of(stub, 100))
    long = tokenizer_pb2.TokenizeRequest(text=await text_of(stub, 2000))
    print(f"texts: {len((await stub.Tokenize(short)).token_ids)} and "
          f"{len((await stub.Tokenize(long)).token_ids)} tokens")
    chat = tokenizer_pb2.ApplyChatTemplateRequest(messages=[
        common_pb2.ChatMessage(role="system", content="You are a helpful assistant."),
        common_pb2.ChatMessage(role="user", content="What is the capital of France?"),
        common_pb2.ChatMessage(role="assistant", content="Paris."),
        common_pb2.ChatMessage(role="user", content="And of Japan?"),
    ], add_generation_prompt=True, max_prompt_tokens=2048)
    step_ids = (await stub.Tokenize(long)).token_ids
    stream = stub.Detokenize()
    position = 0

    async def detokenize_step() -> None:
        nonlocal position
        await stream.write(tokenizer_pb2.DetokenizeRequest(
            token_ids=[step_ids[position % len(step_ids)]]))
        position += 1
        await stream.read()

    info = tokenizer_pb2.GetTokenizerInfoRequest()
    calls_of = {
        "GetTokenizerInfo (gRPC floor)": lambda: stub.GetTokenizerInfo(info),
        "Tokenize 100 tokens": lambda: stub.Tokenize(short),
        "Tokenize 2000 tokens": lambda: stub.Tokenize(long),
        "ApplyChatTemplate (4 messages)": lambda: stub.ApplyChatTemplate(chat),
        "Detokenize step (1 id)": detokenize_step,
    }
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in calls_of}
    for run in range(runs + 1):  # run 0 warms up
        for name, call in calls_of.items():
            samples = sorted(await time_calls(call, calls))
            if run:
                results[name].append((statistics.median(samples),
                                      samples[max(0, int(0.99 * len(samples)) - 1)]))
    await stream.done_writing()
    await channel.close()
    return {name: (statistics.median(m for m, _ in r), statistics.median(p for _, p in r))
            for name, r in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        process, port = launch(Path(tmp) / "ports.json")
        try:
            result = asyncio.run(bench(port, args.calls, args.runs))
        finally:
            process.terminate()
            process.wait(timeout=20)
    for call, (median, p99) in result.items():
        print(f"{call:32} median {median * 1e6:8.1f} us   p99 {p99 * 1e6:8.1f} us")


if __name__ == "__main__":
    main()
