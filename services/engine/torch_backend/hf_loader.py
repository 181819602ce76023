"""Reads a Hugging Face checkpoint directory (``config.json`` + safetensors) into
the config and weights the GGUF loader gives (:mod:`~services.engine.torch_backend.gguf_loader`).

A directory as ``save_pretrained(dir, safe_serialization=True)`` writes it:
``config.json`` with ``architectures: ["LlamaForCausalLM"]``, the weights in
``model.safetensors`` or in shards ``model-0000K-of-0000N.safetensors`` listed
by ``model.safetensors.index.json`` (``weight_map``: tensor name → file), and
optionally ``generation_config.json`` (more EOS ids). The tensor names are
already the Hugging Face ones the model loads (``model.layers.{i}.self_attn.q_proj.weight``
…), and Q/K rows are already in the "rotate half" layout the model's RoPE
expects, so nothing is permuted (only GGUF files need
:func:`~services.engine.torch_backend.gguf_loader.unpermute_rope_rows`).

Weights are read lazily: :class:`SafetensorsWeights` opens each file with
``safetensors.safe_open`` (memory-mapped) and reads one tensor when the model
copies it, cast to the requested dtype, so at most one tensor (plus a fused
projection's parts) is held outside the model at a time, whatever the
checkpoint's size.

Supported: ``LlamaForCausalLM`` (grouped-query attention, tied or untied LM
head, ``rope_theta`` at the top level or in transformers 5's
``rope_parameters``, Llama 3.1's ``llama3`` RoPE scaling, ``rms_norm_eps``,
``head_dim``). Refused with a ValueError naming the field: other
architectures, other RoPE scalings (``linear``, ``dynamic``, ``yarn``…),
attention or MLP biases, an activation other than SiLU.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from services.common.checkpoint import CONFIG_FILE, WEIGHTS_FILE, check_weight_files
from services.engine.torch_backend.hf_config import SUPPORTED_ARCHITECTURES, read_hf_config
from services.engine.torch_backend.llama_config import LlamaConfig


class SafetensorsWeights(Mapping[str, torch.Tensor]):
    """The checkpoint's tensors by name, read on access from memory-mapped
    safetensors files, cast to ``dtype``.

    Args:
      files: tensor name → safetensors file holding it.
      dtype: dtype of the returned tensors (the model's; fp32 for quantizing).
    """

    def __init__(self, files: Mapping[str, Path], dtype: torch.dtype) -> None:
        self._files = dict(files)
        self._dtype = dtype
        self._handles: dict[Path, Any] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        """The tensor ``name`` on the CPU in the mapping's dtype.

        Raises:
          KeyError: the checkpoint has no such tensor.
          ValueError: its file is not valid safetensors (named).
        """
        file = self._files[name]
        try:
            return self._handle(file).get_tensor(name).to(self._dtype)
        except SafetensorError as err:
            raise ValueError(f"{file}: cannot read tensor {name} ({err})") from None

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of the tensor ``name`` (its file's header only).

        Raises:
          KeyError: the checkpoint has no such tensor.
          ValueError: its file is not valid safetensors, e.g. truncated (named).
        """
        file = self._files[name]
        try:
            return tuple(self._handle(file).get_slice(name).get_shape())
        except SafetensorError as err:
            raise ValueError(f"{file}: cannot read tensor {name} ({err})") from None

    def _handle(self, file: Path) -> Any:
        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles[file] = _safe_open(file)
        return handle

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


@dataclass
class HFCheckpoint:
    """A checkpoint read by :func:`load_hf_checkpoint`: its config and its lazily
    read weights (keys as in :class:`~services.engine.torch_backend.gguf_loader.GGUFModel`)."""

    config: LlamaConfig
    state_dict: SafetensorsWeights


def load_hf_checkpoint(path: str | Path, dtype: torch.dtype = torch.float32) -> HFCheckpoint:
    """The config and weights (read lazily, cast to ``dtype``) of the checkpoint
    directory ``path``.

    Raises:
      FileNotFoundError: no directory, no ``config.json``, no safetensors file
        (``model.safetensors`` or ``model.safetensors.index.json``), or a shard
        the index names is missing.
      ValueError: see :func:`read_hf_config`; a malformed index; a tensor the
        model needs is in no file (named); a file that is not valid
        safetensors, e.g. truncated (named); a tensor whose stored shape is not
        the one ``config.json`` gives it (named, with both shapes). Only the
        files' headers are read for these checks.
    """
    path = Path(path)
    config = read_hf_config(path)
    files = tensor_files(path)
    expected = expected_shapes(config)
    missing = [name for name in expected if name not in files]
    if missing:
        raise ValueError(f"{path}: the checkpoint lacks {len(missing)} tensor(s) a "
                         f"{SUPPORTED_ARCHITECTURES[0]} needs, e.g. {missing[:3]}")
    weights = SafetensorsWeights(files, dtype)
    for name, shape in expected.items():
        found = weights.shape(name)
        if found != shape:
            raise ValueError(f"{files[name]}: tensor {name} has shape {list(found)}, but "
                             f"{path / CONFIG_FILE} gives it {list(shape)}")
    return HFCheckpoint(config, weights)


def tensor_files(path: Path) -> dict[str, Path]:
    """Tensor name → safetensors file of the checkpoint in ``path``: every tensor
    of ``model.safetensors``, or the index's ``weight_map`` (sharded).

    Raises:
      FileNotFoundError: neither file, or a shard named by the index is missing.
      ValueError: an index without a ``weight_map`` object; a
        ``model.safetensors`` that is not valid safetensors (named).
    """
    files = check_weight_files(path)
    if files is not None:
        return files
    single = path / WEIGHTS_FILE
    with _safe_open(single) as handle:
        return {name: single for name in handle.keys()}


def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """The HF tensors a model of ``config`` loads, with the shape each must have."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_rows, kv_rows = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    per_layer = {"input_layernorm": (hidden,), "post_attention_layernorm": (hidden,),
                 "self_attn.q_proj": (q_rows, hidden), "self_attn.k_proj": (kv_rows, hidden),
                 "self_attn.v_proj": (kv_rows, hidden), "self_attn.o_proj": (hidden, q_rows),
                 "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
                 "mlp.down_proj": (hidden, inter)}
    for i in range(config.num_layers):
        shapes.update({f"model.layers.{i}.{part}.weight": shape
                       for part, shape in per_layer.items()})
    return shapes


def _safe_open(file: Path) -> Any:
    """``safe_open(file)`` (memory-mapped, header read).

    Raises:
      ValueError: not valid safetensors, e.g. a truncated file (named).
    """
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except SafetensorError as err:
        raise ValueError(f"{file}: not a valid safetensors file ({err}); re-copy or "
                         "re-save the checkpoint") from None


