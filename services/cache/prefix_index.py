"""The prefix index: which engine replica holds which KV blocks (interim: in-memory only)."""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from services.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

ReplicaId = str


class PrefixIndex(abc.ABC):
    backend: ClassVar[str]

    async def start(self) -> None:  # noqa: B027
        """Connects."""

    @abc.abstractmethod
    async def register(self, replica: ReplicaId, epoch: int, capacity_blocks: int) -> bool: ...

    @abc.abstractmethod
    async def held_epoch(self, replica: ReplicaId) -> int | None: ...

    @abc.abstractmethod
    async def replace(self, replica: ReplicaId, epoch: int, hashes: Sequence[bytes]) -> bool: ...

    @abc.abstractmethod
    async def apply(self, replica: ReplicaId, epoch: int, events: Sequence[KVEvent]) -> bool: ...

    @abc.abstractmethod
    async def heartbeat(self, replica: ReplicaId, epoch: int) -> bool: ...

    @abc.abstractmethod
    async def drop(self, replica: ReplicaId, epoch: int) -> None: ...

    @abc.abstractmethod
    async def score(self, hashes: Sequence[bytes]) -> dict[ReplicaId, int]: ...

    @abc.abstractmethod
    async def sizes(self) -> dict[ReplicaId, int]: ...

    async def close(self) -> None:  # noqa: B027
        """Releases."""


@dataclass
class _Replica:
    epoch: int
    capacity: int
    expires_at: float
    hashes: set[bytes] = field(default_factory=set)


class MemoryPrefixIndex(PrefixIndex):
    backend = "memory"

    def __init__(self, liveness_ttl_s: float = 1.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl = liveness_ttl_s
        self._clock = clock
        self._replicas: dict[ReplicaId, _Replica] = {}

    def _live(self, replica: ReplicaId, epoch: int | None = None) -> _Replica | None:
        state = self._replicas.get(replica)
        if state is None:
            return None
        if state.expires_at <= self._clock():
            del self._replicas[replica]
            return None
        if epoch is not None and state.epoch != epoch:
            return None
        state.expires_at = self._clock() + self._ttl
        return state

    async def register(self, replica: ReplicaId, epoch: int, capacity_blocks: int) -> bool:
        state = self._live(replica)
        if state is not None and state.epoch > epoch:
            return False
        if state is None or state.epoch != epoch:
            self._replicas[replica] = _Replica(epoch, capacity_blocks, self._clock() + self._ttl)
        return True

    async def held_epoch(self, replica: ReplicaId) -> int | None:
        state = self._replicas.get(replica)
        return None if state is None else state.epoch

    async def replace(self, replica: ReplicaId, epoch: int, hashes: Sequence[bytes]) -> bool:
        state = self._live(replica, epoch)
        if state is None or len(set(hashes)) > state.capacity:
            return False
        state.hashes = set(hashes)
        return True

    async def apply(self, replica: ReplicaId, epoch: int, events: Sequence[KVEvent]) -> bool:
        state = self._live(replica, epoch)
        if state is None:
            return False
        for event in events:
            if isinstance(event, BlockStored):
                state.hashes.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                state.hashes.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                state.hashes.clear()
        return len(state.hashes) <= state.capacity

    async def heartbeat(self, replica: ReplicaId, epoch: int) -> bool:
        return self._live(replica, epoch) is not None

    async def drop(self, replica: ReplicaId, epoch: int) -> None:
        state = self._replicas.get(replica)
        if state is not None and state.epoch == epoch:
            del self._replicas[replica]

    async def score(self, hashes: Sequence[bytes]) -> dict[ReplicaId, int]:
        now = self._clock()
        out: dict[ReplicaId, int] = {}
        for replica, state in list(self._replicas.items()):
            if state.expires_at <= now:
                del self._replicas[replica]
                continue
            count = 0
            for value in hashes:
                if value not in state.hashes:
                    break
                count += 1
            if count:
                out[replica] = count
        return out

    async def sizes(self) -> dict[ReplicaId, int]:
        now = self._clock()
        return {r: len(s.hashes) for r, s in self._replicas.items() if s.expires_at > now}
