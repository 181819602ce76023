"""A Llama decoder in plain PyTorch, shaped for batched serving.

Architecture (Touvron et al., "LLaMA", 2023, arXiv:2302.13971): token embedding,
``num_layers`` pre-norm blocks of RMSNorm (Zhang & Sennrich, 2019) → grouped-query
attention (Ainslie et al., 2023, arXiv:2305.13245) with rotary position
embeddings (Su et al., "RoFormer", 2021, arXiv:2104.09864) → RMSNorm → SwiGLU MLP
(Shazeer, 2020, arXiv:2002.05202), a final RMSNorm and an LM head (tied to the
embedding when the checkpoint says so).

The forward pass takes the tokens of several sequences flattened into one
``[num_tokens]`` tensor with their ``[num_tokens]`` positions, and the step's
:class:`~services.engine.torch_backend.paged_kv.StepAttention` (which new
tokens go to which KV slots, and which blocks each sequence attends to).
Projections and the MLP run once over all tokens; attention runs in a few
batched groups over the paged KV cache. Q/K weights are in the Hugging Face
layout (see :func:`~services.engine.torch_backend.gguf_loader.unpermute_rope_rows`),
so RoPE uses the "rotate half" form.

Projections are callables (:mod:`~services.engine.torch_backend.quant`): dense
weights through the kernel :func:`~services.engine.torch_backend.batch_invariant.select_linear`
picks, or int4 / int8 weight-only quantized ones (:meth:`LlamaModel.quantize`)
that take bf16 activations. The forward is the same for every mode: the
residual stream, RMSNorm, RoPE and attention stay in the model's dtype (fp32
by default), and each projection's input is cast to the projection's
``input_dtype`` (a no-op for dense weights); its output joins the fp32 stream
by type promotion. A decode step is kept lean: Q and K are rotated in one
call, RoPE's "rotate half" is a flip of the two halves times a sign-folded
sine table (bit-identical to ``cat(-x2, x1) * sin``), and residual adds are
in place.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.torch_backend.batch_invariant import (
    Linear,
    PromptKernel,
    padded_linear_rows,
    select_linear,
    select_prompt_kernel,
)
from services.engine.torch_backend import native
from services.engine.torch_backend.gguf_loader import Q4_1Blocks
from services.engine.torch_backend.llama_config import LlamaConfig
from services.engine.torch_backend.paged_kv import LayerAttentionSpec, StepAttention
from services.engine.torch_backend.quant import (
    ACTIVATION_DTYPE,
    DenseProjection,
    Int8LMHead,
    Projection,
    check_mode,
    quantize_projection,
    resolve_quant_kernel,
)
from services.engine.torch_backend.rope import rope_tables, signed_sin


class StepAbandoned(Exception):
    """The forward stopped between two layers because its ``should_stop`` said so
    (every sequence of the step was cancelled). The step's new tokens have
    keys/values in some layers only: their KV slots hold nothing usable."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of ``x`` ``[num_tokens, hidden]``, normalized in fp32."""
    if x.dtype == torch.float32:  # one fused call; bit-identical to the form below
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return normed.to(x.dtype) * weight


#: Fused projection → the Hugging Face weights it concatenates (rows in this order).
PROJECTION_PARTS = {
    "qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "down_proj": ("mlp.down_proj",),
}


class DecoderLayer(nn.Module):
    """One pre-norm Llama block with fused QKV and gate/up projections."""

    def __init__(self, config: LlamaConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.eps = config.rms_norm_eps
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.input_norm = nn.Parameter(torch.empty(config.hidden_size))
        self.qkv_proj = nn.Parameter(torch.empty(q_size + 2 * kv_size, config.hidden_size))
        self.o_proj = nn.Parameter(torch.empty(config.hidden_size, q_size))
        self.post_attention_norm = nn.Parameter(torch.empty(config.hidden_size))
        self.gate_up_proj = nn.Parameter(
            torch.empty(2 * config.intermediate_size, config.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(config.hidden_size, config.intermediate_size))
        self.scale = self.head_dim ** -0.5
        self.qkv: Projection
        self.o: Projection
        self.gate_up: Projection
        self.down: Projection
        #: Prompt-token projections (dense bf16 copies of quantized weights), in
        #: forward order; None: every token takes the projections above.
        self.prompt_projections: tuple[Projection, Projection, Projection, Projection] | None = None
        self.bind_dense(F.linear)

    def bind_dense(self, kernel: Linear) -> None:
        """Applies the dense weights (the ``*_proj`` parameters) with ``kernel``."""
        self.qkv = DenseProjection(self.qkv_proj, kernel)
        self.o = DenseProjection(self.o_proj, kernel)
        self.gate_up = DenseProjection(self.gate_up_proj, kernel)
        self.down = DenseProjection(self.down_proj, kernel)

    @property
    def norms(self) -> tuple[torch.Tensor, ...]:
        """Every norm weight of the layer."""
        return self.input_norm, self.post_attention_norm

    @property
    def projections(self) -> tuple[Projection, ...]:
        """The four projections, in forward order."""
        return self.qkv, self.o, self.gate_up, self.down

    def forward(self, hidden: torch.Tensor, attention: StepAttention,
                num_generated_rows: int | None = None) -> torch.Tensor:
        """``hidden`` ``[num_tokens, hidden]`` (the model's dtype; updated in place and
        returned); ``attention`` rotates this layer's queries and new keys, writes
        the keys/values into the paged cache and attends.

        With :attr:`prompt_projections`, rows from ``num_generated_rows`` on are
        prompt tokens and take those (see :func:`project`); None: all rows
        take the main projections."""
        qkv_p = o_p = gate_up_p = down_p = None
        if self.prompt_projections is not None and num_generated_rows is not None:
            qkv_p, o_p, gate_up_p, down_p = self.prompt_projections
        split = num_generated_rows
        x = rms_norm(hidden, self.input_norm, self.eps)
        qkv = project(self.qkv, qkv_p, x.to(self.qkv.input_dtype), split)
        out = attention.attend(self.index, qkv, self.scale, self.o.input_dtype)
        hidden += project(self.o, o_p, out, split)
        x = rms_norm(hidden, self.post_attention_norm, self.eps)
        gate, up = project(self.gate_up, gate_up_p, x.to(self.gate_up.input_dtype),
                           split).chunk(2, dim=-1)
        hidden += project(self.down, down_p, F.silu(gate) * up, split)
        return hidden


    def forward_fused(self, hidden: torch.Tensor, pending: torch.Tensor | None,
                      attention: StepAttention, num_generated_rows: int | None = None
                      ) -> torch.Tensor:
        """:meth:`forward` with the native fused ops (fp32 ``hidden`` on CPU): the
        residual add, RMSNorm and cast in one call (:func:`native.add_rms_norm`),
        SiLU * up in one (:func:`native.silu_mul`). The MLP's output is not added
        here but returned, and the next layer adds it (``pending``; None for
        the first layer) together with its own norm; the caller adds the last."""
        qkv_p = o_p = gate_up_p = down_p = None
        if self.prompt_projections is not None and num_generated_rows is not None:
            qkv_p, o_p, gate_up_p, down_p = self.prompt_projections
        split = num_generated_rows
        x = native.add_rms_norm(hidden, pending, self.input_norm, self.eps, self.qkv.input_dtype)
        qkv = project(self.qkv, qkv_p, x, split)
        out = attention.attend(self.index, qkv, self.scale, self.o.input_dtype)
        o = project(self.o, o_p, out, split)
        x = native.add_rms_norm(hidden, o, self.post_attention_norm, self.eps,
                                self.gate_up.input_dtype)
        gate_up = project(self.gate_up, gate_up_p, x, split)
        return project(self.down, down_p, native.silu_mul(gate_up, self.down.input_dtype), split)


def project(main: Projection, prompt: Projection | None, x: torch.Tensor,
            num_generated_rows: int | None) -> torch.Tensor:
    """``x`` ``[rows, in]`` through ``main`` for its first ``num_generated_rows``
    rows (generated tokens) and through ``prompt`` for the rest (prompt tokens),
    ``[rows, out]``; all through ``main`` when ``prompt`` is None.

    Each token always takes the same kernel, whatever else is in the step, so
    rows stay batch-invariant: the quantized kernels are row-invariant at any
    row count, and the prompt kernel chosen for this CPU from 2 rows on (one
    row takes a GEMV path whose sums differ), so a single prompt row is
    computed as two (:func:`~services.engine.torch_backend.batch_invariant.prompt_rows`).
    """
    if prompt is None or num_generated_rows is None or num_generated_rows >= x.shape[0]:
        return main(x)
    prompt_rows = x[num_generated_rows:]
    if prompt_rows.shape[0] == 1:
        prompt_out = prompt(prompt_rows.expand(2, -1))[:1]
    else:
        prompt_out = prompt(prompt_rows)
    if num_generated_rows == 0:
        return prompt_out
    return torch.cat((main(x[:num_generated_rows]), prompt_out))


class LlamaModel(nn.Module):
    """The decoder. Build it, :meth:`load_weights`, move it with ``.to(device, dtype)``.

    Args:
      config: hyper-parameters (from the GGUF).
      max_positions: largest position + 1 the RoPE tables cover (the context window).
    """

    #: The decoder block (a subclass such as Gemma 3's swaps its own in).
    layer_class: type[DecoderLayer] = DecoderLayer

    def __init__(self, config: LlamaConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.max_positions = max_positions or config.context_length
        self.embed_tokens = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(self.layer_class(config, i)
                                    for i in range(config.num_layers))
        self.norm = nn.Parameter(torch.empty(config.hidden_size))
        self.lm_head = (self.embed_tokens if config.tie_word_embeddings
                        else nn.Parameter(torch.empty(config.vocab_size, config.hidden_size)))
        cos, sin = rope_tables(config, self.max_positions, "cpu", torch.float32)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.register_buffer("rope_sin_signed", signed_sin(sin), persistent=False)
        self.linear: Linear = F.linear
        self.quantization = "none"
        #: The quantized projections' and LM head's kernels (``native`` or
        #: ``torch``; None unless quantized).
        self.quant_kernel: str | None = None
        #: The dense prompt projections' kernel (``bf16`` or ``fp32``, see
        #: :meth:`add_prompt_projections`); None without them.
        self.prompt_kernel: str | None = None
        self.head: Projection = DenseProjection(self.lm_head, F.linear)

    def select_kernels(self) -> None:
        """Picks the projection kernel for the model's device and dtype (see
        :func:`~services.engine.torch_backend.batch_invariant.select_linear`) and
        binds the dense weights to it (quantized projections are kept)."""
        self.linear = select_linear(self.embed_tokens.device, self.embed_tokens.dtype)
        if self.quantization != "none":
            return
        for layer in self.layers:
            layer.bind_dense(self.linear)
        self.head = DenseProjection(self.lm_head, self.linear)

    def padded_rows(self, num_rows: int) -> int:
        """Rows to compute for ``num_rows`` token (or logit) rows so that no row's
        projection result depends on the count: the dense kernel's rule
        (:func:`~services.engine.torch_backend.batch_invariant.padded_linear_rows`);
        none for the quantized kernels, which are row-invariant at any count
        (``batch_invariant.probe`` checks it)."""
        if self.quantization != "none":
            return num_rows
        return padded_linear_rows(num_rows, self.linear)

    def quantize(self, mode: str, state_dict: Mapping[str, torch.Tensor],
                 q4_1: Mapping[str, Q4_1Blocks] | None = None, quant_kernel: str = "auto"
                 ) -> None:
        """Replaces every layer's projections with ``mode`` (``int4`` / ``int8``)
        ones built from Q4_1 blocks (``q4_1``, as they are for int4) or fp32
        weights (``state_dict``), and the LM head with int8 per-row weights of
        the (tied) head; frees the dense projection weights. Both run on
        ``quant_kernel`` (:func:`~services.engine.torch_backend.quant.resolve_quant_kernel`;
        :attr:`quant_kernel` holds the one in use).

        Raises:
          ValueError: unknown mode or kernel, ``native`` where it cannot be
            built, or the model is not fp32 on CPU.
          KeyError: a weight is in neither mapping.
        """
        check_mode(mode, self.embed_tokens.dtype, self.embed_tokens.device)
        kernel = resolve_quant_kernel(quant_kernel)
        q4_1 = q4_1 or {}
        with torch.no_grad():
            for i, layer in enumerate(self.layers):
                prefix = f"model.layers.{i}."
                for attr, parts in PROJECTION_PARTS.items():
                    names = [f"{prefix}{part}.weight" for part in parts]
                    if all(name in q4_1 for name in names):
                        projection = quantize_projection(
                            mode, None, Q4_1Blocks.cat([q4_1[name] for name in names]), kernel)
                    else:
                        projection = quantize_projection(mode, torch.cat(
                            [state_dict[name] if name in state_dict else q4_1[name].dequantize()
                             for name in names]), quant_kernel=kernel)
                    setattr(layer, attr.removesuffix("_proj"), projection)
                    setattr(layer, attr, nn.Parameter(torch.empty(0), requires_grad=False))
            self.head = Int8LMHead.from_dense(self.lm_head, kernel)
        self.quantization = mode
        self.quant_kernel = kernel

    def decode_weight_bytes(self) -> int:
        """Bytes of weights one decode step at batch 1 reads: every projection
        (with scales and zeros), the LM head, the norms; the embedding table only
        as the LM head (one row is gathered otherwise); not the KV cache."""
        total = self.head.nbytes + self.norm.nbytes
        for layer in self.layers:
            total += sum(p.nbytes for p in layer.projections)
            total += sum(norm.nbytes for norm in layer.norms)
        return total

    def load_weights(self, state_dict: Mapping[str, torch.Tensor],
                     projections: bool = True) -> None:
        """Copies HF-named weights (see ``GGUFModel``) into the fused parameters
        (without the layers' projections when ``projections`` is False: a
        quantized model gets them from :meth:`quantize`).

        Raises:
          KeyError: a needed tensor is missing.
        """
        with torch.no_grad():
            self.embed_tokens.copy_(state_dict["model.embed_tokens.weight"])
            self.norm.copy_(state_dict["model.norm.weight"])
            if not self.config.tie_word_embeddings:
                self.lm_head.copy_(state_dict["lm_head.weight"])
            for i, layer in enumerate(self.layers):
                _load_layer(layer, state_dict, f"model.layers.{i}.", projections)

    @property
    def layer_attention(self) -> tuple[LayerAttentionSpec, ...] | None:
        """Per-layer attention specs where layers attend differently (RoPE base,
        sliding window); None: every layer attends alike with :attr:`rope` (a
        Llama model), which the native attention kernel serves."""
        return None

    @property
    def rope(self) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables ``[max_positions, head_dim]``: cosine, and sine with its
        first half negated (:func:`~services.engine.torch_backend.rope.signed_sin`);
        the step's attention plan applies them."""
        return self.rope_cos, self.rope_sin_signed

    @property
    def has_prompt_projections(self) -> bool:
        """Prompt tokens take dense copies of the quantized projections
        (:meth:`add_prompt_projections`)."""
        return self.layers[0].prompt_projections is not None

    def add_prompt_projections(self, kernel: PromptKernel | None = None) -> None:
        """Gives a quantized model dense bf16 copies of its projections for prompt
        tokens (the weights as the quantized kernel sees them, rounded to bf16;
        +2 bytes per weight). Quantized kernels read fewer bytes, which is what
        decoding one token at a time waits for, but their cost grows with every
        row (``_weight_int4pack_mm_for_cpu`` dequantizes per row: 2.8 ms at 256
        rows against 1.0 ms for oneDNN's bf16 GEMM on a 3072x576 weight);
        prefill is many rows. A token keeps its role for life: prompt tokens
        (given by the client) always take these, generated tokens always the
        quantized kernels, so outputs stay batch-invariant; the prefix cache
        keeps the roles apart (``KVCacheManager(role_aware=True)``). The
        copies' kernel is chosen for this CPU
        (:func:`~services.engine.torch_backend.batch_invariant.select_prompt_kernel`,
        probed on layer 0's copies; :attr:`prompt_kernel` names it): bf16
        ``F.linear`` where it is row-invariant, else the same values in fp32
        (+4 bytes per weight) through oneDNN's fp32 kernel; ``kernel`` forces
        one (benchmarks; a kernel that is not invariant here breaks the
        engine's promise, and its start-up probe says so).

        Raises:
          ValueError: the model is not quantized.
        """
        if self.quantization == "none":
            raise ValueError("prompt projections are for quantized models")

        def copies(layer: DecoderLayer) -> list[torch.Tensor]:
            return [p.dequantize().to(ACTIVATION_DTYPE).contiguous() for p in layer.projections]

        with torch.no_grad():
            kernel = kernel or select_prompt_kernel(copies(self.layers[0]))
            for layer in self.layers:
                layer.prompt_projections = tuple(  # type: ignore[assignment]
                    DenseProjection(weight.to(kernel.weight_dtype), kernel.linear,
                                    ACTIVATION_DTYPE)
                    for weight in copies(layer))
        self.prompt_kernel = kernel.name

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, attention: StepAttention,
                logits_indices: torch.Tensor,
                num_generated_rows: int | None = None, fused: bool = False,
                should_stop: Callable[[], bool] | None = None) -> torch.Tensor:
        """One step over the flat batch.

        Args:
          token_ids: ``[num_rows]`` int64, the sequences' new tokens back to back
            (rows past ``attention.num_tokens`` are padding).
          attention: the step's attention plan over the paged KV cache (it knows
            each token's position and applies RoPE with :attr:`rope`).
          num_generated_rows: with prompt projections, the rows before this one
            are generated tokens and the rest prompt tokens (None: all rows
            take the main projections).
          fused: use the native fused norm/activation ops
            (:meth:`DecoderLayer.forward_fused`; fp32 on CPU, with the native
            attention backend).
          logits_indices: ``[num_logits]`` rows to compute logits for.
          should_stop: asked before each layer (cheap: once per layer); True
            abandons the forward (the engine's check that every sequence of the
            step was cancelled, so a cancel waits one layer, not one step).

        Returns:
          logits ``[num_logits, vocab]`` in the model's dtype.

        Raises:
          StepAbandoned: ``should_stop`` returned True.
        """
        hidden = F.embedding(token_ids, self.embed_tokens)
        if fused:
            pending = None
            for layer in self.layers:
                check_stop(should_stop)
                pending = layer.forward_fused(hidden, pending, attention, num_generated_rows)
            hidden += pending
        else:
            for layer in self.layers:
                check_stop(should_stop)
                hidden = layer.forward(hidden, attention, num_generated_rows)
        hidden = rms_norm(hidden[logits_indices], self.norm, self.config.rms_norm_eps)
        return self.head(hidden.to(self.head.input_dtype)).to(hidden.dtype)


def check_stop(should_stop: Callable[[], bool] | None) -> None:
    """Raises :class:`StepAbandoned` when ``should_stop`` (asked before each layer) says so."""
    if should_stop is not None and should_stop():
        raise StepAbandoned("every sequence of the step was cancelled")


def _load_layer(layer: DecoderLayer, state_dict: Mapping[str, torch.Tensor], prefix: str,
                projections: bool = True) -> None:
    layer.input_norm.copy_(state_dict[prefix + "input_layernorm.weight"])
    layer.post_attention_norm.copy_(state_dict[prefix + "post_attention_layernorm.weight"])
    if not projections:
        return
    for attr, parts in PROJECTION_PARTS.items():
        getattr(layer, attr).copy_(torch.cat([state_dict[f"{prefix}{part}.weight"]
                                              for part in parts]))


def build_model(config: LlamaConfig, state_dict: Mapping[str, torch.Tensor],
                device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                max_positions: int | None = None, quantization: str = "none",
                q4_1: Mapping[str, Q4_1Blocks] | None = None, quant_kernel: str = "auto"
                ) -> LlamaModel:
    """A ready, eval-mode model (:func:`model_class` of ``config``) on ``device`` in ``dtype`` (RoPE tables are computed
    in fp32 and then cast to ``dtype``, as transformers does; a dense model's
    parameters are created on ``device`` in ``dtype`` and filled from
    ``state_dict`` one tensor at a time, so a lazy mapping such as
    :class:`~services.engine.torch_backend.hf_loader.SafetensorsWeights` never
    holds the whole model on the host), its projections
    quantized per ``quantization`` (``none``, ``int8``, ``int4``; see
    :meth:`LlamaModel.quantize`, on ``quant_kernel``) from ``state_dict`` or the
    raw ``q4_1`` blocks.

    Raises:
      KeyError: a needed tensor is missing from ``state_dict`` (and ``q4_1``).
      ValueError: a quantized mode with a dtype other than fp32 or off the CPU,
        or a quantized kernel that cannot run.
    """
    if quantization != "none":
        check_mode(quantization, dtype, torch.device(device))
        model = model_class(config)(config, max_positions)
    else:  # parameters made on the device in the dtype: no fp32 host copy of the model
        with torch.device(device), default_dtype(dtype):
            model = model_class(config)(config, max_positions)
    model.load_weights(state_dict, projections=quantization == "none")
    model = model.to(device=device, dtype=dtype).eval()
    model.requires_grad_(False)
    model.select_kernels()
    if quantization != "none":
        model.quantize(quantization, state_dict, q4_1, quant_kernel)
    return model


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """``torch.get_default_dtype()`` is ``dtype`` inside the block (process-wide:
    the model is built on the engine thread before any request runs). The RoPE
    tables name fp32 explicitly, so they are still computed in fp32."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def model_class(config: LlamaConfig) -> type[LlamaModel]:
    """The model class of ``config.architecture``: :class:`LlamaModel`, or
    :class:`~services.engine.torch_backend.gemma3.Gemma3Model` for ``gemma3``."""
    if config.architecture == "gemma3":
        # Imported here: gemma3.py builds on this module.
        from services.engine.torch_backend.gemma3 import Gemma3Model
        return Gemma3Model
    return LlamaModel
