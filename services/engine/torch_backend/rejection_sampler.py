"""Verification of speculative tokens: which proposals the target model accepts.

A sequence with ``k`` proposals ``d_1..d_k`` gets ``k + 1`` rows of target
logits in one forward: row ``j`` is the target's next-token distribution after
the verified tokens and ``d_1..d_j``. Verification returns the accepted
proposals followed by one token of the target's own, so every step makes at
least one token and at most ``k + 1``:

* **Greedy** (:func:`verify_greedy`): accept the longest prefix of proposals
  equal to the target's argmax, then the target's argmax at the first
  mismatch (or after the last proposal). The output equals plain greedy
  decoding token for token, given bit-identical logits (batch-invariant mode).
* **Sampled** (:func:`verify_sampled`), speculative sampling (Leviathan et
  al., "Fast Inference from Transformers via Speculative Decoding", 2023,
  arXiv:2211.17192; Chen et al., "Accelerating Large Language Model Decoding
  with Speculative Sampling", 2023, arXiv:2302.01318): accept ``d_j`` with
  probability ``min(1, p_j(d_j) / q_j(d_j))``; at the first rejection draw
  from the residual ``max(0, p_j - q_j)`` normalised; after ``k`` acceptances
  draw the bonus token from ``p_{k+1}``. The output is distributed exactly as
  the target's.

  Our proposers (n-gram lookup, greedy draft model) propose deterministically:
  ``q_j`` is a point mass on ``d_j``. Then the rule reads "accept with
  probability ``p_j(d_j)``; on rejection draw from ``p_j`` without ``d_j``,
  renormalised", and it is implemented by the coupling "draw ``y ~ p_j`` from
  the request's generator; accept iff ``y == d_j``, else emit ``y``": P(accept)
  is ``p_j(d_j)`` and, given a rejection, ``y`` follows ``p_j`` restricted to
  ``y != d_j``, which is that residual. It draws exactly once per emitted
  token from the same distributions, so a seeded request gives the very same
  tokens with or without speculation (and whatever runs beside it).

Probabilities are the sampler's (temperature, top-k, top-p applied:
:func:`~services.engine.torch_backend.sampler.probabilities`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch



def verify_greedy(target_argmax: Sequence[int], draft: Sequence[int]) -> list[int]:
    """Accepted proposals plus the target's next token (greedy).

    Args:
      target_argmax: ``len(draft) + 1`` argmax tokens of the target.
      draft: the proposals.
    """
    out: list[int] = []
    for proposed, target in zip(draft, target_argmax):
        out.append(target)
        if target != proposed:
            return out
    out.append(target_argmax[len(draft)])
    return out


def verify_sampled(target_probs: torch.Tensor, draft: Sequence[int],
                   generator: torch.Generator | None,
                   draft_probs: torch.Tensor | None = None) -> list[int]:
    """Accepted proposals plus one token drawn by speculative sampling.

    Args:
      target_probs: ``[k + 1, vocab]`` target distributions (rows sum to 1).
      draft: the ``k`` proposals.
      generator: the request's generator (all randomness comes from it).
      draft_probs: ``[k, vocab]`` distributions the proposals were drawn from;
        None means point masses (deterministic proposals, see the module
        docstring for the coupled form used then).
    """
    out: list[int] = []
    for j, proposed in enumerate(draft):
        if draft_probs is None:
            token = int(torch.multinomial(target_probs[j], 1, generator=generator)[0])
            out.append(token)
            if token != proposed:
                return out
            continue
        p, q = target_probs[j, proposed], draft_probs[j, proposed]
        uniform = torch.rand((), generator=generator, device=target_probs.device)
        if uniform * q < p:  # accept with probability min(1, p / q)
            out.append(proposed)
            continue
        residual = (target_probs[j] - draft_probs[j]).clamp_min(0.0)
        total = residual.sum()
        residual = residual / total if total > 0 else target_probs[j]
        out.append(int(torch.multinomial(residual, 1, generator=generator)[0]))
        return out
    row = target_probs[len(draft)]
    out.append(int(torch.multinomial(row, 1, generator=generator)[0]))
    return out
