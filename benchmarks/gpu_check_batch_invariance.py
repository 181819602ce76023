"""The GPU check's ``batch_invariance`` stage: does the torch engine give one
prompt the same greedy tokens and logits alone as inside a batch of others, on
the device it runs on?

The engine's model runner (:class:`ModelRunner`, as ``TorchBackend`` builds
it: the attention backend ``auto`` picks, and on CUDA the decode steps
replayed from CUDA graphs captured at ``EngineConfig.graph_batch_sizes()``)
decodes a target prompt greedily for ``new_tokens`` tokens, first alone, then
as one of ``B`` sequences (the others of other lengths, the target in the
middle) prefilled in one step and decoded together. Each batch size is
compared with the run alone: the greedy ids, the first step where they differ,
and the largest ``|logit difference|`` over the steps that share a context (up
to and including the first differing one). Both the engine's default
batch-invariant mode and the plain mode (``--no-batch-invariant``) are
measured, so the report shows what the padding rules buy on this device.

The CPU rules were measured for MKL/oneDNN (``docs/engine.md``, "Batch
invariance"); on CUDA cuBLAS chooses kernels by shape, so this stage is where
a GPU says whether they hold there. The tiny model's shapes are not an 8B's:
a clean result on it does not prove the 8B shapes invariant.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Batch sizes the target prompt is decoded in (1 is the reference: alone).
BATCH_SIZES = (1, 3, 8)
#: Greedy tokens generated per run.
NEW_TOKENS = 16
#: Tokens of the target prompt; the others have :func:`other_prompts`' lengths.
TARGET_LEN = 37
BLOCK_SIZE = 16
#: Largest key length the CUDA graphs are captured for (prompts + new tokens fit).
GRAPH_MAX_LEN = 256


@dataclass(frozen=True)
class Trace:
    """The target's greedy decode in one batch.

    Attributes:
      ids: the ``new_tokens`` greedy token ids.
      logits: float32 ``[new_tokens, vocab_size]`` on the CPU: row ``i`` is
        the logits ``ids[i]`` was the argmax of.
    """

    ids: list[int]
    logits: Any  # torch.Tensor


def prompt(length: int, vocab_size: int, seed: int) -> list[int]:
    """``length`` token ids drawn from ``[1, vocab_size)`` with ``seed``."""
    rng = random.Random(seed)
    return [rng.randrange(1, vocab_size) for _ in range(length)]


def other_prompts(count: int, vocab_size: int) -> list[list[int]]:
    """``count`` prompts of 5 to 95 tokens (13 apart, wrapping), seeds 1.., none
    the target's length."""
    return [prompt(5 + (13 * i) % 91, vocab_size, seed=1 + i) for i in range(count)]


def greedy_in_batch(runner: Any, target: list[int], others: list[list[int]],
                    new_tokens: int) -> Trace:
    """Decodes ``target`` greedily beside ``others`` (all prefilled in one step,
    then one decode step for all per token); the target sits at index
    ``len(others) // 2``.

    Raises:
      ValueError: the KV cache is too small for the batch (see :func:`blocks_needed`).
    """
    import torch

    from services.engine.torch_backend.model_runner import StepInput

    at = len(others) // 2
    seqs = [list(s) for s in others[:at]] + [list(target)] + [list(s) for s in others[at:]]
    tables, first = [], 0
    for seq in seqs:
        count = -(-(len(seq) + new_tokens) // BLOCK_SIZE)
        tables.append(list(range(first, first + count)))
        first += count
    if first > runner.kv_cache.num_blocks:
        raise ValueError(f"the batch needs {first} KV blocks, the cache has "
                         f"{runner.kv_cache.num_blocks}")
    logits = runner.run([StepInput(s, 0, t) for s, t in zip(seqs, tables, strict=True)])
    ids: list[int] = []
    rows = []
    for _ in range(new_tokens):
        step = logits.float()
        rows.append(step[at].cpu())
        chosen = step.argmax(dim=-1).tolist()
        ids.append(chosen[at])
        if len(ids) == new_tokens:
            break
        inputs = []
        for seq, table, token in zip(seqs, tables, chosen, strict=True):
            inputs.append(StepInput([token], len(seq), table))
            seq.append(token)
        logits = runner.run(inputs)
    return Trace(ids, torch.stack(rows))


def compare(alone: Trace, batched: Trace) -> dict[str, Any]:
    """``identical`` (same ids), ``first_divergence`` (the first step whose ids
    differ, None when none does), ``max_abs_logit_diff`` over the steps up to
    and including it (later steps continue from different tokens), and
    ``bit_identical_logits`` over those steps."""
    import torch

    diverged = next((i for i, (a, b) in enumerate(zip(alone.ids, batched.ids, strict=True))
                     if a != b), None)
    upto = len(alone.ids) if diverged is None else diverged + 1
    difference = (alone.logits[:upto] - batched.logits[:upto]).abs().max().item()
    return {"identical": diverged is None, "first_divergence": diverged,
            "max_abs_logit_diff": difference,
            "bit_identical_logits": bool(torch.equal(alone.logits[:upto],
                                                     batched.logits[:upto])),
            "ids": batched.ids}


def blocks_needed(batch_sizes: tuple[int, ...], new_tokens: int, vocab_size: int) -> int:
    """KV blocks of the largest batch (target plus others, each its own blocks)."""
    lengths = [TARGET_LEN] + [len(p) for p in other_prompts(max(batch_sizes) - 1, vocab_size)]
    return sum(-(-(n + new_tokens) // BLOCK_SIZE) for n in lengths)


def measure_mode(model_path: Path, device: str, dtype: str, batch_invariant: bool,
                 batch_sizes: tuple[int, ...], new_tokens: int) -> dict[str, Any]:
    """One mode's runs: the runner built as the engine builds it, then the
    target alone and in each batch size.

    Returns:
      ``identical`` (every batch size), ``max_abs_logit_diff`` (the largest),
      ``attention_backend``, ``cuda_graphs`` (captured sizes, or why none),
      ``probe_failures`` (the engine's start-up probe, batch-invariant mode
      only), ``alone_ids`` and ``batch_sizes`` (:func:`compare` per size > 1).

    Raises:
      ValueError: 1 is not among ``batch_sizes``; see also
        :meth:`ModelRunner.from_path`.
    """
    from services.engine.config import EngineConfig
    from services.engine.torch_backend.cuda_graphs import capture_refusal
    from services.engine.torch_backend.model_runner import ModelRunner
    from services.engine.torch_backend.paged_kv import kv_block_bytes

    if 1 not in batch_sizes:
        raise ValueError(f"batch sizes {batch_sizes}: 1 (the target alone) is the reference")
    runner = ModelRunner.from_path(model_path, device, dtype, batch_invariant=batch_invariant,
                                   attention_backend="auto")
    vocab = runner.config.vocab_size
    probe = runner.probe_batch_invariance() if batch_invariant else None
    blocks = blocks_needed(batch_sizes, new_tokens, vocab)
    runner.allocate_kv_cache(blocks * kv_block_bytes(runner.config, BLOCK_SIZE, runner.dtype),
                             BLOCK_SIZE)
    runner.warm_up()
    graphs: dict[str, Any] = {"captured": []}
    if runner.device.type == "cuda":
        sizes = EngineConfig(max_num_seqs=max(batch_sizes)).graph_batch_sizes()
        reason = capture_refusal(runner.model, runner.kv_cache)
        if reason is None:
            runner.capture_cuda_graphs(sizes, min(GRAPH_MAX_LEN, runner.config.context_length))
            graphs = {"captured": list(sizes)}
        else:
            graphs = {"captured": [], "why_not": reason}
    else:
        graphs["why_not"] = "CUDA graphs are for CUDA devices"
    target = prompt(TARGET_LEN, vocab, seed=0)
    alone = greedy_in_batch(runner, target, [], new_tokens)
    per_size = {str(b): compare(alone, greedy_in_batch(runner, target,
                                                       other_prompts(b - 1, vocab), new_tokens))
                for b in batch_sizes if b != 1}
    return {"batch_invariant_mode": batch_invariant,
            "identical": all(r["identical"] for r in per_size.values()),
            "max_abs_logit_diff": max((r["max_abs_logit_diff"] for r in per_size.values()),
                                      default=0.0),
            "attention_backend": runner.attention_backend, "cuda_graphs": graphs,
            "probe_failures": probe, "alone_ids": alone.ids, "batch_sizes": per_size}


def measure_batch_invariance(model_path: Path, device: str, dtype: str,
                             batch_sizes: tuple[int, ...] = BATCH_SIZES,
                             new_tokens: int = NEW_TOKENS) -> dict[str, Any]:
    """The stage's report: the engine's default (batch-invariant) mode's
    ``identical`` and ``max_abs_logit_diff`` on top, both modes in full under
    ``modes`` (see :func:`measure_mode`), and the seconds taken.

    Raises:
      ValueError, RuntimeError: the model cannot be loaded or run on ``device``.
    """
    began = time.monotonic()
    modes = {name: measure_mode(model_path, device, dtype, flag, batch_sizes, new_tokens)
             for name, flag in (("batch_invariant", True), ("plain", False))}
    default = modes["batch_invariant"]
    return {"device": device, "dtype": dtype, "model": str(model_path),
            "target_prompt_tokens": TARGET_LEN, "new_tokens": new_tokens,
            "batch_sizes": list(batch_sizes),
            "identical": default["identical"],
            "max_abs_logit_diff": default["max_abs_logit_diff"],
            "modes": modes, "seconds": round(time.monotonic() - began, 3)}
