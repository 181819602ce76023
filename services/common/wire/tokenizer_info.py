"""Facts about a loaded tokenizer (tokenizer → router: ``GetTokenizerInfo``)."""

from __future__ import annotations

from dataclasses import dataclass

from llmesh.v1 import tokenizer_pb2


@dataclass(frozen=True, slots=True)
class TokenizerInfo:
    """Facts about a loaded tokenizer.

    Attributes:
      model: model name (GGUF file name up to its first dot unless given).
      vocab_size: number of token ids, added tokens included; valid ids are
        ``0 <= id < vocab_size``.
      eos_token_ids: ids that end a generation, sorted: the tokenizer's EOS,
        the GGUF's ``eot``/``eom`` ids when present, and the chat template's
        end-of-turn token (e.g. ``<|im_end|>``) when it is a special token.
      bos_token_id: the BOS id, ``None`` when the tokenizer has none.
      has_chat_template: whether the tokenizer can apply a chat template.
      chat_roles: the roles its chat template accepts; empty without one.
    """

    model: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    has_chat_template: bool
    chat_roles: tuple[str, ...] = ()

    @classmethod
    def from_pb(cls, pb: tokenizer_pb2.GetTokenizerInfoResponse) -> TokenizerInfo:
        return cls(
            model=pb.model, vocab_size=pb.vocab_size, eos_token_ids=tuple(pb.eos_token_ids),
            bos_token_id=pb.bos_token_id if pb.HasField("bos_token_id") else None,
            has_chat_template=pb.has_chat_template, chat_roles=tuple(pb.chat_roles),
        )

    def to_pb(self) -> tokenizer_pb2.GetTokenizerInfoResponse:
        return tokenizer_pb2.GetTokenizerInfoResponse(
            model=self.model, vocab_size=self.vocab_size, eos_token_ids=self.eos_token_ids,
            bos_token_id=self.bos_token_id, has_chat_template=self.has_chat_template,
            chat_roles=self.chat_roles,
        )
