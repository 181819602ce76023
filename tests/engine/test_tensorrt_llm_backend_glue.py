"""``TensorRTLLMBackend`` (backend.py) run against a scripted stand-in of
TensorRT-LLM's LLM API, without TensorRT-LLM.

The stand-in (:func:`stand_in`) is NOT TensorRT-LLM: it is built from the
documented LLM API and installed as ``tensorrt_llm`` in ``sys.modules``. These
tests check llmesh's glue only: the request mapped into ``generate_async``,
streamed deltas per choice, finish reasons, ``abort()`` on cancel and on a
closed stream, ``load()`` and the step observer from the iteration stats, KV
events converted and published, start/stop, errors mapped. What TensorRT-LLM
itself does is checked only by tests/engine/test_backend_contract.py on a GPU host.
"""

from __future__ import annotations

import asyncio
import collections
import importlib.machinery
import json
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import pytest

from services.common.block_hash import block_hash_seed
from services.common.kv_events import BlockRemoved, KVEvent
from services.common.logprobs import PositionLogprobs, TokenLogprob
from services.common.sampling import FinishReason, InvalidRequestError, SamplingOptions
from services.engine.backend import DuplicateRequestError, EngineUnavailableError
from services.engine.config import EngineConfig
from services.engine.tensorrt_llm_backend import backend as backend_module
from services.engine.tensorrt_llm_backend.backend import TensorRTLLMBackend
from services.engine.torch_backend.kv_cache_manager import KVCacheManager
from services.engine.types import LoadStats, ModelInfo, SequenceRequest, StepStats, TokenDelta

from .kv_helpers import compute, make_request
from .test_tensorrt_llm_events import STATS, block, removed, stored

MODEL = "tiny-llama"
EOS = 2
BLOCK = 4
KV_BLOCKS = 64  # the stand-in's KV cache (kvCacheStats.maxNumBlocks)


# ---- the stand-in -----------------------------------------------------------------------------

class Response(NamedTuple):
    """One executor response: one sequence's new tokens, and its reason on its last."""

    seq: int
    tokens: tuple[int, ...]
    reason: str | None = None
    logprobs: tuple[dict, ...] = ()


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    last: int = 0  # len(token_ids) before this sequence's latest response

    @property
    def token_ids_diff(self) -> list[int]:
        return self.token_ids[self.last:]

    @property
    def logprobs_diff(self) -> list[dict]:
        return self.logprobs[self.last:]


class RequestOutput:
    """``generate_async``'s result, as ``tensorrt_llm/executor/result.py``
    (``GenerationResult``) behaves: each ``__anext__`` handles ONE response,
    which updates only its own sequence (the other outputs keep their previous
    ``*_diff``); ``finish_reason`` "stop"/"length" is set only once the whole
    request is final (``isFinal``: every sequence final), "cancelled" at once;
    ``abort()`` makes the executor cancel every unfinished sequence."""

    def __init__(self, n: int, responses: list[Response]) -> None:
        self.outputs = [CompletionOutput(i) for i in range(n)]
        self.finished = False
        self.abort_calls = 0
        self._final = [False] * n
        self._queue: asyncio.Queue[Response] = asyncio.Queue()
        for response in responses:
            self._queue.put_nowait(response)

    def abort(self) -> None:
        self.abort_calls += 1
        if self.abort_calls == 1:
            for seq in (s for s, final in enumerate(self._final) if not final):
                self._queue.put_nowait(Response(seq, (), "cancelled"))

    def __aiter__(self) -> RequestOutput:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        response = await self._queue.get()
        out = self.outputs[response.seq]
        out.last = len(out.token_ids)
        out.token_ids += response.tokens
        out.logprobs += response.logprobs
        self._final[response.seq] = response.reason is not None
        self.finished = all(self._final)
        if response.reason == "cancelled" or self.finished:
            out.finish_reason = response.reason
        return self


def _refuse_unknown(name: str, kwargs: dict, allowed: str) -> None:
    """The LLM API takes keyword arguments it names only (its pydantic configs
    forbid extras; SamplingParams is a keyword-only dataclass)."""
    if unknown := set(kwargs) - set(allowed.split()):
        raise TypeError(f"{name}() got unexpected keyword arguments {sorted(unknown)}")


def _params(name: str, allowed: str) -> type:
    """A config class of the LLM API that keeps its keyword arguments."""
    def __init__(self: Any, **kwargs: Any) -> None:
        _refuse_unknown(name, kwargs, allowed)
        self.kwargs = kwargs

    return type(name, (), {"__init__": __init__})


async def _drain(queue: asyncio.Queue, timeout: float):  # type: ignore[no-untyped-def]
    """Entries until none comes within ``timeout`` (``IterationResult.__anext__``)."""
    while True:
        try:
            yield await asyncio.wait_for(queue.get(), timeout)
        except TimeoutError:
            return


class LLM:
    """``tensorrt_llm.LLM``: scripted ``generate_async`` (each call takes the next
    script of ``scripts``; none: ``max_tokens`` EOS ids ending "length"), one
    iteration stats entry per request, KV events as the test pushes them."""

    def __init__(self, created: list[LLM], **kwargs: Any) -> None:
        _refuse_unknown("LLM", kwargs, (
            "model skip_tokenizer_init max_seq_len max_batch_size max_num_tokens dtype "
            "enable_chunked_prefill guided_decoding_backend enable_iter_perf_stats "
            "kv_cache_config cuda_graph_config speculative_config"))
        self.kwargs = kwargs
        self.calls: list[tuple[list[int], Any, bool]] = []
        self.results: list[RequestOutput] = []
        self.scripts: collections.deque[list[Response]] = collections.deque()
        self.stats: asyncio.Queue[dict] = asyncio.Queue()
        self.kv_events: asyncio.Queue[dict] = asyncio.Queue()
        self.shutdown_calls = 0
        self.cache_salts: list[str | None] = []
        created.append(self)

    def generate_async(self, inputs: list[int], sampling_params: Any,
                       streaming: bool = False, **kwargs: Any) -> RequestOutput:
        assert set(kwargs) <= {"cache_salt"}  # documented in 1.x
        self.calls.append((inputs, sampling_params, streaming))
        self.cache_salts.append(kwargs.get("cache_salt"))
        params = sampling_params.kwargs
        script = self.scripts.popleft() if self.scripts else [
            Response(0, (EOS,) * params["max_tokens"], "length")]
        self.results.append(RequestOutput(params["n"], script))
        self.stats.put_nowait({"iter": len(self.calls), "iterLatencyMS": 5.0,
                               "numActiveRequests": 1, "kvCacheStats": {
                                   "maxNumBlocks": KV_BLOCKS, "usedNumBlocks": 16,
                                   "tokensPerBlock": BLOCK}})
        return self.results[-1]

    def get_stats_async(self, timeout: float = 2):  # type: ignore[no-untyped-def]
        return _drain(self.stats, timeout)

    def get_kv_cache_events_async(self, timeout: float = 2):  # type: ignore[no-untyped-def]
        return _drain(self.kv_events, timeout)

    def shutdown(self) -> None:
        self.shutdown_calls += 1


def stand_in() -> types.ModuleType:
    """A ``tensorrt_llm`` package with exactly what backend.py imports, written from:
    LLM API reference https://nvidia.github.io/TensorRT-LLM/llm-api/reference.html
    (``LLM.generate_async``, ``get_stats_async``, ``get_kv_cache_events_async``,
    ``shutdown``); ``CompletionOutput``
    https://nvidia.github.io/TensorRT-LLM/llm-api/reference/CompletionOutput.html;
    streaming https://nvidia.github.io/TensorRT-LLM/examples/llm_inference_async_streaming.html;
    KV events https://nvidia.github.io/TensorRT-LLM/examples/llm_inference_kv_events.html;
    ``SamplingParams`` https://nvidia.github.io/TensorRT-LLM/llm-api/reference/SamplingParams.html;
    ``KvCacheConfig`` https://nvidia.github.io/TensorRT-LLM/llm-api/reference/KvCacheConfig.html;
    and the source of ``tensorrt_llm/executor/result.py`` (``GenerationResult``,
    ``IterationResult``) and ``cpp/.../llmRequest`` ``createResult`` (``isFinal``)."""
    package = types.ModuleType("tensorrt_llm")
    package.__spec__ = importlib.machinery.ModuleSpec("tensorrt_llm", None)
    llmapi = types.ModuleType("tensorrt_llm.llmapi")
    created: list[LLM] = []
    package.created = created  # type: ignore[attr-defined]
    package.LLM = lambda **kwargs: LLM(created, **kwargs)  # type: ignore[attr-defined]
    package.SamplingParams = _params("SamplingParams", (  # type: ignore[attr-defined]
        "end_id pad_id max_tokens stop stop_token_ids include_stop_str_in_output embedding_bias "
        "n best_of top_k top_p seed temperature min_tokens repetition_penalty presence_penalty "
        "frequency_penalty logprobs prompt_logprobs guided_decoding ignore_eos detokenize"))
    for name, allowed in {
            "GuidedDecodingParams": "json regex grammar json_object structural_tag",
            "KvCacheConfig": "enable_block_reuse max_tokens free_gpu_memory_fraction "
                             "event_buffer_max_size enable_partial_reuse tokens_per_block",
            "CudaGraphConfig": "batch_sizes max_batch_size enable_padding",
            "NGramDecodingConfig": "max_draft_len max_matching_ngram_size is_public_pool",
            "DraftTargetDecodingConfig": "max_draft_len speculative_model_dir",
            "EagleDecodingConfig": "max_draft_len speculative_model_dir eagle3_one_model",
            "MTPDecodingConfig": "num_nextn_predict_layers"}.items():
        setattr(llmapi, name, _params(name, allowed))
    package.llmapi = llmapi  # type: ignore[attr-defined]
    return package


# ---- fixtures and helpers ------------------------------------------------------------------

@pytest.fixture
def trt(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> types.ModuleType:
    package = stand_in()
    monkeypatch.setitem(sys.modules, "tensorrt_llm", package)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.llmapi", package.llmapi)
    model_dir = tmp_path / MODEL
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 100, "eos_token_id": EOS,
        "max_position_embeddings": 256}))
    package.model_dir = model_dir  # type: ignore[attr-defined]
    return package


@dataclass
class Engine:
    backend: TensorRTLLMBackend
    llm: LLM
    steps: list[StepStats]


async def start(trt: types.ModuleType, **options: Any) -> Engine:
    steps: list[StepStats] = []
    config = EngineConfig(backend="tensorrt_llm", model_path=trt.model_dir, block_size=BLOCK,
                          max_num_seqs=8, **options)
    backend = TensorRTLLMBackend(config, step_observer=steps.append)
    await backend.start()
    return Engine(backend, trt.created[0], steps)


@pytest.fixture
async def engine(trt: types.ModuleType):  # type: ignore[no-untyped-def]
    engine = await start(trt)
    yield engine
    await engine.backend.shutdown()


def request(request_id: str = "r", **options: Any) -> SequenceRequest:
    options.setdefault("max_tokens", 8)
    return SequenceRequest(request_id, (10, 11, 12), SamplingOptions(**options))


async def until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(2.0):
        while not condition():
            await asyncio.sleep(0.005)


def delta(tokens: tuple[int, ...], reason: FinishReason, generated: int, index: int = 0,
          **more: Any) -> TokenDelta:
    return TokenDelta("r", tokens, reason, num_prompt_tokens=3,
                      num_generated_tokens=generated, index=index, **more)


# ---- tests -----------------------------------------------------------------------------------

async def test_start_builds_the_llm_warms_it_up_and_stop_shuts_everything_down(
        trt: types.ModuleType) -> None:
    engine = await start(trt, speculative_method="ngram")
    llm, backend = engine.llm, engine.backend
    args = llm.kwargs
    assert (args["model"], args["skip_tokenizer_init"], args["max_seq_len"],
            args["max_batch_size"], args["enable_iter_perf_stats"]) == (
        str(trt.model_dir), True, 256, 8, True)
    assert args["kv_cache_config"].kwargs == dict(
        enable_block_reuse=True, event_buffer_max_size=100_000,
        free_gpu_memory_fraction=0.85, tokens_per_block=BLOCK)
    assert args["cuda_graph_config"].kwargs == dict(batch_sizes=[1, 2, 4, 8], enable_padding=True)
    assert type(args["speculative_config"]).__name__ == "NGramDecodingConfig"
    assert args["speculative_config"].kwargs == dict(
        max_draft_len=3, max_matching_ngram_size=4, is_public_pool=False)
    [(prompt, params, streaming)] = llm.calls  # the warm-up
    assert (prompt, params.kwargs["max_tokens"], params.kwargs["ignore_eos"], streaming) == (
        [EOS] * 4, 2, True, True)
    assert backend.model_info == ModelInfo(  # its KV capacity from the first iteration stats
        MODEL, 256, 100, (EOS,), "tensorrt_llm", max_num_seqs=8, kv_capacity_tokens=KV_BLOCKS
        * BLOCK, kv_block_size=BLOCK, kv_hash_seed=block_hash_seed(MODEL, "tensorrt_llm/auto"))
    await backend.start()
    assert len(trt.created) == 1  # idempotent
    readers = [t for t in asyncio.all_tasks() if t.get_name().startswith("trtllm-")]
    assert sorted(t.get_name() for t in readers) == ["trtllm-kv-events", "trtllm-stats"]
    await backend.shutdown()
    await backend.shutdown()
    assert all(t.cancelled() for t in readers)
    assert llm.shutdown_calls == 1
    with pytest.raises(EngineUnavailableError, match="not running"):
        await anext(backend.generate(request()))


async def test_without_tensorrt_llm_the_backend_refuses_to_start(
        trt: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = TensorRTLLMBackend(EngineConfig(backend="tensorrt_llm", model_path=trt.model_dir))
    backend.check_available()  # the stand-in is installed
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)
    with pytest.raises(EngineUnavailableError, match="needs TensorRT-LLM"):
        backend.check_available()
    with pytest.raises(EngineUnavailableError, match="needs TensorRT-LLM"):
        await backend.start()
    with pytest.raises(EngineUnavailableError, match="not started"):
        backend.model_info  # noqa: B018


async def test_a_greedy_request_streams_the_scripted_tokens(engine: Engine) -> None:
    logprob = types.SimpleNamespace  # tensorrt_llm.executor.result.Logprob's shape
    engine.llm.scripts.append([
        Response(0, (5, 6), logprobs=({5: logprob(logprob=-0.5, rank=1)},
                                      {6: logprob(logprob=-0.25, rank=1)})),
        Response(0, (EOS,), "stop", ({EOS: logprob(logprob=-1.0, rank=2)},))])
    deltas = [d async for d in engine.backend.generate(request(logprobs=0))]

    def chosen(token: int, value: float, rank: int) -> tuple[PositionLogprobs, ...]:
        return (PositionLogprobs(TokenLogprob(token, value, rank)),)

    assert deltas == [
        delta((5, 6), FinishReason.NONE, 2, logprobs=chosen(5, -0.5, 1) + chosen(6, -0.25, 1)),
        delta((EOS,), FinishReason.STOP, 3, logprobs=chosen(EOS, -1.0, 2))]
    prompt, params, streaming = engine.llm.calls[-1]
    assert (prompt, streaming) == ([10, 11, 12], True)
    p = params.kwargs
    assert (p["top_k"], p["temperature"], p["max_tokens"], p["end_id"], p["n"], p["logprobs"],
            p["detokenize"]) == (1, None, 8, EOS, 1, 1, False)
    assert engine.llm.results[-1].abort_calls == 0  # it finished: nothing to abort
    assert engine.llm.cache_salts[-1] is None  # the shared scope: no cache_salt argument


async def test_the_cache_scope_goes_in_as_cache_salt(engine: Engine) -> None:
    scoped = replace(request(), cache_scope="ab" * 32)
    _ = [d async for d in engine.backend.generate(scoped)]
    assert engine.llm.cache_salts[-1] == "ab" * 32


async def test_n_choices_stream_their_own_deltas(engine: Engine) -> None:
    # Choice 1 ends first (max_tokens); TensorRT-LLM names a reason only once
    # the whole request is final, so choice 1's comes when the stream ends.
    engine.llm.scripts.append([
        Response(0, (5,)), Response(1, (8,)), Response(1, (9,)), Response(0, (6,)),
        Response(1, (10,), "length"), Response(0, (EOS,), "stop")])
    deltas = [d async for d in engine.backend.generate(
        request(n=2, temperature=1.0, max_tokens=3))]
    assert [d for d in deltas if d.index == 0] == [
        delta((5,), FinishReason.NONE, 1), delta((6,), FinishReason.NONE, 2),
        delta((EOS,), FinishReason.STOP, 3)]
    assert [d for d in deltas if d.index == 1] == [
        delta((8,), FinishReason.NONE, 1, 1), delta((9,), FinishReason.NONE, 2, 1),
        delta((10,), FinishReason.NONE, 3, 1), delta((), FinishReason.LENGTH, 3, 1)]
    p = engine.llm.calls[-1][1].kwargs
    assert (p["n"], p["temperature"], p["top_k"]) == (2, 1.0, None)


@pytest.mark.parametrize("how", ["cancel", "close the stream", "cancel the consumer"])
async def test_a_request_ended_early_is_aborted(engine: Engine, how: str) -> None:
    engine.llm.scripts.append([Response(0, (5,))])  # then still generating
    stream = engine.backend.generate(request())
    assert await anext(stream) == delta((5,), FinishReason.NONE, 1)
    if how == "cancel":
        assert engine.backend.cancel("r") is True
        async with asyncio.timeout(2.0):
            assert [d async for d in stream] == [delta((), FinishReason.CANCELLED, 1)]
    elif how == "close the stream":
        await stream.aclose()
    else:
        reader = asyncio.create_task(anext(stream))
        await asyncio.sleep(0)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
    assert engine.llm.results[-1].abort_calls == 1
    assert engine.backend.cancel("r") is False  # no longer in flight
    assert engine.backend.load().num_running == 0


class RecordingSink:
    """A DeltaSink that keeps what the backend hands it."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.deltas: list[TokenDelta] = []
        self.errors: list[Exception] = []

    def deliver(self, delta: TokenDelta) -> None:
        self.deltas.append(delta)

    def fail(self, error: Exception) -> None:
        self.errors.append(error)


async def test_submit_hands_the_stream_to_the_sink_and_its_cancel_aborts(
        engine: Engine) -> None:
    # The interface the Multiplex call uses: deltas into a sink, no iterator.
    engine.llm.scripts.append([Response(0, (5, 6)), Response(0, (EOS,), "stop")])
    sink = RecordingSink()
    engine.backend.submit(request(), sink)
    await until(lambda: len(sink.deltas) == 2)
    assert sink.deltas == [delta((5, 6), FinishReason.NONE, 2),
                           delta((EOS,), FinishReason.STOP, 3)]
    engine.llm.scripts.append([Response(0, (5,))])  # then still generating
    running = RecordingSink()
    submission = engine.backend.submit(request(), running)
    await until(lambda: len(running.deltas) == 1)
    submission.cancel()
    await until(lambda: engine.llm.results[-1].abort_calls == 1)
    assert engine.backend.cancel("r") is False  # no longer in flight
    refused = RecordingSink()
    engine.backend.submit(request(prompt_logprobs=1), refused)  # refused by the library's map
    await until(lambda: bool(refused.errors))
    assert isinstance(refused.errors[0], InvalidRequestError) and not refused.deltas
    assert sink.errors == running.errors == []


async def test_iteration_stats_feed_load_and_the_step_observer(engine: Engine) -> None:
    backend, llm = engine.backend, engine.llm
    llm.scripts.extend([[Response(0, (5,))], []])  # a runs; b has had no output yet
    a = backend.generate(request("a"))
    await anext(a)
    b = asyncio.create_task(anext(backend.generate(request("b"))))
    await until(lambda: len(llm.calls) == 3)
    with pytest.raises(DuplicateRequestError):
        await anext(backend.generate(request("a")))
    llm.stats.put_nowait({**STATS, "numActiveRequests": 1})  # 3 waiting, 100 of 400 blocks
    await until(lambda: engine.steps[-1].batch_size == 3)
    assert engine.steps[-1] == StepStats(duration_s=0.008, num_scheduled_tokens=520,
                                         batch_size=3, spec_num_drafts=2,
                                         spec_num_draft_tokens=6, spec_num_accepted_tokens=4)
    # Running 1, waiting 3 capped by the 2 requests in flight here.
    assert backend.load() == LoadStats(num_running=1, num_waiting=1, kv_cache_usage=0.25)
    assert backend.model_info.kv_capacity_tokens == KV_BLOCKS * BLOCK  # the first stats' only
    b.cancel()
    await a.aclose()
    await until(lambda: backend.load() == LoadStats(0, 0, 0.25))


async def test_kv_events_are_published_under_the_torch_engines_block_hashes(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    backend, events = engine.backend, engine.llm.kv_events
    events.put_nowait(stored(None, block(901, list(range(100, 104))),
                             block(902, list(range(104, 108)))))
    events.put_nowait({"event_id": 3})  # unreadable: logged and skipped
    events.put_nowait(removed(902))
    published: list[KVEvent] = []  # drained until both have come (extend returns None)
    await until(lambda: published.extend(backend.drain_kv_events()) or len(published) == 2)
    # The torch block pool with this engine's seed names the same tokens' blocks alike.
    manager = KVCacheManager(10, BLOCK, True, model_id=MODEL, kv_layout="tensorrt_llm/auto")
    seq = make_request("a", 10)  # tokens 100..109: two full blocks
    manager.allocate_slots(seq, 10)
    compute(manager, seq)
    [from_torch] = manager.take_events()
    assert published == [from_torch, BlockRemoved(from_torch.block_hashes[1:])]
    assert backend.kv_snapshot().block_hashes == from_torch.block_hashes[:1]
    monkeypatch.setattr(backend_module, "KV_EVENT_BUFFER", 1)
    events.put_nowait(stored(901, block(903, [1, 2, 3, 4])))
    events.put_nowait(stored(901, block(904, [5, 6, 7, 8])))
    await until(lambda: backend.kv_events_dropped() == 1)
    assert [len(e.block_hashes) for e in backend.drain_kv_events()] == [1]


@pytest.mark.parametrize(("options", "name"), [
    (dict(prompt_logprobs=1), "sampling.prompt_logprobs"),
    (dict(n=2, temperature=0.0), "sampling.n")])
async def test_what_tensorrt_llm_cannot_honour_is_refused_before_generate_async(
        engine: Engine, options: dict, name: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        await anext(engine.backend.generate(request(**options)))
    assert (refused.value.field, refused.value.code) == (name, grpc.StatusCode.INVALID_ARGUMENT)
    assert len(engine.llm.calls) == 1  # the warm-up only
