"""Text out of a generation as tokens arrive: UTF-8 whole, cut before a stop string.

:class:`TextStream` turns ids into text pieces. A piece never ends inside a UTF-8
character (the tokenizer's incremental decoder holds the bytes back), and text that could be
the start of a stop string is held back until it is known not to be one, so a caller that
prints each piece never prints a stop string or half of one. The pieces of a generation
concatenate to its ``text``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from k3core.tokenizer.encoding import Tokenizer


class TextStream:
    """Ids in, text pieces out; ``hit`` once a stop string has appeared."""

    def __init__(self, tokenizer: Tokenizer | None, stops: Sequence[str] = ()):
        self._dec = tokenizer.incremental_decoder() if tokenizer is not None else None
        self._stops = [s for s in stops if s]
        self._held = ""
        self.text = ""
        self.hit: str | None = None

    @property
    def enabled(self) -> bool:
        return self._dec is not None

    def push(self, token: int) -> str:
        """Feed one id; return the text that may be shown now."""
        if self._dec is None or self.hit is not None:
            return ""
        return self._emit(self._held + self._dec.push(token), final=False)

    def finish(self) -> str:
        """End of the generation: whatever was held back (unless a stop string was hit)."""
        if self._dec is None or self.hit is not None:
            return ""
        return self._emit(self._held + self._dec.flush(), final=True)

    def _emit(self, buf: str, final: bool) -> str:
        cut = min(((buf.find(s), s) for s in self._stops if s in buf), default=None)
        if cut is not None:
            self.hit = cut[1]
            out, self._held = buf[: cut[0]], ""
        else:
            keep = 0 if final else _held_back(buf, self._stops)
            out, self._held = buf[: len(buf) - keep], buf[len(buf) - keep:]
        self.text += out
        return out


def _held_back(buf: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of ``buf`` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(buf)), best, -1):
            if buf.endswith(s[:n]):
                best = n
                break
    return best
