"""Runs the model for the request loop: builds input tensors, owns device and dtype.

The loop speaks in Python token lists and :class:`KVCache` objects; this module
turns one step's work into the model's flat ``[num_tokens]`` batch and back.
It is the seam the paged-KV model runner will replace.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from services.engine.torch_backend.gguf_loader import LlamaConfig, load_gguf
from services.engine.torch_backend.model import (
    KVCache,
    LlamaModel,
    SequenceSlice,
    allocate_kv_cache,
    build_model,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class StepInput:
    """One sequence's share of a step.

    Attributes:
      token_ids: tokens to compute now (a prefill chunk, or the last sampled token).
      start: tokens of this sequence already in ``cache``.
      cache: the sequence's KV cache.
    """

    token_ids: Sequence[int]
    start: int
    cache: KVCache


class ModelRunner:
    """Owns the model on its device; computes next-token logits for a step.

    Not thread-safe: one thread (the engine loop's worker) calls :meth:`run`.
    """

    def __init__(self, model: LlamaModel, device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.config: LlamaConfig = model.config
        self.device = device
        self.dtype = dtype

    @classmethod
    def from_gguf(cls, path: str | Path, device: str = "cpu", dtype: str = "float32",
                  max_positions: int | None = None) -> ModelRunner:
        """Loads and dequantizes the GGUF at ``path`` onto ``device`` in ``dtype``.

        Raises:
          FileNotFoundError, ValueError: see :func:`load_gguf`; ValueError for an
            unknown dtype name.
        """
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        loaded = load_gguf(path)
        torch_device = torch.device(device)
        model = build_model(loaded.config, loaded.state_dict, torch_device, DTYPES[dtype],
                            max_positions)
        return cls(model, torch_device, DTYPES[dtype])

    def allocate(self, capacity: int) -> KVCache:
        """A KV cache for ``capacity`` tokens on the model's device."""
        return allocate_kv_cache(self.config, capacity, self.device, self.dtype)

    def run(self, inputs: Sequence[StepInput]) -> torch.Tensor:
        """Computes the step; returns logits ``[len(inputs), vocab]`` of each
        sequence's last new token, and writes their keys/values into the caches."""
        token_ids: list[int] = []
        positions: list[int] = []
        slices = []
        for item in inputs:
            token_ids.extend(item.token_ids)
            positions.extend(range(item.start, item.start + len(item.token_ids)))
            slices.append(SequenceSlice(item.cache, item.start, len(item.token_ids)))
        tokens = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        return self.model(tokens, pos, slices)

    def warm_up(self, num_tokens: int = 16) -> float:
        """Runs a prefill of ``num_tokens`` and one decode step; returns seconds taken."""
        began = time.perf_counter()
        cache = self.allocate(num_tokens + 1)
        prompt = [i % self.config.vocab_size for i in range(num_tokens)]
        self.run([StepInput(prompt, 0, cache)])
        self.run([StepInput([0], num_tokens, cache)])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - began
