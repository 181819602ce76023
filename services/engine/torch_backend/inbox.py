"""The engine core's command inbox and request table.

Any thread (an event loop's, a test's) hands work to the engine thread through
an :class:`Inbox`: ``submit`` and ``cancel`` append commands, the engine thread
takes them in at its next intake point (before each step and before each
layer of a forward, see :mod:`~services.engine.torch_backend.engine_core`).
Only the engine thread touches the scheduler and the KV cache; the inbox is the
one place the two sides meet, behind one small lock that is held for a few
list operations and never during a step (the shape of TGI's router queue:
one owner of the state, fed by commands; ``backends/v3/src/queue.rs``).

The inbox owns the request table, id → in-flight :class:`Sequence`, so the
checks that need it are exact and immediate under concurrent callers:

* a request id already in flight is refused (DuplicateRequestError); two
  callers racing with one id: exactly one wins;
* at most ``max_in_flight`` requests are in flight (``max_num_seqs`` running +
  ``max_num_waiting`` waiting); the next one is refused (QueueFullError);
* a cancel takes the id out of the table at once: the id may be submitted
  again before the engine thread has freed the old sequence (the two are
  different :class:`Sequence` objects; the engine keys its state by
  ``Sequence.arrival``, never by request id);
* a cancel of a request the engine thread has not yet taken in resolves on
  the caller's side: the sequence never reaches the engine, and the caller
  delivers its CANCELLED delta (``cancel`` returns it).

Exactly one side delivers a sequence's final delta: the caller for a
sequence cancelled while pending, else the engine thread (or ``stop`` once it
has ended).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from services.common.sampling import FinishReason
from services.engine.backend import DuplicateRequestError, EngineUnavailableError, QueueFullError
from services.engine.torch_backend.sequence import Sequence


@dataclass
class Intake:
    """What the engine thread takes in at one intake point.

    Attributes:
      submits: new sequences, in submission order.
      cancels: sequences taken in earlier and cancelled since (the whole
        request: every choice).
      choice_cancels: (choice 0, index) of one choice of a request with
        ``sampling.n`` > 1 cancelled alone since (the others go on).
    """

    submits: list[Sequence] = field(default_factory=list)
    cancels: list[Sequence] = field(default_factory=list)
    choice_cancels: list[tuple[Sequence, int]] = field(default_factory=list)


class Inbox:
    """Commands for the engine thread plus the request table. Thread-safe.

    Args:
      max_num_seqs, max_num_waiting: their sum is the most requests in flight
        (waiting, running, or submitted and not yet taken in); ``submit``
        raises QueueFullError beyond.
    """

    def __init__(self, max_num_seqs: int, max_num_waiting: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_waiting = max_num_waiting
        self.max_in_flight = max_num_seqs + max_num_waiting
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._table: dict[str, Sequence] = {}
        self._pending: list[Sequence] = []  # submitted, not yet taken in
        self._cancels: list[Sequence] = []  # taken in, cancelled since
        self._choice_cancels: list[tuple[Sequence, int]] = []
        self._accepting = False
        self._stopping = False

    # ---- any thread ---------------------------------------------------------------

    def submit(self, seq: Sequence) -> None:
        """Puts ``seq`` in the table and the inbox.

        Raises:
          EngineUnavailableError: the engine thread is not running, or stopping.
          DuplicateRequestError: its request id is in flight.
          QueueFullError: ``max_in_flight`` requests are in flight. A request
            that takes a free sequence slot at the next step never counts as
            waiting: a burst into an idle engine may fill the slots and the queue.
        """
        with self._lock:
            if not self._accepting or self._stopping:
                raise EngineUnavailableError("the torch engine is not running")
            request_id = seq.request_id
            if request_id in self._table:
                raise DuplicateRequestError(f"request {request_id!r} is already running")
            if len(self._table) >= self.max_in_flight:
                raise QueueFullError(
                    f"{len(self._table)} requests are in flight, the most this engine holds "
                    f"({self.max_num_seqs} running + limit {self.max_num_waiting} beyond "
                    "the free slots)")
            self._table[request_id] = seq
            self._pending.append(seq)
            self._ready.notify()

    def cancel(self, request_id: str, seq: Sequence | None = None) -> tuple[bool, Sequence | None]:
        """Cancels the in-flight request ``request_id`` (only if it is ``seq``,
        when given): its id leaves the table now.

        Returns:
          (found, resolved): ``found`` False when it is not in flight;
          ``resolved`` the sequence, finished CANCELLED here, when the engine
          thread had not taken it in yet: the caller delivers its last delta.
          Otherwise the engine thread applies the cancel at its next intake.
        """
        with self._lock:
            live = self._table.get(request_id)
            if live is None or (seq is not None and live is not seq):
                return False, None
            del self._table[request_id]
            if live in self._pending:
                self._pending.remove(live)
                live.cancelled = True
                live.finish_reason = FinishReason.CANCELLED
                return True, live
            self._cancels.append(live)
            self._ready.notify()
            return True, None

    def cancel_choice(self, request_id: str, index: int, seq: Sequence | None = None) -> bool:
        """Cancels choice ``index`` alone of the in-flight request ``request_id``
        (only if it is ``seq``, when given); its other choices go on, and its id
        stays in the table until they finished. The engine thread applies it at
        its next intake (before the fork, at the fork).

        Returns:
          False when the request is not in flight or has no such unfinished choice.
        """
        with self._lock:
            live = self._table.get(request_id)
            if live is None or (seq is not None and live is not seq):
                return False
            choices = live.choices
            if not 0 <= index < len(choices) or choices[index].finished:
                return False
            self._choice_cancels.append((live, index))
            self._ready.notify()
            return True

    @property
    def stopping(self) -> bool:
        """True once :meth:`close` was called."""
        return self._stopping

    def __len__(self) -> int:
        """Requests in flight (not cancelled, not finished)."""
        return len(self._table)

    # ---- the engine thread --------------------------------------------------------

    def open(self) -> None:
        """Starts accepting submits (the engine thread runs). Mutates."""
        with self._lock:
            self._accepting = True

    def has_commands(self) -> bool:
        """True when an intake would take something in. Lock-free (a length read)."""
        return bool(self._pending) or bool(self._cancels) or bool(self._choice_cancels)

    def take(self) -> Intake:
        """Everything submitted or cancelled since the last call. Mutates."""
        with self._lock:
            intake = Intake(self._pending, self._cancels, self._choice_cancels)
            self._pending, self._cancels, self._choice_cancels = [], [], []
            return intake

    def wait(self) -> bool:
        """Blocks until a command arrives or :meth:`close`; False once stopping."""
        with self._lock:
            while (not self._stopping and not self._pending and not self._cancels
                   and not self._choice_cancels):
                self._ready.wait()
            return not self._stopping

    def finished_all(self, seqs: list[Sequence]) -> None:
        """Takes the request of each finished sequence of ``seqs`` out of the
        table once all its choices finished (unless its id already left it, with
        a cancel, and may belong to a newer request). Mutates."""
        with self._lock:
            for seq in seqs:
                head = seq.choices[0]
                if self._table.get(seq.request_id) is head and head.all_choices_finished:
                    del self._table[seq.request_id]

    # ---- stop ---------------------------------------------------------------------

    def close(self) -> None:
        """Refuses further submits and wakes the engine thread to stop. Idempotent."""
        with self._lock:
            self._stopping = True
            self._ready.notify_all()

    def clear(self) -> list[Sequence]:
        """Empties the inbox and the table once the engine thread has ended;
        returns the submitted sequences it never took in."""
        with self._lock:
            left, self._pending, self._cancels = self._pending, [], []
            self._choice_cancels = []
            self._table.clear()
            return left
