"""A Gemma 3 text decoder in plain PyTorch, on the Llama model's serving frame.

Architecture (Gemma Team, "Gemma 3 Technical Report", 2025, arXiv:2503.19786,
section 2; the reference for every detail below is transformers'
``models/gemma3/modeling_gemma3.py``, read, not copied):

- token embeddings scaled by ``sqrt(hidden_size)`` (in the model's dtype);
- per layer: RMSNorm → attention → RMSNorm → residual add, then RMSNorm →
  GeGLU MLP (``gelu_tanh(gate) * up``) → RMSNorm → residual add (pre- and
  post-norms around both sub-blocks);
- attention: grouped-query, queries and keys RMS-normalized per head
  (QK-norm, before RoPE), scores scaled by ``query_pre_attn_scalar ** -0.5``,
  no soft-capping;
- local/global layers 5:1: every 6th layer is global (full causal attention,
  RoPE base ``gemma3.rope.freq_base``, 1e6); the others see a sliding window of
  ``gemma3.attention.sliding_window`` keys with RoPE base 10,000;
- a final RMSNorm and the LM head tied to the embedding.

RMSNorm weights come from the GGUF with Gemma's ``+1`` already added (see
:mod:`~services.engine.torch_backend.gguf_loader`), so every norm here is the
plain ``x / rms(x) * w`` of :func:`~services.engine.torch_backend.model.rms_norm`,
computed in fp32 like HF's ``Gemma3RMSNorm``.

What it shares with :class:`~services.engine.torch_backend.model.LlamaModel`
(it is a subclass): the fused QKV / gate-up projections and their quantized
forms, kernel selection and batch-invariant padding, prompt projections, the
flat-token forward over the paged KV cache. What differs: the layer (below),
the embedding scale, and :attr:`Gemma3Model.layer_attention`, which tells the
model runner that local and global layers attend differently (the PyTorch
attention path, :class:`~services.engine.torch_backend.paged_kv.LayerwiseAttention`;
the native kernel has no window and serves only uniform models).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.torch_backend.gguf_loader import Gemma3Config
from services.engine.torch_backend.model import (
    DecoderLayer,
    LlamaModel,
    check_stop,
    project,
    rms_norm,
)
from services.engine.torch_backend.paged_kv import LayerAttentionSpec, StepAttention
from services.engine.torch_backend.rope import rope_tables, signed_sin


class Gemma3DecoderLayer(DecoderLayer):
    """One Gemma 3 block: the Llama layer's fused projections plus QK-norm and the
    post-attention, pre- and post-feedforward norms."""

    def __init__(self, config: Gemma3Config, index: int) -> None:
        super().__init__(config, index)
        self.q_norm = nn.Parameter(torch.empty(config.head_dim))
        self.k_norm = nn.Parameter(torch.empty(config.head_dim))
        #: Norm of the attention output (HF ``post_attention_layernorm``).
        self.post_attention_norm = nn.Parameter(torch.empty(config.hidden_size))
        self.pre_feedforward_norm = nn.Parameter(torch.empty(config.hidden_size))
        self.post_feedforward_norm = nn.Parameter(torch.empty(config.hidden_size))
        self.scale = config.query_pre_attn_scalar ** -0.5

    @property
    def norms(self) -> tuple[torch.Tensor, ...]:
        """Every norm weight of the layer."""
        return (self.input_norm, self.q_norm, self.k_norm, self.post_attention_norm,
                self.pre_feedforward_norm, self.post_feedforward_norm)

    def load_norms(self, state_dict: Mapping[str, torch.Tensor], prefix: str) -> None:
        """Copies the layer's norm weights (HF names under ``prefix``).

        Raises:
          KeyError: a norm is missing.
        """
        names = ("input_layernorm", "self_attn.q_norm", "self_attn.k_norm",
                 "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm")
        for norm, name in zip(self.norms, names, strict=True):
            norm.copy_(state_dict[f"{prefix}{name}.weight"])

    def qk_norm(self, qkv: torch.Tensor) -> torch.Tensor:
        """``qkv`` ``[rows, (heads + 2 kv_heads) * head_dim]`` with each query and
        key head RMS-normalized over ``head_dim`` (values untouched), as a new
        contiguous tensor of the same shape and dtype."""
        rows, dim = qkv.shape[0], self.head_dim
        q_size, kv_size, _ = self.split
        q = rms_norm(qkv[:, :q_size].reshape(rows, self.num_heads, dim), self.q_norm, self.eps)
        k = rms_norm(qkv[:, q_size:q_size + kv_size].reshape(rows, self.num_kv_heads, dim),
                     self.k_norm, self.eps)
        return torch.cat((q.reshape(rows, q_size).to(qkv.dtype),
                          k.reshape(rows, kv_size).to(qkv.dtype), qkv[:, q_size + kv_size:]),
                         dim=-1)

    def forward(self, hidden: torch.Tensor, attention: StepAttention,
                num_generated_rows: int | None = None) -> torch.Tensor:
        """``hidden`` ``[num_tokens, hidden]`` (the model's dtype; updated in place
        and returned); see :meth:`DecoderLayer.forward`."""
        qkv_p = o_p = gate_up_p = down_p = None
        if self.prompt_projections is not None and num_generated_rows is not None:
            qkv_p, o_p, gate_up_p, down_p = self.prompt_projections
        split = num_generated_rows
        x = rms_norm(hidden, self.input_norm, self.eps)
        qkv = self.qk_norm(project(self.qkv, qkv_p, x.to(self.qkv.input_dtype), split))
        out = attention.attend(self.index, qkv, self.scale, self.o.input_dtype)
        attended = project(self.o, o_p, out, split).to(hidden.dtype)
        hidden += rms_norm(attended, self.post_attention_norm, self.eps)
        x = rms_norm(hidden, self.pre_feedforward_norm, self.eps)
        gate, up = project(self.gate_up, gate_up_p, x.to(self.gate_up.input_dtype),
                           split).chunk(2, dim=-1)
        mlp = project(self.down, down_p, F.gelu(gate, approximate="tanh") * up, split)
        hidden += rms_norm(mlp.to(hidden.dtype), self.post_feedforward_norm, self.eps)
        return hidden

    def forward_fused(self, hidden: torch.Tensor, pending: torch.Tensor | None,
                      attention: StepAttention, num_generated_rows: int | None = None
                      ) -> torch.Tensor:
        """Not available: the native fused path is the Llama layer's (see
        :attr:`Gemma3Model.layer_attention`).

        Raises:
          NotImplementedError: always.
        """
        raise NotImplementedError("Gemma 3 runs on the PyTorch attention path only")


class Gemma3Model(LlamaModel):
    """The Gemma 3 decoder; build it with
    :func:`~services.engine.torch_backend.model.build_model` (which picks this
    class for a :class:`Gemma3Config`).

    Args:
      config: hyper-parameters (from the GGUF).
      max_positions: largest position + 1 the RoPE tables cover (two sets:
        global and local, ``[max_positions, head_dim]`` each).
    """

    layer_class = Gemma3DecoderLayer

    def __init__(self, config: Gemma3Config, max_positions: int | None = None) -> None:
        super().__init__(config, max_positions)
        cos, sin = rope_tables(config, self.max_positions, "cpu", torch.float32,
                               theta=config.rope_local_theta)
        self.register_buffer("rope_local_cos", cos, persistent=False)
        self.register_buffer("rope_local_sin_signed", signed_sin(sin), persistent=False)
        self.embed_scale = config.hidden_size ** 0.5

    @property
    def layer_attention(self) -> tuple[LayerAttentionSpec, ...]:
        """Per layer: local layers the local RoPE tables and the sliding window,
        global layers the global tables and full attention."""
        config: Gemma3Config = self.config  # type: ignore[assignment]
        local = LayerAttentionSpec((self.rope_local_cos, self.rope_local_sin_signed),
                                   config.sliding_window)
        global_ = LayerAttentionSpec(self.rope)
        return tuple(local if config.is_sliding(i) else global_
                     for i in range(len(self.layers)))

    def load_weights(self, state_dict: Mapping[str, torch.Tensor],
                     projections: bool = True) -> None:
        """See :meth:`LlamaModel.load_weights`; also the Gemma norms."""
        super().load_weights(state_dict, projections)
        with torch.no_grad():
            for i, layer in enumerate(self.layers):
                layer.load_norms(state_dict, f"model.layers.{i}.")

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, attention: StepAttention,
                logits_indices: torch.Tensor,
                num_generated_rows: int | None = None, fused: bool = False,
                should_stop: Callable[[], bool] | None = None) -> torch.Tensor:
        """See :meth:`LlamaModel.forward` (``fused`` must be False).

        Raises:
          StepAbandoned: ``should_stop`` returned True.
          NotImplementedError: ``fused``.
        """
        if fused:
            raise NotImplementedError("Gemma 3 runs on the PyTorch attention path only")
        hidden = F.embedding(token_ids, self.embed_tokens)
        hidden *= torch.tensor(self.embed_scale, dtype=hidden.dtype)
        for layer in self.layers:
            check_stop(should_stop)
            hidden = layer.forward(hidden, attention, num_generated_rows)
        hidden = rms_norm(hidden[logits_indices], self.norm, self.config.rms_norm_eps)
        return self.head(hidden.to(self.head.input_dtype)).to(hidden.dtype)
