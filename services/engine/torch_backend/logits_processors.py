"""Per-request logits processors: logit bias, the min_tokens mask and the
repetition, frequency and presence penalties.

They run on the raw next-token logits of a step, before any structured-output
mask and the sampler's temperature / top-k / top-p (vLLM v1's order):

1. ``logit_bias``: each listed token's bias is added to its logit (OpenAI's
   ``logit_bias``).
2. ``min_tokens``: while fewer than ``min_tokens`` tokens were generated, the
   ids that would end the sequence (the model's EOS ids, unless the request
   ignores EOS, and its ``stop_token_ids``) get ``-inf``.
3. ``repetition_penalty`` ``r`` over the tokens of the prompt and the output
   so far: a positive logit is divided by ``r``, a negative one multiplied
   (Keskar et al., "CTRL", 2019, arXiv:1909.05858, section 4.1, in the form
   HF transformers and vLLM use).
4. ``frequency_penalty`` ``f`` and ``presence_penalty`` ``p`` over the output
   tokens only: ``logit -= count * f + (count > 0) * p`` (OpenAI's definition,
   https://platform.openai.com/docs/advanced-usage#frequency-and-presence-penalties).

Each sequence keeps a :class:`LogitsProcessorState`: its distinct output
tokens with their counts, and its distinct prompt and output tokens, both
updated incrementally (tokens appended after a step are counted in one
``index_add_`` at the next step). The penalties gather and scatter only those
ids, so a step costs ``O(distinct tokens)`` per processed row, never a pass
over the history or over the whole vocabulary. A row's processed
logits depend only on its own logits and state (elementwise arithmetic, no
reduction over the batch): the processors are batch-invariant.

Speculative decoding: a sequence with proposals ``d_1..d_k`` has ``k + 1``
target rows; row ``j`` is processed as if ``d_1..d_j`` had been generated
(counted by the penalties and by ``min_tokens``), which is the history it has
whenever it is used (verification stops at the first rejected proposal). So
greedy and seeded outputs are the same with and without speculation.

Threading: states are owned by the engine thread (appended by the scheduler,
read by the sampler).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from services.common.sampling import SamplingOptions


@dataclass(frozen=True)
class LogitsProcessorParams:
    """What a request asks of the processors (validated by ``SamplingOptions.from_pb``).

    Attributes:
      logit_bias: ``(token id, bias)`` pairs, ids unique.
      min_tokens: ``min_stop_ids`` are masked while fewer tokens were generated.
      min_stop_ids: EOS ids (unless ``ignore_eos``) and the stop token ids.
      repetition_penalty: > 0; 1 is off.
      frequency_penalty: subtracted per occurrence in the output; 0 is off.
      presence_penalty: subtracted once per token present in the output; 0 is off.
    """

    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    min_stop_ids: tuple[int, ...] = ()
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    @classmethod
    def from_options(cls, options: SamplingOptions,
                     eos_token_ids: Iterable[int]) -> LogitsProcessorParams | None:
        """The request's processors, or None when it uses none (the fast path)."""
        if not options.has_penalties:
            return None
        eos = () if options.ignore_eos else tuple(eos_token_ids)
        stop_ids = tuple(sorted(set(eos) | set(options.stop_token_ids)))
        return cls(options.logit_bias, options.min_tokens, stop_ids if options.min_tokens else (),
                   options.repetition_penalty, options.frequency_penalty,
                   options.presence_penalty)


class LogitsProcessorState:
    """One sequence's processors and the history they need, kept sparse: the
    distinct tokens of its output (with their counts) and of its prompt and
    output, so a step costs ``O(distinct tokens)`` per row, not ``O(vocab)``.

    Args:
      params: the request's processors.
      prompt_token_ids: its prompt (the repetition penalty's prompt tokens).
    """

    def __init__(self, params: LogitsProcessorParams, prompt_token_ids: Sequence[int]) -> None:
        self.params = params
        self.num_output_tokens = 0
        self._repeating = params.repetition_penalty != 1.0
        self._frequencing = bool(params.frequency_penalty or params.presence_penalty)
        # Output tokens: position of each distinct id, and its count (aligned tensor).
        self._out_pos: dict[int, int] = {}
        self._out_ids = _IdBuffer()
        self._out_counts: torch.Tensor | None = None  # on the logits' device
        self._pending: list[int] = []  # appended, not yet in _out_counts
        # Prompt and output tokens (the repetition penalty's set).
        prompt = list(dict.fromkeys(prompt_token_ids)) if self._repeating else []
        self._seen: set[int] = set(prompt)
        self._seen_ids = _IdBuffer(prompt)
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, values)
        self._stop: torch.Tensor | None = None

    @classmethod
    def for_request(cls, options: SamplingOptions, prompt_token_ids: Sequence[int],
                    eos_token_ids: Iterable[int]) -> LogitsProcessorState | None:
        """A state for a request, or None when it uses no processor."""
        params = LogitsProcessorParams.from_options(options, eos_token_ids)
        return None if params is None else cls(params, prompt_token_ids)

    def append(self, token_id: int) -> None:
        """Records a generated token (counted at the next :meth:`process`). O(1)."""
        self.num_output_tokens += 1
        if self._frequencing:
            self._pending.append(token_id)
            if token_id not in self._out_pos:
                self._out_pos[token_id] = len(self._out_pos)
                self._out_ids.append(token_id)
        if self._repeating and token_id not in self._seen:
            self._seen.add(token_id)
            self._seen_ids.append(token_id)

    def process(self, logits: torch.Tensor, lookahead: Sequence[int] = ()) -> torch.Tensor:
        """Applies the processors to this sequence's rows, in place.

        Args:
          logits: ``[1 + len(lookahead), vocab]`` fp32 rows (a copy the caller owns).
          lookahead: speculative proposals; row ``j`` sees ``lookahead[:j]``
            as generated.

        Returns:
          ``logits``, processed.
        """
        p = self.params
        rows = logits.shape[0]
        if p.logit_bias:
            if self._bias is None:
                self._bias = (torch.tensor([t for t, _ in p.logit_bias], device=logits.device),
                              torch.tensor([b for _, b in p.logit_bias], device=logits.device))
            ids, bias = self._bias
            logits.index_add_(1, ids, bias.expand(rows, -1))
        masked_rows = min(rows, p.min_tokens - self.num_output_tokens)
        if masked_rows > 0 and p.min_stop_ids:
            if self._stop is None:
                self._stop = torch.tensor(p.min_stop_ids, device=logits.device)
            logits[:masked_rows, self._stop] = float("-inf")
        if not (self._repeating or self._frequencing):
            return logits
        lookahead = tuple(lookahead[:rows - 1])
        if self._repeating:
            self._penalise_repetition(logits, lookahead)
        if self._frequencing:
            self._penalise_frequency_presence(logits, lookahead)
        return logits

    def _penalise_repetition(self, logits: torch.Tensor, lookahead: tuple[int, ...]) -> None:
        """CTRL's penalty on the prompt and output tokens (and, from the row
        after each, the proposals not among them)."""
        r = self.params.repetition_penalty
        extra = [t for t in dict.fromkeys(lookahead) if t not in self._seen]
        ids = self._seen_ids.tensor(logits.device, extra)
        if ids.numel() == 0:
            return
        values = logits.index_select(1, ids)
        penalised = torch.where(values > 0, values / r, values * r)
        if extra:  # a proposal's token counts from the row after it on
            seen = torch.ones_like(values, dtype=torch.bool)
            base = ids.numel() - len(extra)
            for i, token in enumerate(extra):
                seen[:lookahead.index(token) + 1, base + i] = False
            penalised = torch.where(seen, penalised, values)
        logits.index_copy_(1, ids, penalised)

    def _penalise_frequency_presence(self, logits: torch.Tensor,
                                     lookahead: tuple[int, ...]) -> None:
        """OpenAI's penalties on the output tokens (and the proposals before each row)."""
        p = self.params
        device = logits.device
        if self._out_counts is None:
            self._out_counts = torch.zeros(0, device=device)
        if self._pending:  # incremental: only the tokens appended since the last step
            grown = len(self._out_pos) - self._out_counts.numel()
            if grown:
                self._out_counts = torch.cat([self._out_counts,
                                              torch.zeros(grown, device=device)])
            positions = torch.tensor([self._out_pos[t] for t in self._pending], device=device)
            self._out_counts.index_add_(0, positions,
                                        torch.ones(len(self._pending), device=device))
            self._pending.clear()
        extra = [t for t in dict.fromkeys(lookahead) if t not in self._out_pos]
        ids = self._out_ids.tensor(device, extra)
        if ids.numel() == 0:
            return
        counts = self._out_counts
        if extra:
            counts = torch.cat([counts, torch.zeros(len(extra), device=device)])
        counts = counts.expand(logits.shape[0], -1)
        if lookahead:
            counts = counts.clone()
            where = {t: i for i, t in enumerate(extra, start=len(self._out_pos))}
            for j, token in enumerate(lookahead):
                counts[j + 1:, self._out_pos.get(token, where.get(token))] += 1.0
        logits.index_add_(1, ids, counts * -p.frequency_penalty
                          + (counts > 0) * -p.presence_penalty)


class _IdBuffer:
    """A growing list of token ids and its int64 tensor, rebuilt from the list
    only in a step that added ids (one copy then, none otherwise)."""

    def __init__(self, ids: Sequence[int] = ()) -> None:
        self._ids: list[int] = list(ids)
        self._tensor = torch.tensor(self._ids, dtype=torch.int64)

    def append(self, token_id: int) -> None:
        self._ids.append(token_id)

    def tensor(self, device: torch.device, extra: Sequence[int] = ()) -> torch.Tensor:
        """The ids (then ``extra``) as a ``[n + len(extra)]`` int64 tensor on ``device``."""
        if self._tensor.device != device:
            self._tensor = self._tensor.to(device)
        if self._tensor.numel() < len(self._ids):
            new = torch.tensor(self._ids[self._tensor.numel():], dtype=torch.int64,
                               device=device)
            self._tensor = torch.cat([self._tensor, new])
        ids = self._tensor
        if extra:
            ids = torch.cat([ids, torch.tensor(extra, dtype=torch.int64, device=device)])
        return ids


class ProcessedRow(Protocol):
    """One sequence's share of a step's logits (e.g. ``step_sampler.StepRow``)."""

    @property
    def processors(self) -> LogitsProcessorState | None: ...

    @property
    def spec_token_ids(self) -> tuple[int, ...]: ...


def apply_logits_processors(logits: torch.Tensor, rows: Sequence[ProcessedRow]) -> torch.Tensor:
    """The step's logits with each sequence's processors applied.

    Args:
      logits: ``[sum of (1 + k_i), vocab]``: each sequence's ``1 + k_i`` rows
        (``k_i = len(spec_token_ids)``), in ``rows`` order. Never modified.
      rows: the sequences.

    Returns:
      ``logits`` itself when no sequence has processors (no copy, no cost);
      else a new fp32 tensor of the same shape, rows without processors
      copied unchanged.
    """
    if not any(row.processors is not None for row in rows):
        return logits
    out = logits.to(torch.float32, copy=True)
    offset = 0
    for row in rows:
        span = 1 + len(row.spec_token_ids)
        if row.processors is not None:
            out[offset:offset + span] = row.processors.process(
                out[offset:offset + span], row.spec_token_ids)
        offset += span
    return out
