"""The sequences of one forward pass, laid one after the other in its rows.

A pass feeds one or more sequences (a batched step: several rows each a sequence's next id; a
prefill chunk; a speculative verify). Each is a :class:`Feed`: its new ids, its own
:class:`~k3core.model.state.SequenceState`, and how many of its trailing rows' logits are
asked. :class:`Segments` lays the feeds' rows out in order (feed 0's rows, then feed 1's...),
so every per-row op (the products, the norms, the router, the experts) takes all of them in
one call while attention and the recurrence take each sequence's span with its own state.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from k3core.api.errors import K3Error
from k3core.model.state import SequenceState


@dataclass
class Feed:
    """One sequence's part of a pass: ``ids`` after ``state.pos``, the logits of its last
    ``rows`` rows wanted (0: none, a chunk before the last)."""

    ids: np.ndarray
    state: SequenceState
    rows: int = 1

    def __post_init__(self) -> None:
        self.ids = np.asarray(self.ids, dtype=np.int64).reshape(-1)
        self.rows = max(0, min(int(self.rows), len(self.ids)))


class Segments:
    """The feeds of a pass, their rows one after the other."""

    def __init__(self, feeds: Sequence[Feed]):
        if not feeds:
            raise ValueError("a pass needs at least one feed")
        if len({id(f.state) for f in feeds}) != len(feeds):
            raise ValueError("two feeds of one pass share a state")
        self.feeds = list(feeds)
        lens = [len(f.ids) for f in self.feeds]
        self.bounds = np.cumsum([0, *lens])
        self.total = int(self.bounds[-1])
        self.ids = (self.feeds[0].ids if len(self.feeds) == 1
                    else np.concatenate([f.ids for f in self.feeds]))
        self._kept = np.concatenate(
            [np.arange(int(b) - f.rows, int(b), dtype=np.int64)
             for f, b in zip(self.feeds, self.bounds[1:], strict=True)])

    def spans(self) -> Iterator[tuple[int, int, SequenceState]]:
        """``(start, end, state)`` of each feed's rows."""
        for i, f in enumerate(self.feeds):
            yield int(self.bounds[i]), int(self.bounds[i + 1]), f.state

    def attending(self, part: bool) -> list[int]:
        """The rows of each feed that attend in an MLA layer: all of them, or (``part``, the
        pass's last layer) its asked ones."""
        return [f.rows if part else len(f.ids) for f in self.feeds]

    def kept_index(self) -> np.ndarray:
        """Indices (into all rows) of every feed's asked rows, in row order."""
        return self._kept

    def split_kept(self, out: np.ndarray) -> list[np.ndarray]:
        """``out``'s rows (one per asked row, in order) handed back feed by feed."""
        cuts = np.cumsum([f.rows for f in self.feeds])[:-1]
        return list(np.split(out, cuts))


def checked(out: np.ndarray) -> np.ndarray:
    """``out`` if every logit is finite; a damaged model's non-finite logits are refused."""
    if not np.all(np.isfinite(out)):
        raise K3Error("the forward pass produced non-finite logits; refusing to pick a token")
    return out
