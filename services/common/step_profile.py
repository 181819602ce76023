"""What an engine step costs, in seconds: the measured profile an engine reports
in its load (``GetLoadResponse.prefill_seconds_per_token``,
``decode_step_seconds``) and the priors that stand in for what is not measured.

The torch engine times its own steps (``torch_backend/step_timer.py``): a
decode step by its row count (the speculation cost rule's table,
``spec_policy.StepCostModel``), and a prompt token from the steps that
compute prompt tokens. The router turns the profile into the ``kv_aware``
cost of a request on a replica (``services/router/routing.py``): its own time
to first token, its decode time in the batch it joins, and the delay it
imposes on the sequences already there.

The priors are measured here (SmolLM2 int4, native kernels, 2 Zen 4 cores,
docs/engine.md): a decode step of ``R`` rows ~4.6 ms + 0.8 ms a row; a
512-token prefill ~280 ms (0.55 ms a token). Where an engine measured one of
the two but not the other, the unmeasured one is the prior scaled by the
measured one's ratio to its own prior (a slower machine is slower at both).

A prompt token restored from the engine's KV offload tier
(``torch_backend/kv_offload.py``) costs a copy of its keys and values back
into the pool: measured per restored token by the engine
(``GetLoadResponse.restore_seconds_per_token``), else the prior (SmolLM2 fp32,
0.7 MiB a 16-token block, ~0.15 ms: ~10 us a token, scaled like the others).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Prior decode step: ``PRIOR_STEP_S + PRIOR_ROW_S * rows`` seconds.
PRIOR_STEP_S = 4.6e-3
PRIOR_ROW_S = 0.8e-3
#: Prior seconds per prompt token computed.
PRIOR_PREFILL_TOKEN_S = 0.55e-3
#: Prior seconds per prompt token restored from the KV offload tier.
PRIOR_RESTORE_TOKEN_S = 10e-6


def prior_decode_step_s(rows: int) -> float:
    """The prior's seconds for a decode step of ``rows`` rows (>= 1)."""
    return PRIOR_STEP_S + PRIOR_ROW_S * rows


@dataclass(frozen=True)
class StepProfile:
    """An engine's measured step costs (module doc).

    Attributes:
      prefill_token_s: seconds per prompt token computed; 0: not measured.
      decode_step_s: seconds of a decode step by rows: element ``i`` is a
        step of ``i + 1`` rows; empty: not measured.
      restore_token_s: seconds per prompt token restored from the KV offload
        tier; 0: not measured (or no tier).
    """

    prefill_token_s: float = 0.0
    decode_step_s: tuple[float, ...] = ()
    restore_token_s: float = 0.0

    def __post_init__(self) -> None:
        values = (self.prefill_token_s, *self.decode_step_s, self.restore_token_s)
        if not all(math.isfinite(v) and v >= 0 for v in values):
            raise ValueError(f"step costs must be finite and >= 0, got {values}")

    @property
    def measured(self) -> bool:
        """True when the engine measured either cost."""
        return self.prefill_token_s > 0 or bool(self.decode_step_s)

    def _scale(self) -> float:
        """Measured over prior, from whichever of the two is measured (1: neither)."""
        if self.decode_step_s and self.decode_step_s[0] > 0:
            return self.decode_step_s[0] / prior_decode_step_s(1)
        if self.prefill_token_s > 0:
            return self.prefill_token_s / PRIOR_PREFILL_TOKEN_S
        return 1.0

    def prefill_s(self, tokens: int) -> float:
        """Seconds to compute ``tokens`` prompt tokens (measured, else the scaled prior)."""
        per_token = self.prefill_token_s or PRIOR_PREFILL_TOKEN_S * self._scale()
        return max(tokens, 0) * per_token

    def restore_s(self, tokens: int) -> float:
        """Seconds to restore ``tokens`` prompt tokens from the KV offload tier
        (measured, else the scaled prior)."""
        per_token = self.restore_token_s or PRIOR_RESTORE_TOKEN_S * self._scale()
        return max(tokens, 0) * per_token

    def decode_step(self, rows: int) -> float:
        """Seconds of a decode step of ``rows`` rows (0 for none). Past the
        table, its last step grows by the slope of its last two entries (at
        least the prior's slope, scaled); without a table, the scaled prior."""
        if rows <= 0:
            return 0.0
        table = self.decode_step_s
        if not table:
            return prior_decode_step_s(rows) * self._scale()
        if rows <= len(table):
            return table[rows - 1]
        slope = PRIOR_ROW_S * self._scale()
        if len(table) >= 2:
            slope = max(slope, table[-1] - table[-2])
        return table[-1] + slope * (rows - len(table))
