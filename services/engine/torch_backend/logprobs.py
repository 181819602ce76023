"""Log-probabilities of generated and prompt tokens (``sampling.logprobs`` /
``sampling.prompt_logprobs``), from the model's raw logits.

Values are ``log_softmax`` in fp32 of the logits exactly as the model runner
returns them, before any sampling transform (penalties, logit bias, grammar
masks, temperature, top-k/top-p): vLLM's default ``logprobs_mode``
(``raw_logprobs``, docs.vllm.ai "Sampling Parameters") and what OpenAI's
``logprobs`` / ``top_logprobs`` document. The rank of a token is 1 plus the
number of tokens with a strictly greater log-probability at its position
(vLLM's definition), so a greedy token has rank 1.

Only the sequences that ask pay: a step without such a sequence runs none of
this, and the logit rows of one that asks are reduced on their own (a row's
values never depend on its batch-mates or on how many rows a speculative
step scored: each row's ``log_softmax`` is its own reduction).

Prompt log-probabilities need logits at every prompt position, not only the
last: :func:`prompt_rows` says how many rows of a prefill chunk score prompt
tokens (they lead the chunk's logit rows, before its sampling row), and the
scheduler computes such a sequence's prompt in full (no prefix-cache hit on
its own prompt, as in vLLM v1: cached positions have no logits) until its
prompt log-probabilities are complete.

Threading: the engine core's worker thread only (it owns the sequences).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

import torch

from services.common.logprobs import PositionLogprobs, TokenLogprob
from services.engine.torch_backend.sequence import Sequence


def position_logprobs(logits: torch.Tensor, chosen: SequenceOf[int],
                      k: int) -> list[PositionLogprobs]:
    """The chosen token's log-probability and rank and the ``k`` most likely
    tokens at each row.

    Args:
      logits: ``[rows, vocab]`` raw logits (any float dtype), row ``j`` the
        distribution that ``chosen[j]`` was drawn from (or stands at).
      chosen: ``rows`` token ids.
      k: alternatives per row, 0..vocab (0: the chosen token only).

    Returns:
      one entry per row, in order; ``top`` most likely first (ties in
      ``torch.topk`` order).

    Raises:
      ValueError: ``len(chosen)`` differs from the row count.
    """
    if logits.shape[0] != len(chosen):
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(chosen)} tokens")
    if not chosen:
        return []
    logprobs = logits.float().log_softmax(dim=-1)
    ids = torch.tensor(chosen, dtype=torch.int64, device=logits.device).unsqueeze(1)
    values = logprobs.gather(1, ids)
    ranks = ((logprobs > values).sum(dim=-1) + 1).tolist()
    top: list[tuple[TokenLogprob, ...]] = [()] * len(chosen)
    if k > 0:
        top_values, top_ids = logprobs.topk(k, dim=-1)
        top = [tuple(TokenLogprob(t, v, r + 1) for r, (t, v) in enumerate(zip(ts, vs)))
               for ts, vs in zip(top_ids.tolist(), top_values.tolist())]
    return [PositionLogprobs(TokenLogprob(token, value, rank), alternatives)
            for token, value, rank, alternatives
            in zip(chosen, values.squeeze(1).tolist(), ranks, top)]


def collects_prompt_logprobs(seq: Sequence) -> bool:
    """True while ``seq`` asked for prompt log-probabilities and has not got
    one per prompt token after the first (nor delivered them)."""
    return (seq.request.sampling.prompt_logprobs is not None and not seq.prompt_logprobs_sent
            and len(seq.prompt_logprobs) < seq.num_prompt_tokens - 1)


def prompt_rows(seq: Sequence, start: int, num_tokens: int) -> int:
    """Leading tokens of ``seq``'s chunk ``[start, start + num_tokens)`` whose
    logits score a prompt token (row ``j`` scores the token at ``start + j + 1``);
    0 unless it :func:`collects_prompt_logprobs`."""
    if not collects_prompt_logprobs(seq):
        return 0
    return max(0, min(num_tokens, seq.num_prompt_tokens - 1 - start))


def add_prompt_logprobs(seq: Sequence, start: int, logits: torch.Tensor) -> None:
    """Books the prompt log-probabilities of the chunk starting at ``start``
    (``logits``: its :func:`prompt_rows` leading rows). Entries past ``start``
    from an earlier, preempted computation are replaced. Mutates ``seq``."""
    del seq.prompt_logprobs[start:]
    chosen = seq.token_ids[start + 1:start + 1 + logits.shape[0]]
    seq.prompt_logprobs.extend(position_logprobs(logits, chosen,
                                                 seq.request.sampling.prompt_logprobs or 0))
