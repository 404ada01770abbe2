"""Stop strings over streamed text: text is released only once it cannot begin a stop string.

:class:`StopText` takes the text of each token as it arrives and returns what may be shown:
a tail that might be the start of a stop string is held back until it either completes one
(generation ends there, the stop string itself is never shown) or turns out to be ordinary
text. Everything released concatenates to the full text cut before the first stop string.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopText:
    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self._held = ""
        self.hit: str | None = None

    def push(self, text: str) -> str:
        """New text in; the part that is safe to show out (empty once a stop string hit)."""
        if self.hit is not None or not text:
            return ""
        if not self.stops:
            return text
        buf = self._held + text
        first = -1
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (first < 0 or i < first):
                first, self.hit = i, s
        if first >= 0:
            self._held = ""
            return buf[:first]
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The stream ended without a stop string: release what is held."""
        out, self._held = ("" if self.hit is not None else self._held), ""
        return out
