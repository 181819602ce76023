"""Exactness of in-flight batching with the real SmolLM2 weights on CPU.

A request's tokens must not depend on what shares the engine with it: run alone
or beside 15 others, with or without prefix-cache hits, and after being
preempted and recomputed, greedy output and seeded sampled output are
identical token for token. That needs batch-invariant arithmetic
(``torch_backend/batch_invariant.py``), checked here bit for bit on logits too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
import torch
from prometheus_client import CollectorRegistry

from services.common.sampling import FinishReason, InvalidRequestError, Priority, SamplingOptions
from services.engine.config import EngineConfig
from services.engine.metrics import EngineMetrics
from services.common.kv_events import BlockStored
from services.engine.torch_backend.backend import TorchBackend, resolve_quantization
from services.common.block_hash import hash_block
from services.engine.torch_backend.model import LlamaModel
from services.engine.torch_backend.model_runner import ModelRunner, StepInput
from services.engine.torch_backend.paged_kv import kv_block_bytes
from services.engine.types import SequenceRequest, StepStats

pytestmark = pytest.mark.model

#: Prompt lengths of the 16 concurrent requests (5 to 600 tokens).
LENGTHS = (5, 12, 16, 17, 31, 47, 64, 90, 128, 150, 200, 256, 300, 400, 500, 600)
#: Indices of the requests sampled with a seed (the others are greedy).
SEEDED = (3, 10)
#: Tight KV cache: 60 blocks of 16 tokens (960 token slots).
TIGHT_BLOCKS = 60


def prompt_of(length: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(100, 48000) for _ in range(length))


PROMPTS = tuple(prompt_of(length, i) for i, length in enumerate(LENGTHS))


def options(index: int) -> SamplingOptions:
    max_tokens = 4 + 4 * (index % 3)
    if index in SEEDED:
        return SamplingOptions(temperature=0.8, top_p=0.9, top_k=50, seed=100 + index,
                               max_tokens=max_tokens, ignore_eos=True)
    return SamplingOptions(max_tokens=max_tokens, ignore_eos=True)


class Steps:
    """Step observer that keeps every step's stats."""

    def __init__(self) -> None:
        self.stats: list[StepStats] = []
        self.threads: set[str] = set()

    def __call__(self, stats: StepStats) -> None:
        self.stats.append(stats)
        self.threads.add(threading.current_thread().name)

    @property
    def preemptions(self) -> int:
        return sum(s.num_preemptions for s in self.stats)


async def start_backend(model: LlamaModel, steps: Steps | None = None,
                        **config: object) -> TorchBackend:
    settings: dict[str, object] = dict(max_model_len=1024, kv_cache_bytes=256 << 20)
    settings.update(config)
    backend = TorchBackend(EngineConfig(**settings), step_observer=steps,  # type: ignore[arg-type]
                           model=model)
    await backend.start()
    return backend


@pytest_asyncio.fixture(scope="module")
async def reference(smollm2: LlamaModel) -> AsyncIterator[TorchBackend]:
    """Runs every request alone, no prefix caching: the expected outputs."""
    backend = await start_backend(smollm2, enable_prefix_caching=False)
    yield backend
    await backend.shutdown()


@pytest_asyncio.fixture(scope="module")
async def solo(reference: TorchBackend) -> list[list[int]]:
    return [await run(reference, request(f"solo-{i}", i)) for i in range(len(PROMPTS))]


def request(request_id: str, index: int, prompt: tuple[int, ...] | None = None) -> SequenceRequest:
    return SequenceRequest(request_id, PROMPTS[index] if prompt is None else prompt,
                           options(index))


async def run(backend: TorchBackend, req: SequenceRequest) -> list[int]:
    tokens: list[int] = []
    async for delta in backend.generate(req):
        tokens.extend(delta.token_ids)
    assert delta.finish_reason is FinishReason.LENGTH
    return tokens


async def idle(backend: TorchBackend) -> None:
    counts = backend.check_integrity()
    assert counts.used == 0 and counts.free + counts.cached == counts.total
    load = backend.load()
    assert (load.num_running, load.num_waiting, load.kv_cache_usage) == (0, 0, 0.0)


#: The teeth check's logits (PyTorch attention, no batch invariance) per model:
#: computed once, whichever attention backend the test parameter names.
_PLAIN_LOGITS: dict[tuple[str, bool, str | None],
                    tuple[list[torch.Tensor], list[torch.Tensor]]] = {}


@pytest.mark.parametrize("attention_backend", ["native", "torch"])
@pytest.mark.parametrize(("quantization", "dense_prefill", "quant_kernel"), [
    ("none", False, None), ("int8", False, "native"), ("int4", False, "native"),
    ("int4", True, "native"), ("int8", False, "torch"), ("int4", False, "torch"),
    ("int4", True, "torch")])
def test_logits_are_bit_identical_whatever_the_batch(
        smollm2_by_mode: Callable[..., LlamaModel], quantization: str, dense_prefill: bool,
        quant_kernel: str | None, attention_backend: str) -> None:
    """Three sequences' logits alone (one prefill) vs batched with different
    chunking and as a one-token decode: equal to the last bit with either
    attention backend, in every quantization mode on either quantized kernel
    (``--quant-kernel native``, the default, and the PyTorch int4/int8 ones),
    and with dense prompt projections (where the first tokens are a prompt and
    the later ones generated, split inside chunks); and not so with the PyTorch
    attention path without batch invariance (the test has teeth), on every
    kernel."""
    model = smollm2_by_mode(quantization, dense_prefill, quant_kernel)
    assert model.quant_kernel == quant_kernel
    seqs = [PROMPTS[1], PROMPTS[5], PROMPTS[8]]  # 12, 47, 128 tokens
    # With prompt projections: seq 0's last 3 tokens and seq 1's last 20 count
    # as generated (seq 1's second chunk below mixes both roles).
    prompt_lens = [9, 27, 128] if dense_prefill else [None] * 3

    def logits(batch_invariant: bool, backend: str) -> tuple[list[torch.Tensor],
                                                             list[torch.Tensor]]:
        runner = ModelRunner(model, torch.device("cpu"), torch.float32, batch_invariant,
                             attention_backend=backend)
        assert runner.attention_backend == backend
        runner.allocate_kv_cache(40 * kv_block_bytes(model.config, 16, torch.float32), 16)
        tables = [list(range(0, 1)), list(range(1, 4)), list(range(4, 12))]
        alone = [runner.run([StepInput(s, 0, t, prompt_len=n)])[0]
                 for s, t, n in zip(seqs, tables, prompt_lens, strict=True)]
        tables = [list(range(20, 21)), list(range(21, 24)), list(range(24, 32))]
        # Step 1: seq 0 all but its last token, seq 1 a first chunk of 30, seq 2 all.
        runner.run([StepInput(seqs[0][:11], 0, tables[0], False, prompt_len=prompt_lens[0]),
                    StepInput(seqs[1][:30], 0, tables[1], False, prompt_len=prompt_lens[1]),
                    StepInput(seqs[2], 0, tables[2], prompt_len=prompt_lens[2])])
        # Step 2: seq 0's last token (a decode row), seq 1's remaining 17 tokens.
        batched = runner.run([StepInput(seqs[0][11:], 11, tables[0], prompt_len=prompt_lens[0]),
                              StepInput(seqs[1][30:], 30, tables[1], prompt_len=prompt_lens[1])])
        return alone, list(batched)

    alone, batched = logits(batch_invariant=True, backend=attention_backend)
    assert torch.equal(alone[0], batched[0]) and torch.equal(alone[1], batched[1])
    key = (quantization, dense_prefill, quant_kernel)
    if key not in _PLAIN_LOGITS:  # the same for either attention backend parameter
        _PLAIN_LOGITS[key] = logits(batch_invariant=False, backend="torch")
    plain_alone, plain_batched = _PLAIN_LOGITS[key]
    # fp32: GEMV (1 row) vs GEMM rows; quantized: the attention matmuls (the
    # projections are row-invariant anyway), grown through 30 layers of bf16
    # activations into a few bf16 steps of the logits. The native kernels'
    # int16 activations (max / 32767 per 32 values, finer than bf16) keep the
    # last-bit differences too: measured 0.28% to 0.83% of the largest logit
    # on the native kernels, 0.53% to 0.79% on PyTorch's (1, 2 or 4 threads). On
    # a Xeon with AVX512-BF16 (2026-12-02) PyTorch's bf16 attention matmuls were
    # row-invariant for these shapes (equal logits): the fp32 case shows the teeth.
    if quantization == "none":
        assert not torch.equal(plain_alone[0], plain_batched[0])
        assert torch.allclose(plain_alone[0], plain_batched[0], atol=1e-3)
    else:
        scale = plain_alone[0].abs().max()
        assert (plain_alone[0] - plain_batched[0]).abs().max() < 0.02 * scale


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
async def test_sixteen_concurrent_requests_equal_their_solo_runs(
        smollm2: LlamaModel, solo: list[list[int]], enable_prefix_caching: bool) -> None:
    steps = Steps()
    backend = await start_backend(smollm2, steps, enable_prefix_caching=enable_prefix_caching)
    try:
        together = await asyncio.gather(*(run(backend, request(f"c-{i}", i))
                                          for i in range(len(PROMPTS))))
        assert together == solo
        # Short requests finish before the longest prompts have joined.
        assert max(s.batch_size for s in steps.stats) >= 8
        assert [len(t) for t in together] == [options(i).max_tokens for i in range(16)]
        assert steps.threads == {"engine-step"}  # the thread that built the runner
        await idle(backend)
    finally:
        await backend.shutdown()


@pytest.mark.parametrize("prefix_len", [31, 32, 33])
async def test_shared_prefixes_reuse_blocks_and_stay_exact(smollm2: LlamaModel,
                                                           reference: TorchBackend,
                                                           prefix_len: int) -> None:
    prefix = PROMPTS[13][:prefix_len]
    prompts = [prefix + prompt_of(12 + 5 * k, 50 + k) for k in range(3)]
    expected = [await run(reference, request(f"ref-{prefix_len}-{k}", k, p))
                for k, p in enumerate(prompts)]
    backend = await start_backend(smollm2)
    try:
        first = await collect_last(backend, request(f"first-{prefix_len}", 0, prompts[0]))
        rest = await asyncio.gather(*(collect_last(backend, request(f"next-{k}", k, prompts[k]))
                                      for k in (1, 2)))
        results = [first] + list(rest)
        assert [tokens for tokens, _ in results] == expected
        hit = prefix_len // 16 * 16  # the full blocks of the shared prefix
        assert [cached for _, cached in results] == [0, hit, hit]
        await idle(backend)
        # The first prefill announced its two full blocks, chained from the model's seed.
        events = backend.drain_kv_events()
        h0 = hash_block(backend.model_info.kv_hash_seed, prompts[0][:16])
        h1 = hash_block(h0, prompts[0][16:32])
        assert events[0] == BlockStored((h0, h1), None, prompts[0][:32], 16)
        assert all(isinstance(event, BlockStored) for event in events)
        assert backend.drain_kv_events() == []
    finally:
        await backend.shutdown()


async def test_a_next_turn_quoting_the_answer_stays_exact(
        smollm2_by_mode: Callable[..., LlamaModel]) -> None:
    """A chat's next turn with dense prompt projections (``--dense-prefill``:
    the default only on PyTorch's quantized kernels, so built here whatever
    the default): the prompt repeats the first turn's prompt and answer. The
    answer's blocks were computed as generated tokens (the quantized
    kernels), the next turn reads them as prompt tokens (dense prompt
    projections): role-aware block hashes keep them from being reused, so the
    next turn equals a run without prefix caching on the same model; the
    first turn's all-prompt blocks are still hits."""
    model = smollm2_by_mode(resolve_quantization(EngineConfig()).quantization, True)
    assert model.has_prompt_projections
    first = PROMPTS[8][:40]  # 40 prompt tokens: 2 full blocks of prompt only
    backend = await start_backend(model)
    reference = await start_backend(model, enable_prefix_caching=False)
    try:
        answer, _ = await collect_last(backend, SequenceRequest(
            "turn-1", first, SamplingOptions(max_tokens=30, ignore_eos=True)))
        second = first + tuple(answer) + PROMPTS[2][:16]
        options_2 = SamplingOptions(max_tokens=8, ignore_eos=True)
        tokens, cached = await collect_last(backend, SequenceRequest("turn-2", second, options_2))
        expected, _ = await collect_last(reference,
                                         SequenceRequest("turn-2-ref", second, options_2))
        assert tokens == expected
        assert cached == 32  # blocks 0-1; block 2 holds answer tokens computed as generated
        await idle(backend)
    finally:
        await backend.shutdown()
        await reference.shutdown()


@pytest.mark.parametrize("quant_kernel", ["native", "torch"])
def test_prompt_rows_take_the_dense_projections(smollm2_by_mode: Callable[..., LlamaModel],
                                                quant_kernel: str) -> None:
    """With prompt projections, the same tokens read as a prompt and as generated
    give close but different logits (two kernels), and a chunk that mixes both
    roles equals the rows computed one role at a time. The generated rows'
    activations are rounded to int16 per 32 values on the native int4 kernel
    (bf16 on PyTorch's): on these random-token prompts their logits differ from
    the prompt rows' by at most 2.4% of the largest logit (2.7% with PyTorch's
    kernel), one argmax of 40 flipped on either."""
    model = smollm2_by_mode("int4", True, quant_kernel)
    assert model.quant_kernel == quant_kernel and model.has_prompt_projections
    if EXPECTED_PROMPT_KERNEL in os.environ:  # a forced older CPU's kernel
        assert model.prompt_kernel == os.environ[EXPECTED_PROMPT_KERNEL]
    runner = ModelRunner(model, torch.device("cpu"), torch.float32)
    runner.allocate_kv_cache(20 * kv_block_bytes(model.config, 16, torch.float32), 16)
    tokens = list(PROMPTS[5][:40])
    as_prompt = runner.run([StepInput(tokens, 0, [0, 1, 2], num_logits=40, prompt_len=40)])
    as_generated = runner.run([StepInput(tokens, 0, [3, 4, 5], num_logits=40)])
    assert not torch.equal(as_prompt, as_generated)
    scale = as_prompt.abs().max()
    assert (as_prompt - as_generated).abs().max() < 0.05 * scale
    assert torch.equal(as_prompt.argmax(-1), as_generated.argmax(-1)) or (
        (as_prompt.argmax(-1) != as_generated.argmax(-1)).sum() <= 2)
    mixed = runner.run([StepInput(tokens, 0, [6, 7, 8], num_logits=40, prompt_len=25)])
    assert torch.equal(mixed[:25], as_prompt[:25])
    one_role = runner.run([StepInput(tokens[:25], 0, [9, 10, 11], samples=False, prompt_len=25)])
    assert one_role.shape[0] == 0
    rest = runner.run([StepInput(tokens[25:], 25, [9, 10, 11], num_logits=15, prompt_len=25)])
    assert torch.equal(mixed[25:], rest)


#: Set by :func:`test_dense_prompt_rows_stay_exact_on_older_isas` for its child:
#: the prompt kernel the child's model must have chosen.
EXPECTED_PROMPT_KERNEL = "LLMESH_TEST_PROMPT_KERNEL"
#: Older CPUs' kernel paths, forced on this one: oneDNN's ISA cap (read once,
#: when oneDNN initializes: hence a child process), PyTorch's and MKL's own
#: dispatch, and the native kernels' build flags (``$CC`` is part of their
#: cache key: a build of its own). Per case: the environment, the CPU flag the
#: path needs, and the prompt kernel expected (None: whichever the probe finds
#: invariant; with AVX2 oneDNN has no bf16, so fp32 by rule).
OLDER_ISAS: dict[str, tuple[dict[str, str], str, str | None]] = {
    "avx512_core_vnni": ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI", "CC_FLAG": "-mno-avx512bf16"},
                         "avx512_vnni", None),
    "avx2": ({"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
              "MKL_ENABLE_INSTRUCTIONS": "AVX2", "CC_FLAG": "-mno-avx512f"}, "avx2", "fp32"),
}


@pytest.mark.parametrize("isa", OLDER_ISAS)
def test_dense_prompt_rows_stay_exact_on_older_isas(isa: str) -> None:
    """Batch invariance on CPUs older than this one: an AVX-512 Xeon without
    avx512_bf16 (where oneDNN's bf16 GEMM made prompt rows depend on their
    batch: the 6 dense-prefill cases above failed there) and an AVX2-only
    CPU, forced here in a child pytest that runs
    :func:`test_prompt_rows_take_the_dense_projections` (40 prompt rows in one
    chunk against the same rows in chunks of 25 and 15) on the native kernels.
    Skipped on a CPU without the forced ISA (it cannot run that path)."""
    environment, flag, expected_kernel = OLDER_ISAS[isa]
    cpu_flags = next((line.split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), [])
    if flag not in cpu_flags:
        pytest.skip(f"this CPU has no {flag}")
    env = {**os.environ, **environment}
    env["CC"] = f"{os.environ.get('CC', 'cc')} {env.pop('CC_FLAG')}"
    env.pop(EXPECTED_PROMPT_KERNEL, None)
    if expected_kernel is not None:
        env[EXPECTED_PROMPT_KERNEL] = expected_kernel
    test = f"{Path(__file__).name}::test_prompt_rows_take_the_dense_projections[native]"
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         f"tests/engine/{test}"], cwd=Path(__file__).parents[2], env=env,
        capture_output=True, text=True, timeout=280, check=False)
    assert child.returncode == 0 and "1 passed" in child.stdout, child.stdout[-4000:]


async def collect_last(backend: TorchBackend, req: SequenceRequest) -> tuple[list[int], int]:
    tokens: list[int] = []
    async for delta in backend.generate(req):
        tokens.extend(delta.token_ids)
    return tokens, delta.num_cached_tokens


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
async def test_preempted_requests_recompute_to_the_same_tokens(
        smollm2: LlamaModel, solo: list[list[int]], enable_prefix_caching: bool) -> None:
    steps = Steps()
    block_bytes = kv_block_bytes(smollm2.config, 16, torch.float32)
    backend = await start_backend(smollm2, steps, kv_cache_bytes=TIGHT_BLOCKS * block_bytes,
                                  max_model_len=1024,
                                  enable_prefix_caching=enable_prefix_caching)
    chosen = (15, 13, 12, 10, 9, 3)  # 600 + 400 + 300 + 150 + 128 + 17 prompt tokens
    try:
        together = await asyncio.gather(*(run(backend, request(f"p-{i}", i)) for i in chosen))
        assert together == [solo[i] for i in chosen]
        assert steps.preemptions > 0
        await idle(backend)
    finally:
        await backend.shutdown()


async def test_a_batch_prompt_in_small_chunks_beside_an_interactive_decode_keeps_its_tokens(
        smollm2: LlamaModel, reference: TorchBackend) -> None:
    """A 600-token batch prompt arriving while an interactive request decodes is
    computed in the few tokens a step the outranked-prefill bound allows
    (docs/engine.md's scheduler; the rest deferred, counted): both outputs
    equal their solo runs."""
    inter = SequenceRequest("inter", PROMPTS[1], dataclasses.replace(options(1), max_tokens=24))
    batch = SequenceRequest("batch", PROMPTS[15], options(15), Priority.BATCH)
    expected = [await run(reference, dataclasses.replace(r, request_id=f"solo-{r.request_id}"))
                for r in (inter, batch)]
    steps, metrics = Steps(), EngineMetrics(CollectorRegistry())

    def observe(stats: StepStats) -> None:
        steps(stats)
        metrics.observe_step(stats)

    backend = TorchBackend(EngineConfig(max_model_len=1024, kv_cache_bytes=256 << 20),
                           step_observer=observe, model=smollm2)
    await backend.start()
    try:
        first = asyncio.create_task(run(backend, inter))
        while not steps.stats:  # inter's prompt step is done: it decodes from now on
            await asyncio.sleep(0.005)
        assert await asyncio.gather(first, run(backend, batch)) == expected
        deferred = sum(s.num_prompt_tokens_deferred for s in steps.stats)
        assert deferred > 0
        assert metrics.registry.get_sample_value(
            "llmesh:prompt_tokens_deferred_by_priority_total") == deferred
        await idle(backend)
    finally:
        await backend.shutdown()


async def test_batch_sequences_preempted_for_an_interactive_arrival_keep_their_tokens(
        smollm2: LlamaModel, reference: TorchBackend) -> None:
    """Both sequence slots held by batch requests (one greedy, one seeded): an
    interactive arrival preempts the later one at once, finishes before either
    batch request, and both batch outputs equal their solo runs."""
    def batch_request(request_id: str, index: int) -> SequenceRequest:
        sampling = dataclasses.replace(options(index), max_tokens=24)
        return SequenceRequest(request_id, PROMPTS[index], sampling, Priority.BATCH)

    chosen = (9, 3)  # 128 tokens greedy, 17 tokens seeded
    expected = [await run(reference, batch_request(f"solo-batch-{i}", i)) for i in chosen]
    steps = Steps()
    backend = await start_backend(smollm2, steps, max_num_seqs=2)
    ended: list[str] = []

    async def tracked(req: SequenceRequest) -> list[int]:
        tokens = await run(backend, req)
        ended.append(req.request_id)
        return tokens

    try:
        batch = [asyncio.create_task(tracked(batch_request(f"b-{i}", i))) for i in chosen]
        while backend.load().num_running < 2 or not steps.stats:
            await asyncio.sleep(0.01)
        interactive = await tracked(SequenceRequest("inter", PROMPTS[1], options(1)))
        assert len(interactive) == options(1).max_tokens
        assert ended[0] == "inter"  # before either batch request ended
        assert await asyncio.gather(*batch) == expected
        assert steps.preemptions >= 1
        await idle(backend)
    finally:
        await backend.shutdown()


BUDGET = 64


async def test_a_short_request_arriving_during_an_8000_token_prefill_starts_within_2_steps(
        smollm2: LlamaModel) -> None:
    """An 8,000-token prompt is computed in chunks of the whole step budget (64
    tokens here, so that a step is short on CI: 125 steps); a short request
    arriving during it shares the next step's budget, so its first token comes
    within 2 steps (the one in progress and the next), not after the whole
    prefill."""
    steps = Steps()
    backend = await start_backend(smollm2, steps, max_model_len=8192, kv_cache_bytes=512 << 20,
                                  max_num_batched_tokens=BUDGET)
    try:
        long = asyncio.create_task(collect_last(backend, SequenceRequest(
            "long", prompt_of(8000, 99), SamplingOptions(max_tokens=1, ignore_eos=True))))
        while len(steps.stats) < 2:
            await asyncio.sleep(0.002)
        before = len(steps.stats)
        sent = time.monotonic()
        short = backend.generate(SequenceRequest("short", PROMPTS[0], SamplingOptions(
            max_tokens=1, ignore_eos=True)))
        first = await anext(short)
        ttft = time.monotonic() - sent
        after = len(steps.stats)
        budget_step_s = max(s.duration_s for s in steps.stats[:after]
                            if s.num_scheduled_tokens == BUDGET)
        print(f"short TTFT {ttft * 1e3:.0f} ms over {after - before} steps; a {BUDGET}-token "
              f"step takes up to {budget_step_s * 1e3:.0f} ms")
        assert first.token_ids
        assert after - before <= 2
        assert ttft <= 2 * budget_step_s + 0.05
        async for _ in short:
            pass
        assert not long.done()  # still prefilling: the short request did not wait for it
        backend.cancel("long")
        await long
        await idle(backend)
    finally:
        await backend.shutdown()


async def test_requests_that_can_never_fit_are_refused(smollm2: LlamaModel) -> None:
    block_bytes = kv_block_bytes(smollm2.config, 16, torch.float32)
    backend = await start_backend(smollm2, kv_cache_bytes=20 * block_bytes)
    try:
        assert backend.kv_cache_info.num_tokens == 320
        cases = [
            (prompt_of(1100, 1), 4, "prompt_token_ids", "context window is 1024"),
            (prompt_of(400, 1), 4, "prompt_token_ids", "KV cache holds 320 tokens"),
            (prompt_of(300, 1), 100, "sampling.max_tokens", "set max_tokens <= 21"),
        ]
        for prompt, max_tokens, field, message in cases:
            with pytest.raises(InvalidRequestError, match=message) as caught:
                await run(backend, SequenceRequest("never", prompt,
                                                   SamplingOptions(max_tokens=max_tokens)))
            assert (caught.value.code, caught.value.field) == (grpc.StatusCode.OUT_OF_RANGE,
                                                               field)
        assert backend.load().num_waiting == 0
        # The largest request that fits runs to its end: its last computed token
        # takes the cache's last slot.
        tokens = await run(backend, SequenceRequest("fits", prompt_of(300, 1), SamplingOptions(
            max_tokens=21, ignore_eos=True)))
        assert len(tokens) == 21
        await idle(backend)
    finally:
        await backend.shutdown()
