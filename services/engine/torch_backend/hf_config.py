"""Reads and checks a Hugging Face checkpoint's ``config.json`` into a
:class:`~services.engine.torch_backend.llama_config.LlamaConfig` (JSON only, no
torch): what the engine checks before it starts, and what
:mod:`~services.engine.torch_backend.hf_loader` builds the model from.
Supported and refused fields: see that module's docstring.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from services.common.checkpoint import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    check_architecture,
    checkpoint_eos_ids,
    read_json_object,
)
from services.engine.torch_backend.llama_config import Llama3RopeScaling, LlamaConfig

#: ``architectures`` entries this loader reads.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
#: Said with a refused architecture.
ARCHITECTURE_HINT = "Gemma 3 is served from its GGUF"


def read_hf_config(path: str | Path) -> LlamaConfig:
    """A :class:`LlamaConfig` from ``config.json`` (and the EOS ids of
    ``generation_config.json``) in the directory ``path``; ``name`` is the
    directory's name.

    Raises:
      FileNotFoundError: ``path`` is not a directory or has no ``config.json``.
      ValueError: invalid JSON; an architecture other than ``LlamaForCausalLM``;
        RoPE scaling, biases or an activation other than SiLU; a missing
        required field; no EOS id.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint directory at {path}")
    raw = read_json_object(path / CONFIG_FILE)
    check_architecture(raw, path / CONFIG_FILE, SUPPORTED_ARCHITECTURES,
                       hint=ARCHITECTURE_HINT)
    _refuse_unsupported(raw, path / CONFIG_FILE)
    hidden = int(_required(raw, "hidden_size", path))
    num_heads = int(_required(raw, "num_attention_heads", path))
    return LlamaConfig(
        name=path.name,
        hidden_size=hidden,
        num_layers=int(_required(raw, "num_hidden_layers", path)),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or hidden // num_heads),
        intermediate_size=int(_required(raw, "intermediate_size", path)),
        vocab_size=int(_required(raw, "vocab_size", path)),
        rope_theta=float(_rope_parameters(raw).get("rope_theta", 10000.0)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        context_length=int(_required(raw, "max_position_embeddings", path)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=None if raw.get("bos_token_id") is None else int(raw["bos_token_id"]),
        eos_token_ids=_eos_ids(path),
        rope_scaling=_rope_scaling(raw, path / CONFIG_FILE),
    )


def _required(raw: Mapping[str, Any], key: str, path: Path) -> Any:
    if raw.get(key) is None:
        raise ValueError(f"{path / CONFIG_FILE}: required field {key!r} is missing")
    return raw[key]


def _rope_parameters(raw: Mapping[str, Any]) -> dict[str, Any]:
    """RoPE settings: transformers 5's ``rope_parameters`` object, or the older
    top-level ``rope_theta`` / ``rope_scaling``."""
    params = dict(raw.get("rope_parameters") or {})
    if "rope_theta" not in params and raw.get("rope_theta") is not None:
        params["rope_theta"] = raw["rope_theta"]
    if raw.get("rope_scaling"):  # transformers 4: the scaling in its own object
        scaling = dict(raw["rope_scaling"])
        scaling.setdefault("rope_type", scaling.get("type"))
        params = {**scaling, **params}
    return params


def _rope_scaling(raw: Mapping[str, Any], file: Path) -> Llama3RopeScaling | None:
    """Llama 3.1's scaling from ``rope_parameters`` / ``rope_scaling``, or None.

    Raises:
      ValueError: a ``llama3`` entry without one of its four fields.
    """
    params = _rope_parameters(raw)
    if params.get("rope_type", "default") in (None, "default"):
        return None
    try:
        return Llama3RopeScaling(
            factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]))
    except KeyError as err:
        raise ValueError(f"{file}: rope_type 'llama3' needs {err.args[0]!r}") from None


def _refuse_unsupported(raw: Mapping[str, Any], file: Path) -> None:
    rope_type = _rope_parameters(raw).get("rope_type", "default")
    if rope_type not in (None, "default", "llama3"):
        raise ValueError(f"{file}: RoPE scaling {rope_type!r} is not supported (only "
                         "Llama 3.1's 'llama3')")
    for key in ("attention_bias", "mlp_bias"):
        if raw.get(key):
            raise ValueError(f"{file}: {key}=true is not supported (the model has no biases)")
    activation = raw.get("hidden_act", "silu")
    if activation != "silu":
        raise ValueError(f"{file}: hidden_act {activation!r} is not supported (SwiGLU with "
                         "SiLU only)")


def _eos_ids(path: Path) -> tuple[int, ...]:
    ids = checkpoint_eos_ids(path)
    if not ids:
        raise ValueError(f"{path}: no eos_token_id in {CONFIG_FILE} or {GENERATION_CONFIG_FILE}")
    return ids
