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

Each sequence keeps a :class:`LogitsProcessorState` whose output-token counts
are a dense ``[vocab]`` fp32 vector updated incrementally: tokens appended
after a step are added in one ``index_add_`` at the next step, so a step costs
``O(vocab)`` per processed row whatever the history length. A row's processed
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

    @property
    def counts_output(self) -> bool:
        """True when a penalty needs the output-token counts."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)


class LogitsProcessorState:
    """One sequence's processors and the output-token history they need.

    Args:
      params: the request's processors.
      prompt_token_ids: its prompt (the repetition penalty's prompt tokens).
    """

    def __init__(self, params: LogitsProcessorParams, prompt_token_ids: Sequence[int]) -> None:
        self.params = params
        self._prompt = tuple(prompt_token_ids)
        self.num_output_tokens = 0
        self._pending: list[int] = []
        self._counts: torch.Tensor | None = None  # [vocab] fp32, built at first use
        self._prompt_mask: torch.Tensor | None = None  # [vocab] bool
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
        if self.params.counts_output:
            self._pending.append(token_id)

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
        rows, vocab = logits.shape
        if p.logit_bias:
            if self._bias is None:
                self._bias = (torch.tensor([t for t, _ in p.logit_bias], device=logits.device),
                              torch.tensor([b for _, b in p.logit_bias], device=logits.device))
            ids, bias = self._bias
            logits[:, ids] += bias
        masked_rows = min(rows, p.min_tokens - self.num_output_tokens)
        if masked_rows > 0 and p.min_stop_ids:
            if self._stop is None:
                self._stop = torch.tensor(p.min_stop_ids, device=logits.device)
            logits[:masked_rows, self._stop] = float("-inf")
        if not p.counts_output:
            return logits
        counts = self._output_counts(vocab, logits.device).expand(rows, vocab)
        if lookahead:
            counts = counts.clone()
            for j, token in enumerate(lookahead[:rows - 1]):
                counts[j + 1:, token] += 1.0
        present = counts > 0
        if p.repetition_penalty != 1.0:
            seen = present | self._prompt_seen(vocab, logits.device)
            r = p.repetition_penalty
            logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
        if p.frequency_penalty:
            logits -= counts * p.frequency_penalty
        if p.presence_penalty:
            logits -= present.to(logits.dtype) * p.presence_penalty
        return logits

    def _output_counts(self, vocab: int, device: torch.device) -> torch.Tensor:
        """``[vocab]`` fp32 occurrences of each token in the output, caught up
        with the tokens appended since the last call."""
        if self._counts is None:
            self._counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        if self._pending:
            ids = torch.tensor(self._pending, device=device)
            self._counts.index_add_(0, ids, torch.ones(len(self._pending), device=device))
            self._pending.clear()
        return self._counts

    def _prompt_seen(self, vocab: int, device: torch.device) -> torch.Tensor:
        """``[vocab]`` bool: the token occurs in the prompt."""
        if self._prompt_mask is None:
            self._prompt_mask = torch.zeros(vocab, dtype=torch.bool, device=device)
            if self._prompt:
                self._prompt_mask[torch.tensor(self._prompt, device=device)] = True
        return self._prompt_mask


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
