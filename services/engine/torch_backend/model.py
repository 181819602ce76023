"""A Llama decoder in plain PyTorch, shaped for batched serving.

Architecture (Touvron et al., "LLaMA", 2023, arXiv:2302.13971): token embedding,
``num_layers`` pre-norm blocks of RMSNorm (Zhang & Sennrich, 2019) → grouped-query
attention (Ainslie et al., 2023, arXiv:2305.13245) with rotary position
embeddings (Su et al., "RoFormer", 2021, arXiv:2104.09864) → RMSNorm → SwiGLU MLP
(Shazeer, 2020, arXiv:2002.05202), a final RMSNorm and an LM head (tied to the
embedding when the checkpoint says so).

The forward pass takes the tokens of several sequences flattened into one
``[num_tokens]`` tensor with their ``[num_tokens]`` positions, and the step's
:class:`~services.engine.torch_backend.paged_kv.AttentionBatch` (which new
tokens go to which KV slots, and which blocks each sequence attends to).
Projections and the MLP run once over all tokens; attention runs in a few
batched groups over the paged KV cache. Q/K weights are in the Hugging Face
layout (see :func:`~services.engine.torch_backend.gguf_loader.unpermute_rope_rows`),
so RoPE uses the "rotate half" form.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.torch_backend.batch_invariant import Linear, select_linear
from services.engine.torch_backend.gguf_loader import LlamaConfig
from services.engine.torch_backend.paged_kv import AttentionBatch


def rope_tables(config: LlamaConfig, max_positions: int, device: torch.device | str,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine tables ``[max_positions, head_dim]`` of RoPE (computed in fp32).

    Frequency of pair ``i``: ``theta ** (-2i / head_dim)``; both halves of the
    head share a frequency ("rotate half" layout).
    """
    exponents = torch.arange(0, config.head_dim, 2, dtype=torch.int64).float() / config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(device, dtype), angles.sin().to(device, dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates ``x`` ``[num_tokens, heads, head_dim]`` by ``cos``/``sin``
    ``[num_tokens, 1, head_dim]`` ("rotate half": pairs ``(x[i], x[i + d/2])``)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of ``x`` ``[num_tokens, hidden]``, normalized in fp32."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return normed.to(x.dtype) * weight


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
        self.linear: Linear = F.linear

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention: AttentionBatch) -> torch.Tensor:
        """``hidden`` ``[num_tokens, hidden]`` → ``[num_tokens, hidden]``; writes this
        layer's new keys/values into the paged cache."""
        hidden = hidden + self._attention(rms_norm(hidden, self.input_norm, self.eps),
                                          cos, sin, attention)
        return hidden + self._mlp(rms_norm(hidden, self.post_attention_norm, self.eps))

    def _attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   attention: AttentionBatch) -> torch.Tensor:
        q, k, v = self.linear(x, self.qkv_proj).split(self.split, dim=-1)
        q = apply_rope(q.view(-1, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(-1, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = attention.attend(self.index, q, k, v, self.head_dim ** -0.5)
        return self.linear(out, self.o_proj)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.linear(x, self.gate_up_proj).chunk(2, dim=-1)
        return self.linear(F.silu(gate) * up, self.down_proj)


class LlamaModel(nn.Module):
    """The decoder. Build it, :meth:`load_weights`, move it with ``.to(device, dtype)``.

    Args:
      config: hyper-parameters (from the GGUF).
      max_positions: largest position + 1 the RoPE tables cover (the context window).
    """

    def __init__(self, config: LlamaConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.max_positions = max_positions or config.context_length
        self.embed_tokens = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = nn.Parameter(torch.empty(config.hidden_size))
        self.lm_head = (self.embed_tokens if config.tie_word_embeddings
                        else nn.Parameter(torch.empty(config.vocab_size, config.hidden_size)))
        cos, sin = rope_tables(config, self.max_positions, "cpu", torch.float32)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.linear: Linear = F.linear

    def select_kernels(self) -> None:
        """Picks the projection kernel for the model's device and dtype (see
        :func:`~services.engine.torch_backend.batch_invariant.select_linear`)."""
        self.linear = select_linear(self.embed_tokens.device, self.embed_tokens.dtype)
        for layer in self.layers:
            layer.linear = self.linear

    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copies HF-named weights (see ``GGUFModel``) into the fused parameters.

        Raises:
          KeyError: a needed tensor is missing.
        """
        with torch.no_grad():
            self.embed_tokens.copy_(state_dict["model.embed_tokens.weight"])
            self.norm.copy_(state_dict["model.norm.weight"])
            if not self.config.tie_word_embeddings:
                self.lm_head.copy_(state_dict["lm_head.weight"])
            for i, layer in enumerate(self.layers):
                _load_layer(layer, state_dict, f"model.layers.{i}.")

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor,
                attention: AttentionBatch, logits_indices: torch.Tensor) -> torch.Tensor:
        """One step over the flat batch.

        Args:
          token_ids: ``[num_rows]`` int64, the sequences' new tokens back to back
            (rows past ``attention.num_tokens`` are padding).
          positions: ``[num_rows]`` int64, each token's position in its sequence.
          attention: the step's attention plan over the paged KV cache.
          logits_indices: ``[num_logits]`` rows to compute logits for.

        Returns:
          logits ``[num_logits, vocab]`` in the model's dtype.
        """
        hidden = F.embedding(token_ids, self.embed_tokens)
        cos = self.rope_cos[positions].unsqueeze(1)
        sin = self.rope_sin[positions].unsqueeze(1)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, attention)
        hidden = rms_norm(hidden[logits_indices], self.norm, self.config.rms_norm_eps)
        return self.linear(hidden, self.lm_head)


def _load_layer(layer: DecoderLayer, state_dict: Mapping[str, torch.Tensor], prefix: str) -> None:
    attn, mlp = prefix + "self_attn.", prefix + "mlp."
    layer.input_norm.copy_(state_dict[prefix + "input_layernorm.weight"])
    layer.post_attention_norm.copy_(state_dict[prefix + "post_attention_layernorm.weight"])
    layer.qkv_proj.copy_(torch.cat([state_dict[attn + f"{n}_proj.weight"] for n in "qkv"]))
    layer.o_proj.copy_(state_dict[attn + "o_proj.weight"])
    layer.gate_up_proj.copy_(torch.cat(
        (state_dict[mlp + "gate_proj.weight"], state_dict[mlp + "up_proj.weight"])))
    layer.down_proj.copy_(state_dict[mlp + "down_proj.weight"])


def build_model(config: LlamaConfig, state_dict: Mapping[str, torch.Tensor],
                device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                max_positions: int | None = None) -> LlamaModel:
    """A ready, eval-mode model on ``device`` in ``dtype`` (RoPE tables are computed
    in fp32 and then cast to ``dtype``, as transformers does).

    Raises:
      KeyError: a needed tensor is missing from ``state_dict``.
    """
    model = LlamaModel(config, max_positions)
    model.load_weights(state_dict)
    model = model.to(device=device, dtype=dtype).eval()
    model.requires_grad_(False)
    model.select_kernels()
    return model
