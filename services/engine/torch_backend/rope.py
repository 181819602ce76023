"""Rotary position embeddings (Su et al., "RoFormer", 2021, arXiv:2104.09864),
"rotate half" layout (the Hugging Face Llama form: pairs ``(x[i], x[i + d/2])``).

The tables are computed once per model (:func:`rope_tables`); the step's
attention plan (``paged_kv.AttentionBatch`` or the native kernel) rotates each
token's queries and new keys at its position.
"""

from __future__ import annotations

import torch

from services.engine.torch_backend.gguf_loader import LlamaConfig


def rope_tables(config: LlamaConfig, max_positions: int, device: torch.device | str,
                dtype: torch.dtype, theta: float | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine tables ``[max_positions, head_dim]`` of RoPE (computed in fp32).

    Frequency of pair ``i``: ``theta ** (-2i / head_dim)`` (``theta`` defaults to
    ``config.rope_theta``; Gemma 3's local layers pass their own base); both
    halves of the head share a frequency ("rotate half" layout).
    """
    # Computed on the CPU whatever the current default device (build_model makes
    # the model under ``torch.device(target)``), then moved: the same table everywhere.
    exponents = torch.arange(0, config.head_dim, 2, dtype=torch.int64,
                             device="cpu").float() / config.head_dim
    inv_freq = 1.0 / ((config.rope_theta if theta is None else theta) ** exponents)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32, device="cpu"),
                         inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(device, dtype), angles.sin().to(device, dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates ``x`` ``[num_tokens, heads, head_dim]`` by ``cos``/``sin``
    ``[num_tokens, 1, head_dim]`` ("rotate half": pairs ``(x[i], x[i + d/2])``)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` ``[..., head_dim]`` with its first half negated, for :func:`apply_rope_flipped`."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rope_flipped(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor
                       ) -> torch.Tensor:
    """:func:`apply_rope` in 4 kernels instead of 6, bit for bit: ``cat(-x2, x1) * sin``
    equals ``cat(x2, x1) * cat(-sin1, sin2)`` exactly (negation commutes with
    rounding), and ``cat(x2, x1)`` is one flip of the two halves.

    Args:
      x: ``[num_tokens, heads, head_dim]``.
      cos: ``[num_tokens, 1, head_dim]``.
      sin_signed: ``[num_tokens, 1, head_dim]`` from :func:`signed_sin`.
    """
    tokens, heads, dim = x.shape
    flipped = x.reshape(tokens, heads, 2, dim // 2).flip(2).view(tokens, heads, dim)
    return x * cos + flipped * sin_signed
