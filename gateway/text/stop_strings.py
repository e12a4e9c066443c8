"""Stop strings over streamed text: release what is safe, hold what might start a stop.

A stop string may arrive split over several chunks, so a matcher holds back the longest
suffix of the text seen so far that is a prefix of some stop string, and releases it once
it can no longer become one. The stop string itself is never emitted.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StopResult:
    """What one :meth:`StopStringMatcher.feed` call releases.

    ``text`` is safe to emit now. ``matched`` is the stop string that ended the text, or
    None; when set, ``text`` is everything before the stop and the stream is over.
    """

    text: str
    matched: str | None = None


class StopStringMatcher:
    """Finds the first stop string in text fed in chunks; one instance per sequence.

    Which stop wins: the one whose last character arrives first; among stops ending at the
    same character, the one starting earliest (the longer). For stops where neither lies
    inside the other this is simply the earliest position. Deciding by end position means
    the result never depends on how the text was chunked, and generation can stop as soon
    as any stop string is complete.

    After a match the matcher is finished: :meth:`feed` raises RuntimeError and
    :meth:`flush` returns "". After :meth:`flush` without a match, feeding may continue.
    """

    __slots__ = ("_stops", "_stop_prefixes", "_max_held_len", "_held", "_matched")

    def __init__(self, stops: Sequence[str]) -> None:
        """``stops`` may be empty (text passes through) or hold duplicates; "" is rejected."""
        if isinstance(stops, str):
            raise ValueError("stops must be a sequence of strings, not a single string")
        for stop in stops:
            if not isinstance(stop, str) or not stop:
                raise ValueError(f"stop strings must be non-empty str, got {stop!r}")
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(stops))
        self._stop_prefixes: frozenset[str] = frozenset(stop[:n] for stop in self._stops for n in range(1, len(stop)))
        self._max_held_len = max((len(stop) for stop in self._stops), default=1) - 1
        self._held = ""
        self._matched: str | None = None

    @property
    def is_stopped(self) -> bool:
        """Whether a stop string has matched."""
        return self._matched is not None

    @property
    def held_text(self) -> str:
        """Text received but not yet released (a possible start of a stop string)."""
        return self._held

    def feed(self, text: str) -> StopResult:
        """Add ``text``; return what is now safe to emit and the stop that matched, if any.

        Mutates the held text. Raises RuntimeError if a stop already matched.
        """
        if self._matched is not None:
            raise RuntimeError(f"stop string {self._matched!r} already matched; stream is over")
        if not self._stops:
            return StopResult(text)
        buffer = self._held + text
        match = self._first_match(buffer)
        if match is not None:
            start, stop = match
            self._held = ""
            self._matched = stop
            return StopResult(buffer[:start], stop)
        num_held = self._num_held_chars(buffer)
        self._held = buffer[len(buffer) - num_held :]
        return StopResult(buffer[: len(buffer) - num_held])

    def flush(self) -> str:
        """Release the held text at the end of generation; "" after a match."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, buffer: str) -> tuple[int, str] | None:
        """(start, stop) of the match that ends first, earliest start breaking ties."""
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = buffer.find(stop)
            if start < 0:
                continue
            key = (start + len(stop), start, stop)
            if best is None or key[:2] < best[:2]:
                best = key
        if best is None:
            return None
        return best[1], best[2]

    def _num_held_chars(self, buffer: str) -> int:
        """Length of the longest suffix of ``buffer`` that is a proper prefix of a stop."""
        for num_chars in range(min(len(buffer), self._max_held_len), 0, -1):
            if buffer[-num_chars:] in self._stop_prefixes:
                return num_chars
        return 0
