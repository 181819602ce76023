"""The token mask of structured output: one llguidance matcher per sequence.

Each step, a constrained sequence's logits rows keep their values only for the
tokens its grammar allows next and become ``-inf`` elsewhere
(:func:`apply_token_mask`); the sampler then applies temperature, top-k and
top-p to what is left, so a constrained row can only ever sample an allowed
token. EOS is allowed exactly when the grammar accepts (llguidance puts the
tokenizer's EOS ids in the mask then). Masks come from llguidance's
``LLMatcher.compute_logit_bias`` (one byte per token id, 0 where refused;
llguidance's Python API, ``llguidance/_lib.pyi``): a byte view costs less
here than unpacking its 32-bit ``compute_bitmask`` words with tensor ops.

Rows are independent: a row's mask is a function of its own matcher state
only, so a constrained request's tokens do not depend on its batch-mates, and
rows without a grammar are left untouched (their cost: one attribute test).

Speculative decoding: a sequence with proposals ``d_1..d_k`` has ``k + 1``
target rows; row ``j`` is masked with the grammar's state after ``d_1..d_j``
(the matcher advances through the proposals, then rolls back: llguidance
matchers support ``rollback``). A proposal outside its row's mask can never
equal that row's greedy or sampled token, so verification rejects it, and a
constrained greedy output is the same with and without speculation. Rows
after a proposal the grammar refuses are never read by verification; they
get that proposal's row mask (never all ``-inf``).

The matcher advances only with committed tokens (:meth:`GrammarMatcher.accept`,
called by the scheduler as it appends each token).

Threading: a :class:`GrammarMatcher` is used by the engine thread only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import llguidance
import numpy as np
import torch


class GrammarMatcher:
    """One sequence's position in its grammar.

    Args:
      matcher: a fresh llguidance matcher (this sequence's own copy).
      vocab_size: the model's logit rows (the mask width in token ids).
    """

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size

    @property
    def finished(self) -> bool:
        """True once the grammar takes no further token (the sequence ends with STOP)."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        """llguidance's error, empty while the matcher is healthy."""
        return self._matcher.get_error()

    def fork(self) -> GrammarMatcher:
        """An independent copy at the same position (another choice of ``n``)."""
        return GrammarMatcher(self._matcher.deep_copy(), self._vocab_size)

    def accept(self, token: int) -> bool:
        """Advances past the committed ``token``; False if the grammar refuses it
        (the matcher is then in error and stays so)."""
        return self._matcher.consume_token(token)

    def allowed(self, proposals: Sequence[int] = ()) -> np.ndarray:
        """The tokens allowed at the next ``1 + len(proposals)`` positions.

        Row ``j`` is the mask after ``proposals[:j]``; the matcher is back at
        its committed state on return.

        Returns:
          ``[1 + len(proposals), vocab_size]`` uint8 (numpy: no torch op per
          row, whose thread pool costs ms per call on a loaded CPU), 0 where
          refused (ids past llguidance's vocabulary included).
        """
        flags = np.zeros((1 + len(proposals), self._vocab_size), dtype=np.uint8)
        consumed = 0
        for j in range(len(proposals) + 1):
            row = np.frombuffer(self._matcher.compute_logit_bias(), dtype=np.uint8)
            width = min(row.size, self._vocab_size)
            flags[j, :width] = row[:width]
            if j == len(proposals):
                break
            if self._matcher.try_consume_tokens([proposals[j]]) != 1:
                flags[j + 1:] = flags[j]  # never read: verification stops at row j
                break
            consumed += 1
        if consumed:
            self._matcher.rollback(consumed)
        return flags


class MaskedRow(Protocol):
    """What :func:`apply_token_mask` reads of a step row."""

    @property
    def grammar(self) -> GrammarMatcher | None: ...

    @property
    def spec_token_ids(self) -> tuple[int, ...]: ...


def apply_token_mask(logits: torch.Tensor, rows: Sequence[MaskedRow]) -> torch.Tensor:
    """``logits`` with each constrained row's disallowed tokens at ``-inf``.

    Args:
      logits: ``[sum of (1 + k_i), vocab]``, the step's rows in ``rows`` order
        (after any other per-row logits processor; log-probabilities are read
        before this).
      rows: the step's sampling sequences (their grammar and proposals).

    Returns:
      ``logits`` itself when no row is constrained (no copy, no work); else a
      new tensor (the input is not modified).
    """
    if all(row.grammar is None for row in rows):
        return logits
    index: list[int] = []
    allowed: list[np.ndarray] = []
    offset = 0
    for row in rows:
        width = 1 + len(row.spec_token_ids)
        if row.grammar is not None:
            allowed.append(row.grammar.allowed(row.spec_token_ids))
            index.extend(range(offset, offset + width))
        offset += width
    refused = np.concatenate(allowed) == 0
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        # numpy: single-threaded, where each torch op would wake the intra-op
        # pool (measured 0.4 ms vs 2-50 ms for the torch ops on a loaded 2-CPU box)
        out = logits.numpy().copy()
        masked = out[index]
        masked[refused] = -np.inf
        out[index] = masked
        return torch.from_numpy(out)
    where = torch.tensor(index, device=logits.device)
    out = logits.clone()
    out[where] = out[where].masked_fill(torch.from_numpy(refused).to(logits.device),
                                        float("-inf"))
    return out
