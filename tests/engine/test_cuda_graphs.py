"""The CUDA path's logic that runs on the CPU (``cuda_graphs.py``, ``device.py``):
which graph a step replays, the static-buffer layout with its padding rows,
the captured forward giving the eager step's logits and KV bit for bit, and a
step that reads no device value on the host but the sampled ids (checked on
the meta device, where any such read raises). Capturing and replaying graphs
need a GPU: ``benchmarks/cuda_check.py``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.random_checkpoint import save_tiny_llama
from services.engine.config import EngineConfig
from services.engine.torch_backend.backend import TorchBackend
from services.engine.torch_backend.cuda_graphs import (
    HEADER_COLUMNS,
    DecodeBuffers,
    capture_refusal,
    decode_forward,
    graph_shape,
    key_lengths,
    pack_decode_inputs,
    reachable_shapes,
    smallest_at_least,
)
from services.engine.torch_backend.device import check_device, check_kv_budget, to_device
from services.engine.torch_backend.hf_loader import load_hf_checkpoint
from services.engine.torch_backend.model import LlamaModel, build_model
from services.engine.torch_backend.model_runner import (
    ModelRunner,
    StepInput,
    resolve_attention_backend,
)
from services.engine.torch_backend.paged_kv import PagedKVCache
from services.engine.torch_backend.start_checks import auto_quantization
from services.engine.torch_backend.sampler import SamplingRow, sample

BLOCK = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def model(checkpoint: Path) -> LlamaModel:
    loaded = load_hf_checkpoint(checkpoint)
    return build_model(loaded.config, loaded.state_dict)


def test_a_step_runs_in_the_smallest_graph_that_holds_it() -> None:
    sizes, buckets = (1, 2, 4, 8), (256, 512, 640)
    assert [smallest_at_least(n, sizes) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    decodes = [StepInput([5], start, [0]) for start in (10, 300, 7)]
    assert graph_shape(decodes, sizes, buckets) == (4, 512)  # position 300 needs 301 keys
    assert graph_shape(decodes[:1], sizes, buckets) == (1, 256)
    assert graph_shape([StepInput([5], 640, [0])], sizes, buckets) is None  # 641 keys
    assert graph_shape(decodes * 3, sizes, buckets) is None  # 9 decodes
    prefill = [StepInput([5, 6], 0, [0])]
    spec = [StepInput([5, 6], 3, [0], num_logits=2)]
    silent = [StepInput([5], 3, [0], samples=False)]
    assert all(graph_shape(s, sizes, buckets) is None for s in (prefill, spec, silent, []))


def test_key_buckets_double_and_cover_the_context() -> None:
    assert key_lengths(2048, 16, batch_invariant=True) == (256, 512, 1024, 2048)
    assert key_lengths(1000, 16, batch_invariant=True) == (256, 512, 1024)
    assert key_lengths(100, 16, batch_invariant=False) == (112,)
    assert key_lengths(300, 48, batch_invariant=True) == (288, 384)  # lcm(32, 48) = 96
    with pytest.raises(ValueError, match="must be >= 1"):
        key_lengths(0, 16, True)


def test_only_shapes_a_step_can_reach_are_captured() -> None:
    # 20 blocks of 16: a bucket-512 sequence has 257+ keys (17 blocks), so only
    # one fits; sizes 2 and 4 start at 2 and 3 sequences.
    shapes = reachable_shapes((1, 2, 4), (256, 512), num_blocks=20, block_size=16)
    assert shapes == [(4, 256), (2, 256), (1, 512), (1, 256)]
    assert reachable_shapes((1, 2, 4), (256, 512), 1000, 16)[0] == (4, 512)


def test_inputs_are_packed_into_the_static_layout() -> None:
    out = np.full((4, HEADER_COLUMNS + 3), -1, dtype=np.int64)
    scratch = 9
    inputs = [StepInput([42], 17, [3, 5]), StepInput([7], 0, [8])]
    pack_decode_inputs(inputs, out, BLOCK, scratch)
    assert out.tolist() == [
        [42, 17, 5 * BLOCK + 1, 18, 3, 5, scratch],
        [7, 0, 8 * BLOCK, 1, 8, scratch, scratch],
        [0, 0, scratch * BLOCK, 1, scratch, scratch, scratch],  # padding rows
        [0, 0, scratch * BLOCK, 1, scratch, scratch, scratch],
    ]
    with pytest.raises(ValueError, match="5 decodes do not fit a graph of 4 rows"):
        pack_decode_inputs(inputs * 2 + inputs[:1], out, BLOCK, scratch)
    with pytest.raises(ValueError, match="position 48 needs 4 blocks; the graph holds 3"):
        pack_decode_inputs([StepInput([1], 48, [0, 1, 2, 4])], out, BLOCK, scratch)
    with pytest.raises(ValueError, match="one token per sequence"):
        pack_decode_inputs([StepInput([1, 2], 0, [0])], out, BLOCK, scratch)


def prefilled_cache(model: LlamaModel, prompts: list[list[int]]) -> tuple[ModelRunner, list]:
    """A runner over a cache with a scratch block, each prompt prefilled in its own blocks."""
    runner = ModelRunner(model, torch.device("cpu"), torch.float32, attention_backend="torch")
    runner.kv_cache = PagedKVCache(model.config, 12, BLOCK, scratch_blocks=1)
    tables, next_block = [], 0
    for prompt in prompts:
        blocks = list(range(next_block, next_block + 3))
        next_block += 3
        runner.run([StepInput(prompt, 0, blocks)])
        tables.append(blocks)
    return runner, tables


def test_the_captured_forward_equals_the_eager_step(model: LlamaModel) -> None:
    """``decode_forward`` (what a graph captures) over 3 decodes padded to 4 rows
    gives the eager step's logits bit for bit, writes the same keys/values into
    the sequences' blocks, and touches no block but theirs and the scratch one."""
    prompts = [[1, 2, 3, 4, 5], list(range(100, 133)), [49000, 7]]
    runner, tables = prefilled_cache(model, prompts)
    cache = runner.kv_cache
    assert cache is not None and cache.scratch_block == 12
    before_k, before_v = cache.k.clone(), cache.v.clone()
    decodes = [StepInput([11 + i], len(p), t) for i, (p, t) in enumerate(zip(prompts, tables))]
    eager = runner.run(decodes)
    eager_k, eager_v = cache.k.clone(), cache.v.clone()
    cache.k.copy_(before_k)
    cache.v.copy_(before_v)
    size, keys = graph_shape(decodes, (1, 2, 4), key_lengths(512, BLOCK, True))
    assert (size, keys) == (4, 256)
    buffers = DecodeBuffers.allocate(model.padded_rows(size), keys // BLOCK, torch.device("cpu"))
    host = torch.empty_like(buffers.table)
    pack_decode_inputs(decodes, host.numpy(), BLOCK, 12)
    buffers.load(host)
    static = decode_forward(model, cache, buffers, torch.arange(buffers.rows), 2, True)
    assert torch.equal(static[:3], eager)
    assert torch.equal(cache.k[:, :, :12], eager_k[:, :, :12])
    assert torch.equal(cache.v[:, :, :12], eager_v[:, :, :12])
    assert not torch.equal(cache.k[:, :, 12], before_k[:, :, 12])  # padding rows wrote there


def test_a_step_reads_no_device_value_but_the_sampled_ids(checkpoint: Path) -> None:
    """The whole step (layout, eager forward, the captured forward, greedy and
    top-k/top-p sampling) runs on the meta device, where reading any tensor's
    value on the host (``.item()``, ``.tolist()``, ``.cpu()``, ``if tensor``)
    raises; only the sampled ids' ``.tolist()`` does."""
    loaded = load_hf_checkpoint(checkpoint)
    meta = build_model(loaded.config, loaded.state_dict, device="meta")
    assert meta.embed_tokens.device.type == "meta"
    runner = ModelRunner(meta, torch.device("meta"), torch.float32, attention_backend="torch")
    runner.kv_cache = PagedKVCache(meta.config, 8, BLOCK, "meta", scratch_blocks=1)
    runner.run([StepInput(list(range(20)), 0, [0, 1]), StepInput([5], 3, [2])])
    logits = runner.run([StepInput([1], 20, [0, 1]), StepInput([5], 4, [2])])
    buffers = DecodeBuffers.allocate(4, 16, torch.device("meta"))
    static = decode_forward(meta, runner.kv_cache, buffers, torch.arange(4, device="meta"),
                            2, True)
    generator = torch.Generator()
    generator.manual_seed(0)
    ids = sample(logits, [SamplingRow(), SamplingRow(0.7, 5, 0.9, generator)])
    assert ids.device.type == static.device.type == "meta"
    with pytest.raises(NotImplementedError, match="meta"):
        ids.tolist()  # the one transfer a step makes
    with pytest.raises(RuntimeError):
        bool(logits[0, 0] > 0)  # what a host read inside the step would do


def test_to_device_on_the_cpu_is_torch_tensor() -> None:
    tensor = to_device([3, 1, 2], torch.device("cpu"))
    assert tensor.dtype == torch.int64 and tensor.tolist() == [3, 1, 2]
    assert to_device([0.5], torch.device("cpu"), torch.float32).dtype == torch.float32


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a CPU-only machine")
def test_cuda_without_a_gpu_is_refused_before_loading(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--device cuda: PyTorch .* sees no CUDA device"):
        check_device("cuda")
    with pytest.raises(ValueError, match="sees no CUDA device"):
        TorchBackend(EngineConfig(device="cuda", dtype="bfloat16", model_path=tmp_path))
    with pytest.raises(ValueError, match="--device 'gpu'"):
        check_device("gpu")
    check_device("cpu")


def test_kv_budget_must_fit_the_free_gpu_memory() -> None:
    check_kv_budget(80 << 30, 100 << 30, 0.85)
    with pytest.raises(ValueError, match=r"exceeds 0.85 of the .* use at most 91268055040"):
        check_kv_budget(90 << 30, 100 << 30, 0.85)
    with pytest.raises(ValueError, match="gpu-memory-fraction must be in"):
        check_kv_budget(1, 100, 0.0)


def test_cuda_picks_the_torch_attention_and_dense_weights() -> None:
    cuda = torch.device("cuda")
    assert resolve_attention_backend("auto", cuda, torch.bfloat16) == "torch"
    with pytest.raises(ValueError, match="fp32 on CPU only"):
        resolve_attention_backend("native", cuda, torch.bfloat16)
    assert auto_quantization("llama", "bfloat16", "cuda") == "none"
    assert auto_quantization("llama", "float32", "cuda") == "none"


def test_graphs_are_refused_off_cuda(model: LlamaModel) -> None:
    cache = PagedKVCache(model.config, 4, BLOCK, scratch_blocks=1)
    assert capture_refusal(model, cache) == ("CUDA graphs need a CUDA device, the KV cache "
                                             "is on cpu")
