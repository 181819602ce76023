"""One streamed TensorRT-LLM ``CompletionOutput`` → llmesh's finish reason and log-probabilities.

``generate_async(..., streaming=True)`` yields ``RequestOutput`` objects whose
``outputs[i]`` (one per choice, ``index`` i) carry ``token_ids_diff`` (the new
ids), ``logprobs_diff`` (with ``SamplingParams.logprobs``: one
``dict[token_id, Logprob(logprob, rank)]`` per new id, the top-k and the
sampled token) and ``finish_reason`` (``stop``, ``length``, ``timeout``,
``cancelled`` or None) (``tensorrt_llm/executor/result.py``;
https://nvidia.github.io/TensorRT-LLM/llm-api/reference.html#tensorrt_llm.llmapi.CompletionOutput).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from services.common.logprobs import PositionLogprobs, TokenLogprob
from services.common.sampling import FinishReason

_FINISH_REASONS = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "cancelled": FinishReason.CANCELLED,
    "timeout": FinishReason.CANCELLED,
}


def finish_reason(name: str | None) -> FinishReason:
    """Our finish reason for TensorRT-LLM's (None: not finished → NONE)."""
    return _FINISH_REASONS.get(name or "", FinishReason.NONE)


def position_logprobs(token_ids: Sequence[int], entries: Sequence[Mapping[int, Any]],
                      keep: int) -> tuple[PositionLogprobs, ...]:
    """Our log-probabilities of ``token_ids`` from TensorRT-LLM's ``logprobs_diff``.

    Args:
      token_ids: the new ids, one per entry.
      entries: per id, ``{token_id: Logprob}`` (``.logprob``, ``.rank`` 1-based
        or None).
      keep: alternatives to keep per position (``sampling.logprobs``; 0: the
        chosen token's only).

    Raises:
      ValueError: the entries do not line up with the ids, or an entry lacks
        the chosen id (TensorRT-LLM answered in another format).
    """
    if len(entries) != len(token_ids):
        raise ValueError(f"{len(entries)} log-probability entries for {len(token_ids)} tokens")
    return tuple(_position(token_id, entry, keep) for token_id, entry in zip(token_ids, entries))


def _position(token_id: int, entry: Mapping[int, Any], keep: int) -> PositionLogprobs:
    if not isinstance(entry, Mapping) or token_id not in entry:
        raise ValueError(f"no log-probability of the chosen token {token_id} in {entry!r}")
    ranked = sorted(entry.items(), key=lambda item: (_rank(item[1]) or 0, -item[1].logprob))
    top = tuple(TokenLogprob(t, float(lp.logprob), _rank(lp) or i + 1)
                for i, (t, lp) in enumerate(ranked[:keep]))
    chosen_rank = _rank(entry[token_id]) or next(
        i + 1 for i, (t, _) in enumerate(ranked) if t == token_id)
    return PositionLogprobs(TokenLogprob(token_id, float(entry[token_id].logprob), chosen_rank),
                            top)


def _rank(logprob: Any) -> int | None:
    rank = getattr(logprob, "rank", None)
    return int(rank) if rank is not None else None
