"""A Llama decoder in plain PyTorch, shaped for batched serving.

Architecture (Touvron et al., "LLaMA", 2023, arXiv:2302.13971): token embedding,
``num_layers`` pre-norm blocks of RMSNorm (Zhang & Sennrich, 2019) → grouped-query
attention (Ainslie et al., 2023, arXiv:2305.13245) with rotary position
embeddings (Su et al., "RoFormer", 2021, arXiv:2104.09864) → RMSNorm → SwiGLU MLP
(Shazeer, 2020, arXiv:2002.05202), a final RMSNorm and an LM head (tied to the
embedding when the checkpoint says so).

The forward pass takes the tokens of several sequences flattened into one
``[num_tokens]`` tensor with their ``[num_tokens]`` positions, and one
:class:`SequenceSlice` per sequence saying where its tokens sit in the flat
batch and in its KV cache. Projections and the MLP run once over all tokens;
only attention runs per sequence. Q/K weights are in the Hugging Face layout
(see :func:`~services.engine.torch_backend.gguf_loader.unpermute_rope_rows`),
so RoPE uses the "rotate half" form.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.torch_backend.gguf_loader import LlamaConfig


@dataclass
class KVCache:
    """Contiguous key/value cache of one sequence.

    Attributes:
      k: keys ``[num_layers, num_kv_heads, capacity, head_dim]``.
      v: values, same shape.
    """

    k: torch.Tensor
    v: torch.Tensor

    @property
    def capacity(self) -> int:
        """Most tokens this cache holds."""
        return int(self.k.shape[2])


@dataclass(frozen=True)
class SequenceSlice:
    """Where one sequence's new tokens sit.

    Attributes:
      cache: the sequence's KV cache.
      start: tokens of this sequence already in the cache (= position of its first new token).
      num_tokens: new tokens of this sequence in the flat batch (they follow the
        previous slice's tokens).
    """

    cache: KVCache
    start: int
    num_tokens: int


def allocate_kv_cache(config: LlamaConfig, capacity: int, device: torch.device | str,
                      dtype: torch.dtype) -> KVCache:
    """An uninitialized cache for ``capacity`` tokens (bytes: 2 · layers · kv_heads ·
    capacity · head_dim · itemsize)."""
    shape = (config.num_layers, config.num_kv_heads, capacity, config.head_dim)
    return KVCache(k=torch.empty(shape, device=device, dtype=dtype),
                   v=torch.empty(shape, device=device, dtype=dtype))


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

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                slices: Sequence[SequenceSlice]) -> torch.Tensor:
        """``hidden`` ``[num_tokens, hidden]`` → ``[num_tokens, hidden]``; writes this
        layer's new keys/values into each slice's cache."""
        hidden = hidden + self._attention(rms_norm(hidden, self.input_norm, self.eps),
                                          cos, sin, slices)
        return hidden + self._mlp(rms_norm(hidden, self.post_attention_norm, self.eps))

    def _attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   slices: Sequence[SequenceSlice]) -> torch.Tensor:
        q, k, v = F.linear(x, self.qkv_proj).split(self.split, dim=-1)
        q = apply_rope(q.view(-1, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(-1, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = torch.empty_like(q)
        offset = 0
        for piece in slices:
            end = offset + piece.num_tokens
            out[offset:end] = self._sequence_attention(q[offset:end], k[offset:end],
                                                       v[offset:end], piece)
            offset = end
        return F.linear(out.view(x.shape[0], -1), self.o_proj)

    def _sequence_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            piece: SequenceSlice) -> torch.Tensor:
        """Causal attention of one sequence's new queries ``[n, heads, head_dim]``
        over its cached and new keys/values."""
        start, end = piece.start, piece.start + piece.num_tokens
        k_cache, v_cache = piece.cache.k[self.index], piece.cache.v[self.index]
        k_cache[:, start:end] = k.transpose(0, 1)
        v_cache[:, start:end] = v.transpose(0, 1)
        mask, causal = None, False
        if piece.num_tokens > 1 and start == 0:
            causal = True
        elif piece.num_tokens > 1:
            mask = _offset_causal_mask(start, piece.num_tokens, q.device)
        attended = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k_cache[:, :end].unsqueeze(0),
            v_cache[:, :end].unsqueeze(0), attn_mask=mask, is_causal=causal, enable_gqa=True)
        return attended[0].transpose(0, 1)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj)


def _offset_causal_mask(start: int, num_tokens: int, device: torch.device) -> torch.Tensor:
    """``[num_tokens, start + num_tokens]`` bool mask: query ``i`` (position
    ``start + i``) sees keys at positions ``<= start + i``."""
    query_pos = torch.arange(start, start + num_tokens, device=device)[:, None]
    key_pos = torch.arange(start + num_tokens, device=device)[None, :]
    return key_pos <= query_pos


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
                slices: Sequence[SequenceSlice],
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """One step over the flat batch.

        Args:
          token_ids: ``[num_tokens]`` int64, the sequences' new tokens back to back.
          positions: ``[num_tokens]`` int64, each token's position in its sequence.
          slices: one per sequence, in the order of its tokens in ``token_ids``.
          logits_indices: ``[num_tokens_to_sample]`` rows of the batch to compute
            logits for; default the last new token of each sequence.

        Returns:
          logits ``[num_tokens_to_sample, vocab]`` in the model's dtype.
        """
        if logits_indices is None:
            logits_indices = _last_token_indices(slices, token_ids.device)
        hidden = F.embedding(token_ids, self.embed_tokens)
        cos = self.rope_cos[positions].unsqueeze(1)
        sin = self.rope_sin[positions].unsqueeze(1)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, slices)
        hidden = rms_norm(hidden[logits_indices], self.norm, self.config.rms_norm_eps)
        return F.linear(hidden, self.lm_head)


def _last_token_indices(slices: Sequence[SequenceSlice], device: torch.device) -> torch.Tensor:
    ends, total = [], 0
    for piece in slices:
        total += piece.num_tokens
        ends.append(total - 1)
    return torch.tensor(ends, dtype=torch.int64, device=device)


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
    return model
