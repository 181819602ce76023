"""Rotary position embeddings (Su et al., "RoFormer", 2021, arXiv:2104.09864),
"rotate half" layout (the Hugging Face Llama form: pairs ``(x[i], x[i + d/2])``).

The tables are computed once per model (:func:`rope_tables`); the step's
attention plan (``paged_kv.AttentionBatch`` or the native kernel) rotates each
token's queries and new keys at its position.
"""

from __future__ import annotations

import math

import torch

from services.engine.torch_backend.llama_config import Llama3RopeScaling, LlamaConfig


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
    scaling = getattr(config, "rope_scaling", None)  # shape-only stand-ins have none
    if scaling is not None and theta is None:
        inv_freq = llama3_inv_freq(inv_freq, scaling)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32, device="cpu"),
                         inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(device, dtype), angles.sin().to(device, dtype)


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: Llama3RopeScaling) -> torch.Tensor:
    """``inv_freq`` ``[head_dim / 2]`` (fp32) with Llama 3.1's scaling: with
    ``L = original_max_position_embeddings`` and a pair's wavelength
    ``w = 2 pi / f``, a pair with ``w > L / low_freq_factor`` rotates ``factor``
    times slower, one with ``w < L / high_freq_factor`` is unchanged, and one in
    between blends the two, ``(1 - s) f / factor + s f`` with
    ``s = (L / w - low_freq_factor) / (high_freq_factor - low_freq_factor)``."""
    length = scaling.original_max_position_embeddings
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    wavelength = 2 * math.pi / inv_freq
    stretched = torch.where(wavelength > length / low, inv_freq / scaling.factor, inv_freq)
    blend = (length / wavelength - low) / (high - low)
    blended = (1 - blend) * stretched / scaling.factor + blend * stretched
    between = (wavelength >= length / high) & (wavelength <= length / low)
    return torch.where(between, blended, stretched)


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
