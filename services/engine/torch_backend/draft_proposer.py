"""The draft-model proposer: a smaller model with the target's tokenizer guesses ``k`` tokens.

The draft runs through the same :class:`ModelRunner` code as the target, with
its own paged KV storage and its own block tables (a
:class:`KVCacheManager` without prefix caching) that mirror the target's
sequences: for each sequence it holds the draft keys/values of the tokens it
has fed, catches up on the tokens verified since (its first draft step of a
round is a chunk: the accepted tokens and the target's own token), then runs
``k - 1`` one-token steps, all sequences batched in each. Proposals are the
draft's argmax (vLLM v1 drafts greedily too), so verification treats them as
point masses. After verification, the draft's computed count falls back to the
tokens it fed that were accepted; the slots past it are overwritten later.
State of a sequence that no longer runs is freed by :meth:`DraftProposer.retain`.

No smaller SmolLM2 than the 135M target can be installed here, so the default
draft is :func:`truncated_model`: the target's first ``N`` layers with its
final norm and LM head, sharing the target's weights (no copy). A GGUF with
the same vocabulary can be given instead (``--draft-model``).
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Sequence as SequenceOf
from dataclasses import dataclass, field, replace

from torch import nn

from services.engine.torch_backend.kv_cache_manager import KVCacheManager
from services.engine.torch_backend.model import LlamaModel
from services.engine.torch_backend.model_runner import ModelRunner, StepInput
from services.engine.torch_backend.paged_kv import kv_block_bytes
from services.engine.torch_backend.sequence import Sequence


def truncated_model(model: LlamaModel, num_layers: int) -> LlamaModel:
    """A draft made of ``model``'s first ``num_layers`` decoder layers, its final
    norm and LM head. Shares every tensor with ``model`` (a shallow copy with a
    shorter layer list); ``model`` is unchanged.

    Raises:
      ValueError: ``num_layers`` outside ``[1, model's layers]``.
    """
    layers = list(model.layers)
    if not 1 <= num_layers <= len(layers):
        raise ValueError(f"draft_num_layers must be in [1, {len(layers)}], got {num_layers}")
    draft = copy.copy(model)
    # nn.Module keeps submodules/parameters/buffers in dicts: give the copy its own.
    draft._modules = dict(model._modules)
    draft._parameters = dict(model._parameters)
    draft._buffers = dict(model._buffers)
    draft.layers = nn.ModuleList(layers[:num_layers])
    draft.config = replace(model.config, num_layers=num_layers)
    return draft


@dataclass
class _DraftState:
    """One sequence's draft cache: ``shadow.num_computed_tokens`` tokens are in its
    blocks; of them, those from ``base`` on were fed as ``fed`` (own proposals,
    unverified when fed)."""

    shadow: Sequence
    base: int = 0
    fed: list[int] = field(default_factory=list)


class DraftProposer:
    """Greedy ``k``-token proposals from a draft model.

    Args:
      runner: the draft's model runner, its KV storage allocated (same block
        size as its ``kv`` manager).
    """

    def __init__(self, runner: ModelRunner) -> None:
        cache = runner.kv_cache
        if cache is None:
            raise ValueError("allocate the draft runner's KV cache first")
        self.runner = runner
        self.kv = KVCacheManager(cache.num_blocks, cache.block_size, enable_caching=False)
        self._states: dict[int, _DraftState] = {}  # by Sequence.arrival

    def propose(self, requests: SequenceOf[tuple[Sequence, int]]) -> list[list[int]]:
        """Up to ``k`` greedy draft tokens per ``(sequence, k)``; fewer for a
        sequence whose draft blocks run out."""
        proposals: list[list[int]] = [[] for _ in requests]
        feeds: dict[int, list[int]] = {}
        for index, (seq, _) in enumerate(requests):
            state = self._sync(seq)
            feeds[index] = seq.token_ids[state.shadow.num_computed_tokens:]
        while feeds:
            active = [i for i in feeds if self.kv.allocate_slots(
                self._states[requests[i][0].arrival].shadow, len(feeds[i]))]
            if not active:
                break
            inputs = []
            for i in active:
                shadow = self._states[requests[i][0].arrival].shadow
                inputs.append(StepInput(feeds[i], shadow.num_computed_tokens,
                                        self.kv.block_ids(shadow),
                                        prompt_len=shadow.num_prompt_tokens))
            tokens = self.runner.run(inputs).argmax(dim=-1).tolist()
            next_feeds: dict[int, list[int]] = {}
            for i, token in zip(active, tokens):
                seq, k = requests[i]
                state = self._states[seq.arrival]
                state.shadow.num_computed_tokens += len(feeds[i])
                proposals[i].append(token)
                if len(proposals[i]) < k:
                    if not state.fed:
                        state.base = seq.num_tokens
                    state.fed.append(token)
                    next_feeds[i] = [token]
            feeds = next_feeds
        return proposals

    def retain(self, keys: Collection[int]) -> None:
        """Frees the draft blocks of sequences whose ``arrival`` is not in ``keys``."""
        for key in [k for k in self._states if k not in keys]:
            self.kv.free(self._states.pop(key).shadow)

    def check_integrity(self, idle: bool = False) -> None:
        """See :meth:`KVCacheManager.check_integrity` (the draft's blocks)."""
        self.kv.check_integrity(idle=idle)

    def _sync(self, seq: Sequence) -> _DraftState:
        """The sequence's state with its computed count moved back to the fed
        tokens that were verified (its last round's proposals that were accepted)."""
        state = self._states.get(seq.arrival)
        if state is None:
            state = self._states[seq.arrival] = _DraftState(Sequence(seq.request, seq.arrival))
            return state
        if state.fed:
            tokens = seq.token_ids
            accepted = 0
            for offset, token in enumerate(state.fed):
                position = state.base + offset
                if position >= len(tokens) - 1 or tokens[position] != token:
                    break
                accepted += 1
            state.shadow.num_computed_tokens = state.base + accepted
            state.fed.clear()
        return state


def draft_runner(model: LlamaModel, target: ModelRunner, num_blocks: int,
                 block_size: int) -> ModelRunner:
    """A runner for the draft ``model`` on the target's device, dtype and
    batch-invariance setting, with ``num_blocks`` KV blocks."""
    runner = ModelRunner(model, target.device, target.dtype, target.batch_invariant,
                         target.attention_backend)
    bytes_needed = num_blocks * kv_block_bytes(model.config, block_size, target.dtype)
    runner.allocate_kv_cache(bytes_needed, block_size)
    return runner
