"""What an engine replica serves and how loaded it is (engine → router:
``GetModelInfo``, ``GetLoad``, ``StreamLoad``)."""

from __future__ import annotations

from dataclasses import dataclass

from llmesh.v1 import engine_pb2
from services.common.step_profile import StepProfile


@dataclass(frozen=True)
class ModelInfo:
    """The served model's identity and limits.

    Attributes:
      model: model id as clients name it (e.g. ``SmolLM2-135M-Instruct``).
      max_model_len: context window in tokens (prompt + completion).
      vocab_size: number of token ids; valid ids are ``[0, vocab_size)``.
      eos_token_ids: ids that end a sequence unless ``ignore_eos`` is set.
      backend: backend name, ``"torch"`` or ``"tensorrt_llm"``.
      max_num_seqs: most sequences in the running batch; 0 when not known.
      kv_capacity_tokens: tokens the KV cache holds (blocks x block size); 0
        when not known. The router sizes its per-replica concurrency cap from
        these two.
      replica_id: names the replica in the prefix index; set by the engine's
        service edge (the backend does not know it), "" until then.
      kv_block_size: tokens per KV block; 0 when the engine has no prefix cache
        whose blocks the router can name.
      kv_hash_seed: the block hash seed (:func:`services.common.block_hash.block_hash_seed`)
        of the engine's prefix cache; b"" with no prefix cache. With
        ``kv_block_size`` it lets the router hash a prompt's blocks as the
        engine does.
      max_num_batched_tokens: the engine's step token budget; 0 when not known
        (set by the service edge, like ``replica_id``).
      kv_offload_blocks: blocks the KV offload tier holds at most (0: no
        tier). Engine-side only: not in ``GetModelInfo`` (the KV event feed's
        hello carries it to the cache service), so 0 in the router.
    """

    model: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    backend: str
    max_num_seqs: int = 0
    kv_capacity_tokens: int = 0
    replica_id: str = ""
    kv_block_size: int = 0
    kv_hash_seed: bytes = b""
    max_num_batched_tokens: int = 0
    kv_offload_blocks: int = 0

    @classmethod
    def from_pb(cls, pb: engine_pb2.GetModelInfoResponse) -> ModelInfo:
        return cls(
            model=pb.model, max_model_len=pb.max_model_len, vocab_size=pb.vocab_size,
            eos_token_ids=tuple(pb.eos_token_ids), backend=pb.backend,
            max_num_seqs=pb.max_num_seqs, kv_capacity_tokens=pb.kv_capacity_tokens,
            replica_id=pb.replica_id, kv_block_size=pb.kv_block_size,
            kv_hash_seed=pb.kv_hash_seed, max_num_batched_tokens=pb.max_num_batched_tokens,
        )

    def to_pb(self) -> engine_pb2.GetModelInfoResponse:
        return engine_pb2.GetModelInfoResponse(
            model=self.model, max_model_len=self.max_model_len, vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids, backend=self.backend,
            max_num_seqs=self.max_num_seqs, kv_capacity_tokens=self.kv_capacity_tokens,
            replica_id=self.replica_id, kv_block_size=self.kv_block_size,
            kv_hash_seed=self.kv_hash_seed, max_num_batched_tokens=self.max_num_batched_tokens,
        )


@dataclass(frozen=True)
class LoadStats:
    """A snapshot of an engine's load, for routing and admission.

    Attributes:
      num_running: sequences in the running batch.
      num_waiting: sequences admitted but not yet running.
      kv_cache_usage: fraction of KV cache memory in use, 0..1.
      num_pending_prefill_tokens: prompt tokens admitted but not yet computed
        (waiting sequences, and running ones still in prefill).
      step_profile: the engine's measured step costs (empty: none measured;
        the router's routing cost then uses priors).
    """

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_pending_prefill_tokens: int = 0
    step_profile: StepProfile = StepProfile()

    @classmethod
    def from_pb(cls, pb: engine_pb2.GetLoadResponse) -> LoadStats:
        """The typed load; a step profile with a negative or non-finite entry
        counts as none (the routing cost falls back to priors)."""
        try:
            profile = StepProfile(pb.prefill_seconds_per_token, tuple(pb.decode_step_seconds),
                                  pb.restore_seconds_per_token)
        except ValueError:
            profile = StepProfile()
        return cls(pb.num_running, pb.num_waiting, pb.kv_cache_usage,
                   pb.num_pending_prefill_tokens, profile)

    def to_pb(self) -> engine_pb2.GetLoadResponse:
        profile = self.step_profile
        return engine_pb2.GetLoadResponse(
            num_running=self.num_running, num_waiting=self.num_waiting,
            kv_cache_usage=self.kv_cache_usage,
            num_pending_prefill_tokens=self.num_pending_prefill_tokens,
            prefill_seconds_per_token=profile.prefill_token_s,
            decode_step_seconds=profile.decode_step_s,
            restore_seconds_per_token=profile.restore_token_s,
        )
