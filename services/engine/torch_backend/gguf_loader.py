"""Reads a Llama- or Gemma-3-architecture GGUF file into a config and a PyTorch state dict.

Every hyper-parameter comes from the file's metadata (``{arch}.block_count``,
``{arch}.rope.freq_base``, ``tokenizer.ggml.eos_token_id`` …); quantized tensors
(Q4_1, Q8_0, K-quants …) are dequantized with ``gguf.quants.dequantize``, or,
on request, Q4_1 matrices are kept as their raw blocks (:class:`Q4_1Blocks`:
scale ``d``, minimum ``m`` and 4-bit values ``q``) for the int4 kernels
(``quant.py``), which take them without any loss in ``q``.

llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` so that its
RoPE kernel can rotate adjacent pairs ``(x[2i], x[2i+1])``. We undo that
permutation here, so the weights are in the Hugging Face layout and the model
uses the "rotate half" form of RoPE (pairs ``(x[i], x[i + d/2])``). The test
``tests/engine/test_engine_model.py`` proves the two agree with transformers.

Gemma 3 files (``general.architecture = gemma3``) read into a
:class:`Gemma3Config`; their Q/K rows are not permuted (llama.cpp rotates
Gemma with the "NeoX" pairs ``(x[i], x[i + d/2])``, the HF layout already),
and their RMSNorm weights are kept as stored: llama.cpp's converter
(``convert_hf_to_gguf.py``, ``Gemma3Model.modify_tensors``) already added the
1 of Gemma's ``x * (1 + w)`` norm, so the stored weight is the multiplier
(transformers' GGUF reader subtracts it again, ``Gemma2TensorProcessor``).
``tests/engine/test_gemma3.py`` checks the model against transformers.
"""

from __future__ import annotations

import dataclasses
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import torch

from services.common.checkpoint import GGUF_ARRAY, GGUF_SCALAR_BYTES, GGUF_STRING
from services.engine.torch_backend.llama_config import LlamaConfig


@dataclass(frozen=True)
class Gemma3Config(LlamaConfig):
    """Hyper-parameters of a Gemma 3 text decoder (Gemma Team, "Gemma 3 Technical
    Report", 2025, arXiv:2503.19786, section 2; HF ``Gemma3TextConfig``).

    ``rope_theta`` is the global layers' RoPE base (``gemma3.rope.freq_base``)
    and ``head_dim`` is ``gemma3.attention.key_length`` (256 for 270M, not
    hidden / heads).

    Attributes:
      sliding_window: keys a local layer's query sees, itself included: query
        ``i`` attends to keys ``j`` with ``i - window < j <= i``
        (``gemma3.attention.sliding_window``; transformers' ``sliding_window_overlay``).
      sliding_window_pattern: every this-many-th layer (``(i + 1) % pattern == 0``)
        is global; the others are local (5:1 in the report).
      rope_local_theta: RoPE base of the local layers (10,000 in the report;
        not stored in the GGUF, llama.cpp hard-codes it too).
      query_pre_attn_scalar: attention scores are scaled by its ``-1/2`` power
        (HF ``query_pre_attn_scalar``; 256 = head_dim for 270M; llama.cpp uses
        ``1/sqrt(head_dim)`` for every size but 27B, which is all this reader
        can know from the file).
    """

    sliding_window: int
    sliding_window_pattern: int
    rope_local_theta: float
    query_pre_attn_scalar: float

    @property
    def architecture(self) -> str:
        """``gemma3``."""
        return "gemma3"

    @property
    def uniform_attention(self) -> bool:
        """False: local layers have a sliding window and their own RoPE base."""
        return False

    def is_sliding(self, layer: int) -> bool:
        """Whether ``layer`` (0-based) is a local sliding-window layer."""
        return (layer + 1) % self.sliding_window_pattern != 0


#: Gemma 3's layer pattern and local RoPE base (arXiv:2503.19786, section 2.2;
#: HF ``Gemma3TextConfig`` defaults), which the GGUF does not store.
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_ROPE_LOCAL_THETA = 10_000.0


@dataclass
class GGUFModel:
    """A loaded GGUF: its config and fp32 tensors keyed by Hugging Face names.

    Keys: ``model.embed_tokens.weight`` ``[vocab, hidden]``, ``model.norm.weight``,
    ``lm_head.weight`` (only when not tied), and per layer ``i``
    ``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight``,
    ``model.layers.{i}.mlp.{gate,up,down}_proj.weight``,
    ``model.layers.{i}.{input,post_attention}_layernorm.weight``.
    Linear weights are ``[out_features, in_features]``. Gemma 3 adds per layer
    ``self_attn.{q,k}_norm.weight`` ``[head_dim]`` and
    ``{pre,post}_feedforward_layernorm.weight``; its ``post_attention_layernorm``
    normalizes the attention output (Llama's normalizes the MLP input).
    """

    config: LlamaConfig | Gemma3Config
    state_dict: dict[str, torch.Tensor]
    q4_1: dict[str, Q4_1Blocks] = field(default_factory=dict)


#: Values per Q4_1 block (ggml's ``QK4_1``).
Q4_1_BLOCK = 32


@dataclass(frozen=True)
class Q4_1Blocks:
    """A ``[rows, cols]`` matrix stored as ggml Q4_1 blocks, not dequantized.

    ggml's ``block_q4_1`` (``ggml-common.h``): 32 consecutive values of a row,
    an fp16 scale ``d``, an fp16 minimum ``m`` and 16 bytes of 4-bit values
    (byte ``j`` holds value ``j`` in its low nibble and value ``j + 16`` in its
    high nibble). Value ``c`` of row ``r`` is ``d[r, c // 32] * q[r, c] + m[r, c // 32]``
    (computed in fp32, as ``gguf.quants`` and llama.cpp dequantize it).

    Attributes:
      d: ``[rows, cols / 32]`` float16 scales.
      m: ``[rows, cols / 32]`` float16 minimums.
      q: ``[rows, cols]`` uint8 values in ``0..15``.
    """

    d: torch.Tensor
    m: torch.Tensor
    q: torch.Tensor

    @classmethod
    def from_tensor(cls, tensor: gguf.ReaderTensor) -> Q4_1Blocks:
        """Splits a Q4_1 tensor's bytes ``[rows, cols / 32 * 20]`` into ``d``, ``m``, ``q``.

        Raises:
          ValueError: the tensor is not a Q4_1 matrix.
        """
        if tensor.tensor_type != gguf.GGMLQuantizationType.Q4_1 or len(tensor.shape) != 2:
            raise ValueError(f"{tensor.name} is {tensor.tensor_type.name} "
                             f"{list(tensor.shape)}, not a Q4_1 matrix")
        cols, rows = (int(n) for n in tensor.shape)
        blocks = np.asarray(tensor.data).reshape(rows, cols // Q4_1_BLOCK, 20)
        d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0]
        m = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0]
        packed = blocks[..., 4:]
        q = np.concatenate((packed & 0x0F, packed >> 4), axis=-1).reshape(rows, cols)
        return cls(torch.from_numpy(np.ascontiguousarray(d)),
                   torch.from_numpy(np.ascontiguousarray(m)), torch.from_numpy(q))

    @property
    def shape(self) -> tuple[int, int]:
        """``(rows, cols)`` of the matrix."""
        return int(self.q.shape[0]), int(self.q.shape[1])

    def dequantize(self) -> torch.Tensor:
        """The matrix ``[rows, cols]`` in fp32, bit for bit as ``gguf.quants`` gives it."""
        rows, cols = self.shape
        values = self.q.view(rows, cols // Q4_1_BLOCK, Q4_1_BLOCK).float()
        return (self.d.float()[..., None] * values + self.m.float()[..., None]).view(rows, cols)

    def permute_rows(self, num_heads: int) -> Q4_1Blocks:
        """The same blocks with :func:`unpermute_rope_rows` applied to the rows
        (a row permutation: every row keeps its blocks)."""
        d, m, q = (torch.from_numpy(unpermute_rope_rows(t.numpy(), num_heads))
                   for t in (self.d, self.m, self.q))
        return Q4_1Blocks(d, m, q)

    @staticmethod
    def cat(parts: list[Q4_1Blocks]) -> Q4_1Blocks:
        """Row-wise concatenation (fused projections)."""
        return Q4_1Blocks(torch.cat([p.d for p in parts]), torch.cat([p.m for p in parts]),
                          torch.cat([p.q for p in parts]))


_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
#: Gemma 3's per-layer tensors (llama.cpp ``LLM_ARCH_GEMMA3``) → HF names.
_GEMMA3_LAYER_NAMES = {
    **{k: v for k, v in _LAYER_NAMES.items() if k != "ffn_norm"},
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


class PlainArrayReader(gguf.GGUFReader):
    """``gguf.GGUFReader`` over a plain ``numpy.ndarray`` view of its memory map.

    The reader slices ``self.data`` once per metadata item and per tensor;
    on a ``numpy.memmap`` each slice runs ``memmap.__getitem__`` and
    ``__array_finalize__`` in Python (~1.2 million calls for SmolLM2's 49k-token
    vocabulary and its merges). A base-class view of the same mapping reads the
    same bytes without them: the reader's construction drops from ~3-4 s to
    ~1 s here, and dequantizing the tensors (whose ``data`` are then plain
    views too) halves. The mapping stays alive as the view's base.

    Metadata arrays are walked over, not read, and left out of ``fields``: the
    engine reads scalars only (the vocabulary and merges are the tokenizer's,
    which reads them with its own reader). The base reader makes one numpy
    view per array element, ~150,000 for SmolLM2's tokens, token types and
    merges (0.66 s of every engine start here; skipped: ~0.03 s).
    """

    def __init__(self, path: str) -> None:
        super().__init__(path)
        for name in [name for name, field in self.fields.items()
                     if field.types[:1] == [gguf.GGUFValueType.ARRAY]]:
            del self.fields[name]

    @property
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, mapped: np.ndarray) -> None:
        self._plain_data = mapped.view(np.ndarray)

    def _get_field_parts(self, orig_offs: int, raw_type: int
                         ) -> tuple[int, list[np.ndarray], list[int], list[gguf.GGUFValueType]]:
        """The base reader's parts of one value, except that an array (item type,
        count, items) is walked over: its size, and no data parts."""
        if raw_type != gguf.GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        head = [self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)]
        end = self._skip_items(orig_offs + 12, int(head[0][0]), int(head[1][0]))
        return end - orig_offs, head, [], [gguf.GGUFValueType.ARRAY]

    def _skip_items(self, offs: int, raw_itype: int, count: int) -> int:
        """The offset after ``count`` array items of type ``raw_itype`` at ``offs``.

        Raises:
          ValueError: an item type the GGUF spec does not define.
        """
        if raw_itype in GGUF_SCALAR_BYTES:
            return offs + GGUF_SCALAR_BYTES[raw_itype] * count
        order = "<" if (sys.byteorder == "little") != (self.byte_order == "S") else ">"
        memory = memoryview(self.data)
        for _ in range(count):
            if raw_itype == GGUF_STRING:
                offs += 8 + struct.unpack_from(f"{order}Q", memory, offs)[0]
            elif raw_itype == GGUF_ARRAY:
                itype, length = struct.unpack_from(f"{order}IQ", memory, offs)
                offs = self._skip_items(offs + 12, itype, length)
            else:
                raise ValueError(f"unknown GGUF metadata array item type {raw_itype}")
        return offs


def load_gguf(path: str | Path, keep_q4_1: bool = False) -> GGUFModel:
    """Reads ``path`` and returns its config and dequantized fp32 state dict.

    With ``keep_q4_1``, Q4_1 matrices go to ``GGUFModel.q4_1`` as raw blocks
    (Q/K rows un-permuted like the dense ones) instead of the state dict.

    Raises:
      FileNotFoundError: no file at ``path``.
      ValueError: not a Llama or Gemma 3 GGUF, a needed key is missing, or the
        file uses RoPE scaling (not supported yet).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    reader = PlainArrayReader(str(path))
    config = read_config(reader, default_name=path.stem)
    state_dict = {}
    q4_1: dict[str, Q4_1Blocks] = {}
    permuted = config.architecture == "llama"  # Gemma's Q/K rows are in HF order
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name, config.architecture)
        if keep_q4_1 and tensor.tensor_type == gguf.GGMLQuantizationType.Q4_1:
            blocks = Q4_1Blocks.from_tensor(tensor)
            if permuted and name.endswith("q_proj.weight"):
                blocks = blocks.permute_rows(config.num_heads)
            elif permuted and name.endswith("k_proj.weight"):
                blocks = blocks.permute_rows(config.num_kv_heads)
            q4_1[name] = blocks
            continue
        weights = dequantize(tensor)
        if permuted and name.endswith("q_proj.weight"):
            weights = unpermute_rope_rows(weights, config.num_heads)
        elif permuted and name.endswith("k_proj.weight"):
            weights = unpermute_rope_rows(weights, config.num_kv_heads)
        state_dict[name] = torch.from_numpy(weights)
    return GGUFModel(config=config, state_dict=state_dict, q4_1=q4_1)


def read_config(reader: gguf.GGUFReader, default_name: str = "model"
                ) -> LlamaConfig | Gemma3Config:
    """Builds a :class:`LlamaConfig` (or :class:`Gemma3Config`) from the GGUF metadata.

    Raises:
      ValueError: the architecture is neither ``llama`` nor ``gemma3``, a
        required key is missing, or the file asks for RoPE scaling or logit
        soft-capping (not supported).
    """
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "gemma3"):
        raise ValueError(f"unsupported GGUF architecture {arch!r}: only 'llama' and 'gemma3' "
                         "are supported")
    scaling = _field(reader, f"{arch}.rope.scaling.type", None)
    if scaling not in (None, "none"):
        raise ValueError(f"RoPE scaling {scaling!r} is not supported yet")
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    num_heads = int(_field(reader, f"{arch}.attention.head_count"))
    head_dim = int(_field(reader, f"{arch}.rope.dimension_count", hidden // num_heads))
    tensor_names = {t.name for t in reader.tensors}
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    vocab = int(_field(reader, f"{arch}.vocab_size", int(embedding.shape[-1])))
    base = LlamaConfig(
        name=str(_field(reader, "general.name", default_name)),
        hidden_size=hidden,
        num_layers=int(_field(reader, f"{arch}.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        vocab_size=vocab,
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        context_length=int(_field(reader, f"{arch}.context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=_optional_int(_field(reader, "tokenizer.ggml.bos_token_id", None)),
        eos_token_ids=_eos_ids(reader),
    )
    return base if arch == "llama" else _gemma3_config(reader, base)


def _gemma3_config(reader: gguf.GGUFReader, base: LlamaConfig) -> Gemma3Config:
    """``base`` (read with the ``gemma3.`` keys) plus Gemma 3's attention layout.

    Raises:
      ValueError: soft-capping keys (Gemma 2's, not Gemma 3's) or no sliding window.
    """
    for key in ("gemma3.attn_logit_softcapping", "gemma3.final_logit_softcapping"):
        if _field(reader, key, None) is not None:
            raise ValueError(f"{key} is not supported (Gemma 3 uses QK-norm instead)")
    head_dim = int(_field(reader, "gemma3.attention.key_length", base.head_dim))
    if int(_field(reader, "gemma3.attention.value_length", head_dim)) != head_dim:
        raise ValueError("gemma3: key_length != value_length is not supported")
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    fields["head_dim"] = head_dim
    return Gemma3Config(
        **fields,
        sliding_window=int(_field(reader, "gemma3.attention.sliding_window")),
        sliding_window_pattern=GEMMA3_SLIDING_WINDOW_PATTERN,
        rope_local_theta=GEMMA3_ROPE_LOCAL_THETA,
        query_pre_attn_scalar=float(head_dim),
    )


def hf_tensor_name(gguf_name: str, architecture: str = "llama") -> str:
    """Maps a GGUF tensor name (``blk.3.attn_q.weight``) to the HF name
    (``model.layers.3.self_attn.q_proj.weight``) for ``architecture``
    (``llama`` or ``gemma3``).

    Raises:
      ValueError: a tensor this loader does not know.
    """
    layer_names = _GEMMA3_LAYER_NAMES if architecture == "gemma3" else _LAYER_NAMES
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    raise ValueError(f"unknown GGUF tensor {gguf_name!r}")


#: Bytes of quantized rows dequantized per call. ``gguf.quants.dequantize``
#: works in groups of 16 rows, one Python call each (3,072 for SmolLM2's
#: embedding: ~1.2 s of every start here); groups of 4 MiB give the same
#: numbers (the same per-block arithmetic) in a few dozen calls.
DEQUANTIZE_GROUP_BYTES = 1 << 22


def dequantize(tensor: gguf.ReaderTensor) -> np.ndarray:
    """The tensor as a contiguous fp32 array, ``[rows, cols]`` for matrices
    (GGUF lists dimensions innermost first; numpy order is the reverse).
    Block-quantized types are dequantized by ``gguf.quants``' own per-block
    code, :data:`DEQUANTIZE_GROUP_BYTES` of rows at a time.

    Raises:
      NotImplementedError: a type ``gguf.quants`` cannot dequantize.
    """
    shape = tuple(int(d) for d in reversed(tensor.shape))
    quant = getattr(gguf.quants, tensor.tensor_type.name, None)
    if isinstance(quant, type) and hasattr(quant, "dequantize_rows"):
        rows = tensor.data.reshape(-1, tensor.data.shape[-1])
        quant.init_grid()
        out = np.empty((rows.shape[0], shape[-1]), dtype=np.float32)
        step = max(1, DEQUANTIZE_GROUP_BYTES // rows.shape[1])
        for start in range(0, rows.shape[0], step):
            out[start:start + step] = quant.dequantize_rows(rows[start:start + step])
        return out.reshape(shape)
    weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    weights = np.ascontiguousarray(weights.reshape(shape), dtype=np.float32)
    # Unquantized tensors are read-only views of the memory-mapped file.
    return weights if weights.flags.writeable else weights.copy()


def unpermute_rope_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's Q/K row permutation ``[out, in]`` → HF "rotate half" layout.

    llama.cpp stores, per head, rows in the order (0, d/2, 1, d/2+1, …) so that
    rotary pairs are adjacent; HF keeps the halves apart. Inverse of
    ``convert_hf_to_gguf.py``'s ``permute``.
    """
    rows = weights.shape[0]
    half = rows // num_heads // 2
    grouped = weights.reshape(num_heads, half, 2, *weights.shape[1:])
    return np.ascontiguousarray(grouped.swapaxes(1, 2).reshape(weights.shape))


_MISSING = object()


def _field(reader: gguf.GGUFReader, key: str, default: object = _MISSING) -> object:
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise ValueError(f"GGUF metadata key {key!r} is missing")
        return default
    return field.contents()


def _optional_int(value: object) -> int | None:
    return None if value is None else int(value)  # type: ignore[call-overload]


def _eos_ids(reader: gguf.GGUFReader) -> tuple[int, ...]:
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                "tokenizer.ggml.eom_token_id"):
        value = _field(reader, key, None)
        if value is not None and int(value) not in ids:  # type: ignore[call-overload]
            ids.append(int(value))  # type: ignore[call-overload]
    if not ids:
        raise ValueError("GGUF metadata holds no tokenizer.ggml.eos_token_id")
    return tuple(ids)
