"""Constrained decoding: the choice among the exact logits, masked.

A :class:`Constraint` says which ids may come next (a grammar, a JSON schema, a tool call's
shape: :mod:`k3core.constrain` builds them) and is told each id that is emitted. The logits
are never changed: :func:`masked` restricts the *choice* to the allowed ids. Greedy is the
argmax over the allowed ids (ties to the lowest id, as unconstrained); sampling draws from
the sampler's distribution over the allowed ids alone (temperature, top-k and top-p applied
to them, renormalised), with the same seeded draw. An id the constraint allows alone is
taken without a pick (no draw is spent on it).

After each pick the constraint may *force* more ids (:meth:`Constraint.forced`: what the
grammar allows next is one tokenization only, such as the fixed text of a tag); the session
emits them as steps of their own without computing their logits and feeds them with the
next forward pass, several ids in one pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from k3core.api.errors import K3Error

Pick = Callable[[np.ndarray], int]


class Constraint(Protocol):
    """What may come next, told every id emitted."""

    def allowed(self) -> np.ndarray:
        """The ids allowed next, ascending (int64)."""
        ...

    def accept(self, token: int) -> None:
        """``token`` was emitted (an allowed id, or one :meth:`forced` named)."""
        ...

    def forced(self) -> list[int]:
        """Ids that must follow now, in order (none when the next one is a real choice)."""
        ...

    @property
    def done(self) -> bool:
        """True once the constrained text is complete: no id may follow."""
        ...


def masked(pick: Pick, constraint: Constraint) -> Pick:
    """``pick`` (greedy argmax or a sampler: a row in, an index into it out) restricted to the
    ids ``constraint`` allows; the id chosen is accepted by the constraint."""

    def choose(logits: np.ndarray) -> int:
        ids = constraint.allowed()
        if ids.size == 0:
            raise K3Error("constrained decoding: the constraint allows no next token "
                          "(the grammar cannot continue)")
        tok = int(ids[0]) if ids.size == 1 else int(ids[pick(logits[ids])])
        constraint.accept(tok)
        return tok

    return choose


def take_forced(constraint: Constraint, room: int) -> list[int]:
    """The ids ``constraint`` forces now, at most ``room`` of them, each accepted."""
    out: list[int] = []
    if room <= 0:
        return out
    for tok in constraint.forced()[:room]:
        constraint.accept(tok)
        out.append(int(tok))
    return out
