"""The tokens one engine step makes: ordinary sampling for sequences without
speculative proposals, verification for those with them.

:func:`sample_step` is what the engine core calls once per step. After the
logits processors, constrained rows are masked
(:func:`~services.engine.torch_backend.grammar_mask.apply_token_mask`: ``-inf``
outside their grammar, proposals included). Rows without
proposals are sampled together in one batched call of
:func:`~services.engine.torch_backend.sampler.sample` (one token each);
rows with ``k`` proposals are verified against their ``k + 1`` target rows by
:mod:`~services.engine.torch_backend.rejection_sampler` (greedy: longest
matching prefix; sampled: speculative sampling, Leviathan et al. 2023,
arXiv:2211.17192), which returns 1..k + 1 tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.engine.torch_backend.grammar_mask import GrammarMatcher, apply_token_mask
from services.engine.torch_backend.logits_processors import (
    LogitsProcessorState,
    apply_logits_processors,
)
from services.engine.torch_backend.rejection_sampler import verify_greedy, verify_sampled
from services.engine.torch_backend.sampler import SamplingRow, probabilities, sample


@dataclass(frozen=True, slots=True)
class StepRow:
    """One sampling sequence of a step: its sampling parameters, proposals
    (its logits are ``1 + len(spec_token_ids)`` consecutive rows), logits
    processors (None: it uses none) and structured-output matcher (None:
    unconstrained)."""

    sampling: SamplingRow
    spec_token_ids: tuple[int, ...] = ()
    processors: LogitsProcessorState | None = None
    grammar: GrammarMatcher | None = None


def sample_step(logits: torch.Tensor, rows: Sequence[StepRow]) -> list[list[int]]:
    """New tokens of every sampling sequence of a step.

    The logits processors (penalties, logit bias, min_tokens:
    :func:`~services.engine.torch_backend.logits_processors.apply_logits_processors`)
    run first, then the structured-output mask
    (:func:`~services.engine.torch_backend.grammar_mask.apply_token_mask`), then
    sampling or verification on the processed logits.

    Args:
      logits: ``[sum of (1 + k_i), vocab]`` raw rows in ``rows`` order (not modified).
      rows: the sampling sequences.

    Returns:
      per sequence: one sampled token (no proposals), or the accepted
      proposals then the target's token (1..k_i + 1 ids).

    Raises:
      ValueError: the logits do not have one row per position to score.
    """
    expected = sum(1 + len(row.spec_token_ids) for row in rows)
    if logits.shape[0] != expected:
        raise ValueError(f"{logits.shape[0]} rows of logits for {expected} positions")
    logits = apply_logits_processors(logits, rows)
    logits = apply_token_mask(logits, rows)  # after the processors, before temperature
    if not any(row.spec_token_ids for row in rows):
        return [[token] for token in sample(logits, [r.sampling for r in rows]).tolist()]
    out: list[list[int]] = [[] for _ in rows]
    plain: list[int] = []
    plain_rows: list[int] = []
    argmax: list[int] | None = None
    offset = 0
    for index, row in enumerate(rows):
        k = len(row.spec_token_ids)
        if k == 0:
            plain.append(index)
            plain_rows.append(offset)
        elif row.sampling.greedy:
            if argmax is None:
                argmax = logits.argmax(dim=-1).tolist()
            out[index] = verify_greedy(argmax[offset:offset + k + 1], row.spec_token_ids)
        else:
            probs = probabilities(logits[offset:offset + k + 1], [row.sampling] * (k + 1))
            out[index] = verify_sampled(probs, row.spec_token_ids, row.sampling.generator)
        offset += k + 1
    if plain:
        tokens = sample(logits[plain_rows], [rows[i].sampling for i in plain]).tolist()
        for index, token in zip(plain, tokens):
            out[index] = [token]
    return out
