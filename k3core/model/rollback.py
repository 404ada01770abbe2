"""Exact rollback of a speculative verify pass (docs/speculative.md).

A verify pass feeds ``sure`` rows that will be kept whatever the verdict (the pending ids)
followed by draft rows that may be rejected. The MLA KV cache needs nothing: its rows are
written at ``[pos, pos + T)`` and read only below ``pos``, so truncation is ``pos =
kept``. The KDA state is updated in place, so while a :class:`KDATrail` is set on the
state, :meth:`Model.kda <k3core.model.forward.Model.kda>` runs the recurrence in two calls
(the sure rows, then the draft rows: the same bytes as one call, the recurrence is
sequential) and keeps, per KDA layer, a copy of ``S`` and of the conv histories after the
sure rows plus the draft rows' inputs. :meth:`KDATrail.rollback` restores that copy and
recomputes the recurrence over the accepted drafts only (a few rows of one kernel, no
weights read); the conv history is the last ``K - 1`` raw inputs, so it is a copy.

The alternative, a snapshot of ``S`` after every draft row, costs ``width`` copies of ``S``
per layer on every pass; the recompute costs nothing when every draft is accepted and at
most ``width - 1`` recurrence rows on a rejection.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from k3core.api.kernels import KernelBackend
from k3core.model.state import KDAState, SequenceState


@dataclass
class _LayerTrail:
    S: np.ndarray  # [H, D, D] after the sure rows
    conv: dict[str, np.ndarray]  # "q"/"k"/"v" -> [P, K-1] after the sure rows
    raw: dict[str, np.ndarray]  # "q"/"k"/"v" -> [n_draft, P] pre-conv inputs of the drafts
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    alpha: np.ndarray
    beta: np.ndarray


@dataclass
class KDATrail:
    """What one verify pass from ``pos0`` with ``sure`` kept rows leaves for a rollback."""

    pos0: int
    sure: int
    layers: dict[int, _LayerTrail] = field(default_factory=dict)

    def kda(self, kern: KernelBackend, layer: int, s: KDAState, hist0: dict[str, np.ndarray],
            raw: tuple[np.ndarray, np.ndarray, np.ndarray], q: np.ndarray, k: np.ndarray,
            v: np.ndarray, alpha: np.ndarray, beta: np.ndarray) -> np.ndarray:
        """The recurrence of one KDA layer (sure rows, then drafts), recording the trail."""
        a = self.sure
        if a >= q.shape[0]:
            return kern.kda_recurrent(q, k, v, alpha, beta, s.S)
        parts = [kern.kda_recurrent(q[:a], k[:a], v[:a], alpha[:a], beta[:a], s.S)] if a else []
        conv = {n: _history(hist0[n], r[:a]) for n, r in zip("qkv", raw, strict=True)}
        self.layers[layer] = _LayerTrail(
            s.S.copy(), conv, {n: r[a:].copy() for n, r in zip("qkv", raw, strict=True)},
            q[a:].copy(), k[a:].copy(), v[a:].copy(), alpha[a:].copy(), beta[a:].copy())
        parts.append(kern.kda_recurrent(q[a:], k[a:], v[a:], alpha[a:], beta[a:], s.S))
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def rollback(self, kern: KernelBackend, state: SequenceState, accepted: int) -> None:
        """Make every KDA layer's state what feeding ``sure + accepted`` rows gives."""
        for layer, t in self.layers.items():
            s = state.kda_state(layer)
            S = t.S.copy()
            j = accepted
            if j:
                kern.kda_recurrent(t.q[:j], t.k[:j], t.v[:j], t.alpha[:j], t.beta[:j], S)
            s.S[...] = S
            for n, h in s.conv.items():
                h[...] = _history(t.conv[n], t.raw[n][:j])


def _history(hist: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The conv history ``[P, K-1]`` (oldest first) after ``rows`` ``[n, P]`` more inputs."""
    width = hist.shape[1]
    if width == 0 or rows.shape[0] == 0:
        return hist.copy()
    return np.ascontiguousarray(np.concatenate([hist, rows.T], axis=1)[:, -width:])


def begin(state: SequenceState, sure: int) -> None:
    """Start a verify pass on ``state``: its next ``sure`` rows are kept whatever happens."""
    state.trail = KDATrail(state.pos, sure)


def truncate(kern: KernelBackend, state: SequenceState, kept_pos: int) -> None:
    """End the verify pass: keep ``kept_pos`` positions (at least the pass's sure rows)."""
    trail, state.trail = state.trail, None
    if not isinstance(trail, KDATrail) or kept_pos >= state.pos:
        return
    accepted = kept_pos - trail.pos0 - trail.sure
    if accepted < 0:
        raise ValueError("a rollback cannot drop the sure rows of a verify pass")
    trail.rollback(kern, state, accepted)
    state.pos = kept_pos
