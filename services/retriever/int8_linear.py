"""Weight-only int8 Linear layers for the query encoder (``--query-precision int8-weights``).

A query is ~10-50 tokens, so each of the encoder's 36 Linear layers multiplies
a ``[tokens, in]`` activation by an ``[out, in]`` weight that is read from
memory once per query: the forward is bound by the weight bytes streamed, not
by arithmetic (docs/bench.md "Retrieval" has the profile). This halves them
again after bf16: the weight is stored int8, symmetric per output channel
(``scale[o] = max |W[o, :]| / 127``, ``W ≈ q * scale``), while the
activations stay bf16 (unlike dynamic int8 quantization, which also rounds
each activation row to int8 and moved query vectors ~50 times further from
fp32). The product is ``torch.ops.aten._weight_int8pack_mm`` (PyTorch's CPU
kernel for weight-only int8, as used by gpt-fast and torchao's
``int8_weight_only``): ``x @ (q * scale)ᵀ`` computed from the int8 weight.
"""

from __future__ import annotations

import torch

#: Largest int8 magnitude used (symmetric: -127..127, so ``-q`` is representable).
INT8_MAX = 127


class Int8WeightLinear(torch.nn.Module):
    """``y = x Wᵀ + b`` with ``W`` int8 per output channel and ``x``, ``y``, ``b`` bf16.

    Args:
      linear: the fp32 (or bf16) layer to quantize; ``weight`` ``[out, in]``.

    Shapes: ``x`` ``[..., in]`` bf16 → ``[..., out]`` bf16.
    """

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp(min=1e-12) / INT8_MAX
        quantized = (weight / scale[:, None]).round().clamp(-INT8_MAX, INT8_MAX)
        self.out_features = int(weight.shape[0])
        self.register_buffer("weight", quantized.to(torch.int8).contiguous())
        self.register_buffer("scale", scale.to(torch.bfloat16))
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        y = torch.ops.aten._weight_int8pack_mm(rows, self.weight, self.scale)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def with_int8_weights(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` (changed in place) with every ``torch.nn.Linear`` replaced by an
    :class:`Int8WeightLinear` of it (quantized from its own weights) and every
    other floating-point parameter and buffer cast to bf16."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(parent, name, Int8WeightLinear(child))
    return module.to(torch.bfloat16)  # casts floating-point tensors only: int8 stays
