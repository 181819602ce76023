"""Which model the backend contract suite runs the torch backend on, and what it expects.

By default the suite uses the session's shared SmolLM2 backend (CPU) and the
answers recorded in :mod:`tests.engine.prompts`. Setting
``LLMESH_CONTRACT_MODEL`` to a Hugging Face Llama checkpoint directory with
SmolLM2's vocabulary (the GPU check's random-weight ones,
``benchmarks/gpu_check_models.py``) runs the same tests on a torch backend
loaded from it on ``LLMESH_CONTRACT_DEVICE`` (default ``cpu``; ``cuda`` on a
GPU) in ``LLMESH_CONTRACT_DTYPE`` (default ``float32``, so that greedy ids
match the reference to the last token); the expected greedy answer is then
computed by ``transformers`` (``LlamaForCausalLM``, float32, CPU) from the
same files, independently of llmesh's engine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .prompts import CHAT, CHAT_GREEDY, EOS

MODEL_ENV = "LLMESH_CONTRACT_MODEL"
DEVICE_ENV = "LLMESH_CONTRACT_DEVICE"
DTYPE_ENV = "LLMESH_CONTRACT_DTYPE"
#: max_tokens of the greedy tests.
GREEDY_MAX_TOKENS = 16


@dataclass(frozen=True)
class ContractReference:
    """What the contract tests expect of the model they run on.

    Attributes:
      vocab_size: the model's vocabulary (ids >= it are invalid).
      eos: its end-of-sequence id.
      chat_greedy: the greedy answer to ``CHAT`` with ``max_tokens=16``,
        ending with ``eos`` when the model stops by itself.
      stop_index: an index of ``chat_greedy`` whose token occurs there first
        (the stop-token test stops on it).
    """

    vocab_size: int
    eos: int
    chat_greedy: tuple[int, ...]
    stop_index: int

    @property
    def stops_by_itself(self) -> bool:
        """True when the greedy answer ends with EOS inside 16 tokens."""
        return self.chat_greedy[-1] == self.eos


SMOLLM2 = ContractReference(vocab_size=49152, eos=EOS, chat_greedy=CHAT_GREEDY, stop_index=3)


def contract_model() -> Path | None:
    """``$LLMESH_CONTRACT_MODEL`` as a path, or None (SmolLM2's shared backend)."""
    value = os.environ.get(MODEL_ENV)
    return Path(value) if value else None


def contract_device() -> str:
    return os.environ.get(DEVICE_ENV) or "cpu"


def contract_dtype() -> str:
    return os.environ.get(DTYPE_ENV) or "float32"


def first_new_index(tokens: tuple[int, ...], at_most: int = 3) -> int:
    """The largest index <= ``at_most`` whose token does not occur before it (0 at worst)."""
    for index in range(min(at_most, len(tokens) - 1), 0, -1):
        if tokens[index] not in tokens[:index]:
            return index
    return 0


def hf_reference(path: Path) -> ContractReference:
    """The expectations for the checkpoint at ``path``, computed with transformers
    (full-recompute greedy decoding of ``CHAT`` in float32 on CPU; seconds for a
    small model).

    Raises:
      OSError: ``path`` holds no loadable checkpoint.
    """
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    eos = int(model.config.eos_token_id)
    ids = list(CHAT)
    answer: list[int] = []
    with torch.no_grad():
        while len(answer) < GREEDY_MAX_TOKENS:
            logits = model(torch.tensor([ids])).logits[0, -1]
            token = int(torch.argmax(logits))
            answer.append(token)
            ids.append(token)
            if token == eos:
                break
    greedy = tuple(answer)
    return ContractReference(vocab_size=int(model.config.vocab_size), eos=eos,
                             chat_greedy=greedy, stop_index=first_new_index(greedy))
