"""The engine-wide settings of speculative decoding (n-gram, draft, suffix),
checked when they are built. Imports no torch: the engine's start-up checks
build them before its heavy modules load; the proposers
(:mod:`~services.engine.torch_backend.speculative`,
:mod:`~services.engine.torch_backend.suffix_proposer`) read them.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.sampling import MAX_SPECULATIVE_TOKENS, SpeculativeMethod


@dataclass(frozen=True)
class SpeculativeConfig:
    """Engine defaults of speculative decoding.

    Attributes:
      method: proposer for requests that do not choose one (NONE: off).
      num_speculative_tokens: most proposals per sequence and step, by default.
      ngram_min, ngram_max: n-gram lengths tried, longest first (vLLM's
        ``prompt_lookup_min`` / ``prompt_lookup_max``).
      ngram_full_len: a match of at least this many tokens proposes up to ``k``
        tokens, a shorter one 1 (measured on the spec_decode benchmark: 1.45x
        against 1.38x for n-gram 2..4 with k for every match).
      ngram_window: the n-gram search looks at this many last tokens.
      disable_batch_size: no proposals in a step while more sequences run
        (None: never disabled).
      suffix_num_speculative_tokens: most proposals per step of a suffix
        decoding request that does not set its own (its proposals are cut by
        match length and probability, so it may reach further).
      cost_model: cut proposals by the cost rule (module doc); False: keep
        every proposal the proposer makes.
    """

    method: SpeculativeMethod = SpeculativeMethod.NGRAM
    num_speculative_tokens: int = 3
    ngram_min: int = 1
    ngram_max: int = 4
    ngram_full_len: int = 3
    ngram_window: int = 4096
    disable_batch_size: int | None = None
    suffix_num_speculative_tokens: int = 16
    cost_model: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min} and "
                             f"{self.ngram_max}")
        if self.ngram_full_len < 1:
            raise ValueError(f"ngram_full_len must be at least 1, got {self.ngram_full_len}")
        if not 1 <= self.suffix_num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"suffix_num_speculative_tokens must be in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got "
                             f"{self.suffix_num_speculative_tokens}")


SCOPES = ("global", "tenant")


@dataclass(frozen=True)
class SuffixOptions:
    """Suffix decoding settings (engine flags ``--suffix-*``).

    Attributes:
      max_match: longest suffix of the context matched (the pattern length).
      spec_factor: ``alpha``: a match of ``p`` tokens proposes at most
        ``ceil(alpha * p)``.
      min_token_prob: a proposal stops before its empirical probability falls
        below this.
      window: the per-request lookup searches this many last tokens.
      cache_tokens: size of the cross-request cache in tokens (0: no cache,
        the sequence's own tokens only).
      scope: ``tenant`` (outputs only for requests of their own cache scope)
        or ``global`` (every request matches every output).
    """

    max_match: int = 32
    spec_factor: float = 1.0
    min_token_prob: float = 0.1
    window: int = 4096
    cache_tokens: int = 262_144
    scope: str = "tenant"

    def __post_init__(self) -> None:
        if self.max_match < 2:
            raise ValueError(f"suffix max_match must be at least 2, got {self.max_match}")
        if not self.spec_factor > 0:
            raise ValueError(f"suffix spec_factor must be > 0, got {self.spec_factor}")
        if not 0 <= self.min_token_prob < 1:
            raise ValueError(f"suffix min_token_prob must be in [0, 1), got "
                             f"{self.min_token_prob}")
        if self.window < 2:
            raise ValueError(f"suffix window must be at least 2, got {self.window}")
        if self.cache_tokens != 0 and self.cache_tokens < 2:
            raise ValueError(f"suffix cache_tokens must be 0 or at least 2, got "
                             f"{self.cache_tokens}")
        if self.scope not in SCOPES:
            raise ValueError(f"suffix scope must be one of {', '.join(SCOPES)}, got "
                             f"{self.scope!r}")
