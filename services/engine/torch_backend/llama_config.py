"""A Llama decoder's hyper-parameters, as both loaders (GGUF and Hugging Face
checkpoint) give them. Imports no torch: start-up checks read configs before
the engine's heavy modules load."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's RoPE frequency scaling (HF ``rope_type: llama3``; Meta's
    reference ``apply_scaling``; Llama Team, "The Llama 3 Herd of Models", 2024,
    arXiv:2407.21783): wavelengths longer than
    ``original_max_position_embeddings / low_freq_factor`` are stretched by
    ``factor``, those shorter than ``... / high_freq_factor`` kept, and the ones
    between interpolated (see :func:`~services.engine.torch_backend.rope.llama3_inv_freq`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a Llama decoder (Touvron et al., 2023, arXiv:2302.13971).

    Attributes:
      name: model name from ``general.name`` (or the file stem).
      hidden_size: width of the residual stream.
      num_layers: decoder blocks.
      num_heads: query heads.
      num_kv_heads: key/value heads (grouped-query attention when < num_heads).
      head_dim: width of one head.
      intermediate_size: SwiGLU hidden width.
      vocab_size: number of token ids.
      rope_theta: RoPE base frequency (Su et al., 2021, arXiv:2104.09864).
      rms_norm_eps: epsilon of RMSNorm.
      context_length: training context window in tokens.
      tie_word_embeddings: the LM head reuses the token embedding matrix.
      bos_token_id: beginning-of-sequence id, or None.
      eos_token_ids: ids that end generation.
      rope_scaling: Llama 3.1's RoPE scaling, or None (unscaled; every GGUF
        read here: GGUFs with scaling are refused).
    """

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    context_length: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    rope_scaling: Llama3RopeScaling | None = field(default=None, kw_only=True)

    @property
    def architecture(self) -> str:
        """``general.architecture`` of the file: ``llama``."""
        return "llama"

    @property
    def uniform_attention(self) -> bool:
        """Every layer attends to its whole context with one RoPE table (True for
        Llama); the native attention kernel serves only such models."""
        return True
