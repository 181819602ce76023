"""Random-weight Llama checkpoints in the Hugging Face layout, for tests and GPU checks.

Two writers:

- :func:`save_tiny_llama`: ``transformers``' own ``LlamaForCausalLM(cfg).save_pretrained``
  (the reference layout; the model is materialized once, fine for test sizes).
- :func:`write_random_llama`: streams random tensors straight into safetensors
  shards, one decoder layer per shard, in the target dtype (bf16 by default), so
  an 8B-shaped checkpoint (``SHAPES["8b"]``: 16 GB in bf16) is never held in
  memory, not even once; ``config.json``, ``generation_config.json`` and
  ``model.safetensors.index.json`` are written as ``save_pretrained`` writes them.

Both can add the SmolLM2 tokenizer (vocabulary 49,152, ChatML template) read
from the default GGUF (:func:`save_smollm2_tokenizer`), so one directory serves
the tokenizer service and the engine.

Command line (for ``benchmarks/gpu_check.sh``)::

    python -m benchmarks.random_checkpoint OUT_DIR [--shape tiny|8b] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

#: Checkpoint shapes by name (``transformers.LlamaConfig`` keyword arguments).
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                 tie_word_embeddings=True),
    "8b": dict(vocab_size=49152, hidden_size=4096, intermediate_size=14336,
               num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
               tie_word_embeddings=False),
}
#: Standard deviation of the random weights: larger than transformers' default
#: 0.02 so that a tiny model's logits are well apart (greedy tokens are not
#: decided by rounding).
INIT_STD = 0.2


def llama_config(shape: str | dict[str, Any], **overrides: Any) -> Any:
    """A ``transformers.LlamaConfig`` of the named shape (or the given keyword
    arguments), with ``overrides``.

    Raises:
      KeyError: an unknown shape name.
    """
    from transformers import LlamaConfig

    kwargs = dict(SHAPES[shape] if isinstance(shape, str) else shape)
    kwargs.setdefault("initializer_range", INIT_STD)
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def save_tiny_llama(out: Path, shape: str | dict[str, Any] = "tiny", seed: int = 0,
                    max_shard_size: str | None = None, **overrides: Any) -> Path:
    """Writes ``LlamaForCausalLM(config)`` with random weights (``seed``) to ``out``
    by ``save_pretrained(out, safe_serialization=True)``, sharded at
    ``max_shard_size`` (e.g. ``"200KB"``) when given; returns ``out``."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(shape, **overrides))
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, safe_serialization=True, **kwargs)
    return Path(out)


def write_random_llama(out: Path, shape: str | dict[str, Any] = "8b",
                       dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                       **overrides: Any) -> Path:
    """Writes a random-weight Llama checkpoint to ``out`` one shard at a time
    (``model-00001-of-000NN.safetensors``: the embedding; one per decoder layer;
    the final norm and LM head), generating each tensor in ``dtype`` just before
    its shard is written; returns ``out``. Norm weights are 1, other weights
    normal with std :data:`INIT_STD` / sqrt(in_features / 64) (so activations
    stay in range at any width)."""
    config = llama_config(shape, **overrides)
    config.dtype = str(dtype).removeprefix("torch.")
    config.architectures = ["LlamaForCausalLM"]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim

    def weight(rows: int, cols: int) -> torch.Tensor:
        std = INIT_STD / max(cols / 64, 1.0) ** 0.5
        return (torch.randn(rows, cols, generator=generator) * std).to(dtype)

    num = config.num_hidden_layers + 2  # embedding, the layers, norm + head
    weight_map: dict[str, str] = {}
    total = 0
    for index in range(num):
        if index == 0:
            tensors = {"model.embed_tokens.weight": weight(config.vocab_size, hidden)}
        elif index == num - 1:
            tensors = {"model.norm.weight": torch.ones(hidden, dtype=dtype)}
            if not config.tie_word_embeddings:
                tensors["lm_head.weight"] = weight(config.vocab_size, hidden)
        else:
            p = f"model.layers.{index - 1}."
            tensors = {
                p + "input_layernorm.weight": torch.ones(hidden, dtype=dtype),
                p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=dtype),
                p + "self_attn.q_proj.weight": weight(q, hidden),
                p + "self_attn.k_proj.weight": weight(kv, hidden),
                p + "self_attn.v_proj.weight": weight(kv, hidden),
                p + "self_attn.o_proj.weight": weight(hidden, q),
                p + "mlp.gate_proj.weight": weight(inter, hidden),
                p + "mlp.up_proj.weight": weight(inter, hidden),
                p + "mlp.down_proj.weight": weight(hidden, inter),
            }
        name = f"model-{index + 1:05d}-of-{num:05d}.safetensors"
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        for key, tensor in tensors.items():
            weight_map[key] = name
            total += tensor.nbytes
        del tensors
    index_json = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2) + "\n")
    config.save_pretrained(out)
    from transformers import GenerationConfig

    GenerationConfig.from_model_config(config).save_pretrained(out)
    return out


def save_smollm2_tokenizer(out: Path) -> Path:
    """Saves SmolLM2's tokenizer (from the default GGUF, with its ChatML chat
    template) into ``out`` (``tokenizer.json``, ``tokenizer_config.json``…);
    returns ``out``. Its vocabulary (49,152) matches the shapes above."""
    from services.common.checkpoint import load_hf_tokenizer
    from services.common.model_files import default_model_path

    load_hf_tokenizer(default_model_path()).save_pretrained(out)
    return Path(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="directory to write")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-tokenizer", action="store_true",
                        help="do not add the SmolLM2 tokenizer")
    args = parser.parse_args(argv)
    write_random_llama(args.out, args.shape, getattr(torch, args.dtype), args.seed)
    if not args.no_tokenizer:
        save_smollm2_tokenizer(args.out)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
