"""Stop-string matching on streamed text.

The engine matches stop *token ids*; stop *strings* are matched here, on the
detokenized text, because a stop string may span several tokens and a token
may hold part of one.

:class:`StopStringMatcher` is fed text deltas and returns only text that can
never become part of a stop string: it holds back the longest suffix of the
pending text that is a prefix of some stop string (the least it can hold) and
releases it as soon as the next text shows that it does not start a stop
string. Compare vLLM, which holds back a fixed ``max(len(stop)) - 1``
characters, and TGI, which matches a regex on a rolling buffer: holding back
only a real prefix keeps streaming smooth when no stop string is near.

Which stop matches: the occurrence that *ends* first in the text (on a tie,
the one that starts first, i.e. the longest). That is the stop that a
token-by-token stream completes first, so the result does not depend on how
the text is cut into deltas.
"""

from __future__ import annotations

from collections.abc import Iterable


class StopStringMatcher:
    """Streams text through, cutting it at the first stop string.

    Usage::

        matcher = StopStringMatcher(["\\n\\n", "User:"])
        for delta in deltas:
            safe, stop = matcher.feed(delta)
            send(safe)
            if stop is not None:
                break              # generation ends with FINISH_REASON_STOP
        else:
            send(matcher.flush())  # end of sequence: release what is held

    Lengths are in Unicode code points (Python ``str``), never bytes.
    """

    def __init__(self, stops: Iterable[str], include_stop: bool = False) -> None:
        """Args:
          stops: stop strings; empty strings are ignored, duplicates merged.
          include_stop: on a match, the released text ends with the stop string
            itself (vLLM's ``include_stop_str_in_output``) instead of right before it.
        """
        self._include_stop = include_stop
        self._stops: tuple[str, ...] = tuple(sorted({s for s in stops if s}, key=len))
        # Every proper prefix of every stop: a pending suffix in this set may
        # still grow into a stop string.
        self._prefixes: frozenset[str] = frozenset(
            stop[:n] for stop in self._stops for n in range(1, len(stop))
        )
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
        self._held = ""
        self._matched: str | None = None
        self._match_end: int | None = None

    @property
    def stops(self) -> tuple[str, ...]:
        """The stop strings, shortest first."""
        return self._stops

    @property
    def held(self) -> str:
        """Text received but not yet released (a possible start of a stop string)."""
        return self._held

    @property
    def matched(self) -> str | None:
        """The stop string that ended the text, or None while none has."""
        return self._matched

    @property
    def match_end(self) -> int | None:
        """After a match: how many leading code points of the delta that
        completed it run through the stop string's last character (>= 1).

        The router maps it to the token that completed the stop string (see
        :meth:`services.common.detokenizer.IncrementalDetokenizer.add_with_ends`), so that ids and
        usage end there even when one engine message carried several tokens.
        None while nothing matched.
        """
        return self._match_end

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Adds ``delta`` to the text.

        Returns:
          ``(safe, stop)``: ``safe`` is text that may be sent now (possibly
          empty); ``stop`` is the matched stop string, or None. On a match,
          ``safe`` ends right before the stop string (right after it with
          ``include_stop``), and everything after it (and any later feed) is
          dropped: further calls return ``("", stop)``.
        """
        if self._matched is not None:
            return "", self._matched
        if not self._stops:
            return delta, None
        pending = self._held + delta
        found = self._first_match(pending)
        if found is not None:
            start, stop = found
            # The held text holds no whole stop (it would have matched), so the
            # stop ends inside this delta.
            self._match_end = start + len(stop) - len(self._held)
            self._held = ""
            self._matched = stop
            return pending[:start + len(stop) if self._include_stop else start], stop
        hold = self._hold_length(pending)
        cut = len(pending) - hold
        self._held = pending[cut:]
        return pending[:cut], None

    def flush(self) -> str:
        """Releases the held text at the end of the sequence ("" after a match)."""
        held, self._held = self._held, ""
        return "" if self._matched is not None else held

    def _first_match(self, text: str) -> tuple[int, str] | None:
        """(start, stop) of the occurrence that ends first, ties to the longest."""
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = text.find(stop)
            if start < 0:
                continue
            candidate = (start + len(stop), start, stop)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        return None if best is None else (best[1], best[2])

    def _hold_length(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop."""
        for n in range(min(self._max_hold, len(text)), 0, -1):
            if text[-n:] in self._prefixes:
                return n
        return 0
