"""A client that stops reading (the slow-reader budget's test and benchmark).

Envoy buffers about 1 MiB + 64 KiB per stream (its ingress's HTTP/2 stream
window, ``EnvoySettings.downstream_stream_window_bytes``, plus the window it
grants the router): a shorter answer fits there, and the router behind Envoy
sees a blocked write only for longer ones. The tests therefore call a router
directly, or an Envoy with a 64 KiB ingress window, with
big messages (20 log-probabilities per token: ~0.4 KB each) and a small
receive window (no BDP probing, 1 KB look-ahead), so that the router's
writes block after a few messages (measured: the budget cancelled a
1,500-token request after 180 tokens, the engine idle ~1.5 s after the
client stopped reading).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import grpc

from llmesh.v1 import common_pb2, generation_pb2, generation_pb2_grpc


#: Tokens of :func:`heavy_request`'s answer: long enough that the generation
#: still runs seconds after the writes block (~130 tokens in), even where
#: n-gram speculation accepts most of this counting answer (400 tokens were
#: done within the 1 s budget on a quiet machine).
HEAVY_TOKENS = 2000


def heavy_request(max_tokens: int = HEAVY_TOKENS) -> generation_pb2.GenerateRequest:
    """A greedy request whose messages are large (20 log-probabilities each)."""
    return generation_pb2.GenerateRequest(
        prompt="Count from one to one thousand, in words:", bypass_cache=True,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                           temperature=0.0, logprobs=20))


@dataclass
class StalledCall:
    """A Generate call whose client read one message, then stopped."""

    call: grpc.Call
    channel: grpc.Channel
    stopped_at: float

    def resume(self) -> tuple[int, grpc.StatusCode, str]:
        """Reads the rest; returns (messages read, final status, its message)."""
        count = 0
        try:
            for _ in self.call:
                count += 1
        except grpc.RpcError as err:
            return count, err.code(), err.details() or ""
        finally:
            self.channel.close()
        return count, grpc.StatusCode.OK, ""


def stalled_generate(router_address: str, request: generation_pb2.GenerateRequest,
                     timeout_s: float = 60.0) -> StalledCall:
    """Starts ``request`` on the router at ``router_address``, reads its first
    message, then stops reading (the call stays open)."""
    channel = grpc.insecure_channel(router_address, options=[
        ("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)])
    call = generation_pb2_grpc.GenerationServiceStub(channel).Generate(request,
                                                                       timeout=timeout_s)
    next(call)
    return StalledCall(call, channel, time.monotonic())


@dataclass
class StalledStream(StalledCall):
    """A GenerateStream call whose client read one message, then stopped (its
    request side stays open until :meth:`resume` ends)."""

    release: threading.Event

    def resume(self) -> tuple[int, grpc.StatusCode, str]:
        self.release.set()
        return super().resume()


def stalled_stream(router_address: str, request: generation_pb2.GenerateRequest,
                   timeout_s: float = 60.0) -> StalledStream:
    """As :func:`stalled_generate` on ``GenerateStream`` (``request`` as its start)."""
    channel = grpc.insecure_channel(router_address, options=[
        ("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)])
    release = threading.Event()

    def requests():  # noqa: ANN202
        yield generation_pb2.GenerateStreamRequest(start=request)
        release.wait(timeout_s)

    call = generation_pb2_grpc.GenerationServiceStub(channel).GenerateStream(
        requests(), timeout=timeout_s)
    next(call)
    return StalledStream(call, channel, time.monotonic(), release)
