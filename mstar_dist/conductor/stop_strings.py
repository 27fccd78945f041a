"""Cutting generated text at stop strings, for streamed and whole responses alike."""

from __future__ import annotations


class StopTrimmer:
    """Feeds text deltas through and cuts the text at the earliest stop string.

    Text that could be the beginning of a stop string is held back until the next delta settles it, so a stop
    string split across deltas ("ST" + "OP") is never partly shown to the client. After a match every later
    delta yields "" and ``stopped`` is True.
    """

    def __init__(self, stops: list[str], include: bool = False) -> None:
        """``include``: the text keeps the stop string that ended it (vLLM's ``include_stop_str_in_output``)."""
        self._stops = [s for s in stops if s]
        self._include = include
        self._pending = ""
        self.stopped = False

    def feed(self, text: str, armed: bool = True) -> str:
        """Returns the part of ``pending + text`` that is safe to show now. Not ``armed`` (the request has not made
        its ``min_tokens`` yet): nothing is looked for, everything is shown."""
        if self.stopped:
            return ""
        if not self._stops:
            return text
        buf = self._pending + text
        if not armed:
            self._pending = ""
            return buf
        hits = [(i, i + len(s)) for i, s in ((buf.find(s), s) for s in self._stops) if i >= 0]
        if hits:
            self.stopped = True
            self._pending = ""
            start, end = min(hits)
            return buf[: end if self._include else start]
        hold = max(self._partial_match(buf, s) for s in self._stops)
        self._pending = buf[len(buf) - hold :]
        return buf[: len(buf) - hold]

    def flush(self) -> str:
        """The held-back text, at the end of generation (it did not turn into a stop string)."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out

    @staticmethod
    def _partial_match(buf: str, stop: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of ``stop``."""
        for k in range(min(len(stop) - 1, len(buf)), 0, -1):
            if buf.endswith(stop[:k]):
                return k
        return 0
