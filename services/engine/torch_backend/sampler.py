"""Turns logits into next tokens: greedy, or sampled with temperature, top-k and top-p.

Each row of the batch carries its own parameters and its own
``torch.Generator``; a sampled row draws only from its generator, so a seeded
request gives the same tokens whatever else shares the batch. Order of the
logit transforms (as in HF transformers and vLLM): temperature, top-k, top-p.
Top-p is nucleus sampling (Holtzman et al., "The Curious Case of Neural Text
Degeneration", 2020, arXiv:1904.09751).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.common.sampling import SamplingOptions
from services.engine.torch_backend.device import to_device


@dataclass(frozen=True)
class SamplingRow:
    """Sampling parameters of one sequence.

    Attributes:
      temperature: 0 means greedy (argmax).
      top_k: keep the ``top_k`` most likely tokens; 0 disables it.
      top_p: keep the smallest set of most likely tokens with mass >= ``top_p``; 1 disables it.
      generator: the sequence's own random generator (None when greedy).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    generator: torch.Generator | None = None

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax."""
        return self.temperature == 0.0

    @classmethod
    def from_options(cls, options: SamplingOptions,
                     device: torch.device | str = "cpu") -> SamplingRow:
        """A row for ``options``; the generator is seeded with ``options.seed`` or,
        when unset, from the OS entropy source."""
        if options.greedy:
            return cls()
        generator = torch.Generator(device=device)
        if options.seed is None:
            generator.seed()
        else:
            generator.manual_seed(options.seed)
        return cls(options.temperature, options.top_k, options.top_p, generator)


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Picks one token per row.

    Args:
      logits: ``[batch, vocab]`` next-token logits (any float dtype).
      rows: ``batch`` sampling rows, in the order of the logits.

    Returns:
      token ids ``[batch]`` int64 on the logits' device.

    Raises:
      ValueError: ``len(rows)`` differs from the batch size.
    """
    if logits.shape[0] != len(rows):
        raise ValueError(f"{logits.shape[0]} rows of logits but {len(rows)} sampling rows")
    tokens = logits.argmax(dim=-1)
    sampled = [i for i, row in enumerate(rows) if not row.greedy]
    if not sampled:
        return tokens
    chosen = [rows[i] for i in sampled]
    probs = probabilities(logits[sampled], chosen)
    for j, i in enumerate(sampled):
        tokens[i] = torch.multinomial(probs[j], 1, generator=rows[i].generator)[0]
    return tokens


def probabilities(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Sampling distribution ``[batch, vocab]`` (fp32) after temperature, top-k, top-p."""
    device = logits.device
    temperature = to_device([r.temperature for r in rows], device, torch.float32)
    scaled = logits.float() / temperature.unsqueeze(1)
    if any(r.top_k > 0 or r.top_p < 1.0 for r in rows):
        top_k = to_device([r.top_k for r in rows], device)
        top_p = to_device([r.top_p for r in rows], device, torch.float32)
        scaled = apply_top_k_top_p(scaled, top_k, top_p)
    return scaled.softmax(dim=-1)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor) -> torch.Tensor:
    """Sets to ``-inf`` the logits outside each row's top-k set, then outside its nucleus.

    Args:
      logits: ``[batch, vocab]`` fp32.
      top_k: ``[batch]`` int, 0 (or >= vocab) keeps all.
      top_p: ``[batch]`` float in (0, 1], 1 keeps all. The nucleus is computed
        over the top-k survivors (renormalized), and always keeps the most
        likely token.

    Returns:
      a new ``[batch, vocab]`` tensor; ties at the cut are broken by sort order.
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    p = torch.where(top_p < 1.0, top_p, float("inf")).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(mass_before >= p, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
