"""``EngineConfig`` → the keyword arguments of ``tensorrt_llm.LLM(...)``.

Written against the LLM API's arguments (``TorchLlmArgs`` of the PyTorch
backend; reference https://nvidia.github.io/TensorRT-LLM/llm-api/reference.html,
``KvCacheConfig`` https://nvidia.github.io/TensorRT-LLM/llm-api/reference/KvCacheConfig.html,
source ``tensorrt_llm/llmapi/llm_args.py``) and its KV cache events example
(https://nvidia.github.io/TensorRT-LLM/examples/llm_inference_kv_events.html):

| LLM argument | from |
| --- | --- |
| ``model`` | ``--model-path`` (HF checkpoint directory or hub id) |
| ``skip_tokenizer_init=True`` | token ids in and out; the tokenizer service owns text |
| ``max_seq_len`` | the context window (``--max-model-len`` or the model's) |
| ``max_batch_size`` | ``--max-num-seqs`` |
| ``max_num_tokens`` | ``--max-num-batched-tokens`` (default 8192, the CUDA step budget) |
| ``dtype`` | ``--dtype`` |
| ``enable_chunked_prefill`` | ``--[no-]enable-chunked-prefill`` |
| ``kv_cache_config=KvCacheConfig(...)`` | ``enable_block_reuse`` = ``--enable-prefix-caching``; ``event_buffer_max_size`` = :data:`KV_EVENT_BUFFER` with block reuse (0: no events); ``free_gpu_memory_fraction`` = ``--gpu-memory-fraction``; ``tokens_per_block`` = ``--block-size`` |
| ``cuda_graph_config=CudaGraphConfig(...)`` | ``batch_sizes`` = ``EngineConfig.graph_batch_sizes()`` (``--cuda-graph-sizes``), ``enable_padding=True``; None with ``--enforce-eager`` (no CUDA graphs) |
| ``speculative_config`` | :mod:`.speculative_map` |
| ``guided_decoding_backend="xgrammar"`` | structured output (``GuidedDecodingParams``) needs a backend chosen at start |
| ``enable_iter_perf_stats=True`` | ``get_stats_async`` yields iteration stats only with it |

Pure: nested configs stay dicts; the backend builds ``KvCacheConfig`` and
``CudaGraphConfig`` from them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.engine.config import EngineConfig
from services.engine.tensorrt_llm_backend.speculative_map import (
    SpeculativeSpec,
    speculative_spec,
)

#: Events TensorRT-LLM buffers between two ``get_kv_cache_events_async``
#: reads (the torch block pool's bound too).
KV_EVENT_BUFFER = 100_000
#: The step token budget when ``--max-num-batched-tokens`` is unset (CUDA's).
DEFAULT_MAX_NUM_TOKENS = 8192


@dataclass(frozen=True)
class LlmSpec:
    """What the backend passes to ``LLM(...)``.

    Attributes:
      kwargs: plain keyword arguments.
      kv_cache_config: ``KvCacheConfig`` keyword arguments.
      cuda_graph_config: ``CudaGraphConfig`` keyword arguments; None: no CUDA graphs.
      speculative: the ``speculative_config`` to build, or None.
    """

    kwargs: dict[str, Any]
    kv_cache_config: dict[str, Any]
    cuda_graph_config: dict[str, Any] | None
    speculative: SpeculativeSpec | None


def llm_spec(config: EngineConfig, model_path: Path, max_seq_len: int) -> LlmSpec:
    """The ``LLM(...)`` arguments of ``config`` (see the module's table).

    Args:
      config: engine options.
      model_path: the checkpoint directory (or hub id) to serve.
      max_seq_len: the context window in tokens.

    Raises:
      ValueError: bad speculative options (:func:`.speculative_map.speculative_spec`).
    """
    kwargs = dict(
        model=str(model_path), skip_tokenizer_init=True, max_seq_len=max_seq_len,
        max_batch_size=config.max_num_seqs,
        max_num_tokens=config.max_num_batched_tokens or DEFAULT_MAX_NUM_TOKENS,
        dtype=config.dtype, enable_chunked_prefill=config.enable_chunked_prefill,
        guided_decoding_backend="xgrammar", enable_iter_perf_stats=True)
    kv_cache = dict(
        enable_block_reuse=config.enable_prefix_caching,
        event_buffer_max_size=KV_EVENT_BUFFER if config.enable_prefix_caching else 0,
        free_gpu_memory_fraction=config.gpu_memory_fraction,
        tokens_per_block=config.block_size)
    graphs = None if config.enforce_eager else dict(
        batch_sizes=list(config.graph_batch_sizes()), enable_padding=True)
    return LlmSpec(kwargs, kv_cache, graphs, speculative_spec(config))
