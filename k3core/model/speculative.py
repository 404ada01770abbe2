"""Exact speculative decoding: n-gram drafts from the context, one verify pass, rollback.

``--spec ngram`` drafts up to ``width`` tokens by prompt lookup: the longest suffix of the
context (``ngram`` ids down to one) that occurred before, most recent occurrence first,
proposes the ids that followed it. One verify pass feeds the pending ids and the drafts
(each trunk layer acquired once, each routed expert read once for the union of the rows)
and returns the logits of the last ``len(drafts) + 1`` rows; under the kernel contract each
row's bytes are those of a one-row pass, so the token picked from row ``i`` is the token
plain decoding would pick at that position. The drafts are accepted while they agree;
the first disagreement (or a stop, or the length limit) ends the pass, and the state is
truncated to what was emitted (:mod:`k3core.model.rollback`).

Sampling keeps the plain run's one uniform per emitted token: row ``i``'s token is drawn
with the uniform plain decoding would draw at that position, and draft ``d`` is accepted
iff that token is ``d``. For a point-mass draft this is the standard acceptance rule
(accept with probability ``p(d)``, else draw from ``p`` without ``d``, renormalised), and
it gives the ids of ``--spec off`` for the same seed.

``--spec auto`` drafts only where :class:`AutoPolicy`'s cost model says it pays.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from k3core.api.errors import UsageError, param
from k3core.model.forward import Model
from k3core.model.rollback import begin, truncate
from k3core.model.state import SequenceState

MODES = ("off", "ngram", "auto")
#: defaults of --spec-width and --spec-ngram, and their upper limits
DEFAULT_WIDTH = 4
DEFAULT_NGRAM = 3
MAX_WIDTH = 16
MAX_NGRAM = 8


@dataclass(frozen=True)
class SpecOptions:
    """``mode`` off | ngram | auto; ``width`` drafts per pass at most; ``ngram`` the longest
    context suffix looked up."""

    mode: str = "off"
    width: int = DEFAULT_WIDTH
    ngram: int = DEFAULT_NGRAM

    def __post_init__(self) -> None:
        check_spec(self.mode, self.width, self.ngram)

    @property
    def on(self) -> bool:
        return self.mode != "off"


def check_spec(mode: str, width: int, ngram: int) -> None:
    if mode not in MODES:
        raise UsageError(f"{param('spec')} must be one of {', '.join(MODES)}, got {mode!r}")
    if not 1 <= width <= MAX_WIDTH:
        raise UsageError(f"{param('spec_width')} must be in 1..{MAX_WIDTH}, got {width}")
    if not 1 <= ngram <= MAX_NGRAM:
        raise UsageError(f"{param('spec_ngram')} must be in 1..{MAX_NGRAM}, got {ngram}")


def ngram_draft(ids: Sequence[int], ngram: int, width: int) -> tuple[list[int], int]:
    """``(drafts, n)``: the ids after the most recent earlier occurrence of the longest
    suffix of ``ids`` (``ngram`` ids down to 1) and that suffix's length; ``([], 0)`` when
    no suffix occurred before."""
    L = len(ids)
    if width < 1 or L < 2:
        return [], 0
    arr = np.asarray(ids, dtype=np.int64)
    for n in range(min(ngram, L - 1), 0, -1):
        pat = arr[L - n:]
        win = np.lib.stride_tricks.sliding_window_view(arr[: L - 1], n)  # starts 0..L-1-n
        hits = np.nonzero(np.all(win == pat, axis=1))[0]
        if hits.size:
            i = int(hits[-1])
            return [int(x) for x in arr[i + n : i + n + width]], n
    return [], 0


@dataclass
class AutoPolicy:
    """The cost model of ``--spec auto``.

    A pass with ``k`` drafts is expected to emit ``E(k) = 1 + a + ... + a**k`` tokens (``a``
    the per-draft acceptance, estimated with decay, so old evidence fades) and to cost
    ``t1 + c * k`` seconds (``t1`` a one-row step, ``c`` a draft row: lower medians of this
    run's last passes, so a slow pass on a busy machine does not swing it). It drafts the ``k``
    that maximises ``E(k) / (t1 + c k)``; ``k = 0`` turns drafting off. While off, each step
    still compares the drafter's first id with the token decoding picked, so acceptance is
    re-estimated for free and drafting comes back on when the n-gram matches start to
    predict; after ``reprobe`` steps off it probes one full-width pass to re-time ``c``.
    """

    decay: float = 0.8
    hits: float = 1.0
    misses: float = 1.0
    reprobe: int = 16
    window: int = 9
    t1_samples: list[float] = field(default_factory=list)
    row_samples: list[float] = field(default_factory=list)
    off_streak: int = 0

    @property
    def acceptance(self) -> float:
        return self.hits / (self.hits + self.misses)

    @property
    def t1(self) -> float | None:
        return _median(self.t1_samples)

    @property
    def row(self) -> float | None:
        return _median(self.row_samples)

    def expected(self, k: int) -> float:
        a = self.acceptance
        return float(sum(a**i for i in range(k + 1)))

    def choose(self, available: int) -> tuple[int, str]:
        t1, row = self.t1, self.row
        if t1 is None:
            return 0, "measure"
        if row is None or self.off_streak >= self.reprobe:
            self.off_streak = 0
            return available, "probe"
        best, score = 0, 1.0 / t1
        for k in range(1, available + 1):
            s = self.expected(k) / (t1 + row * k)
            if s > score * 1.0000001:
                best, score = k, s
        self.off_streak = 0 if best else self.off_streak + 1
        return best, "pays" if best else "off"

    def observe(self, drafted: int, accepted: int) -> None:
        self.hits = self.hits * self.decay + accepted
        self.misses = self.misses * self.decay + (1 if accepted < drafted else 0)

    def timed(self, drafted: int, seconds: float) -> None:
        """A pass with one sure row and ``drafted`` drafts took ``seconds``."""
        if drafted == 0:
            _push(self.t1_samples, seconds, self.window)
        elif self.t1 is not None:
            _push(self.row_samples, max(0.0, (seconds - self.t1) / drafted), self.window)


def _push(xs: list[float], x: float, most: int) -> None:
    xs.append(x)
    del xs[:-most]


def _median(xs: list[float]) -> float | None:
    if not xs:
        return None
    return sorted(xs)[(len(xs) - 1) // 2]  # the lower median: a busy machine only slows


@dataclass
class SpecStats:
    """What speculation did over one generation (the report's ``speculative`` block)."""

    mode: str = "off"
    width: int = DEFAULT_WIDTH
    ngram: int = DEFAULT_NGRAM
    passes: int = 0
    passes_drafted: int = 0
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0
    decisions: dict[str, int] = field(default_factory=dict)
    log: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "width": self.width, "ngram": self.ngram,
                "passes": self.passes, "passes_drafted": self.passes_drafted,
                "drafts_proposed": self.proposed, "drafts_accepted": self.accepted,
                "acceptance": self.accepted / self.proposed if self.proposed else 0.0,
                "mean_accepted_width": (self.accepted / self.passes_drafted
                                        if self.passes_drafted else 0.0),
                "tokens_per_pass": self.emitted / self.passes if self.passes else 0.0,
                "decisions": dict(self.decisions), "log": list(self.log)}

    def line(self) -> str:
        j = self.to_json()
        dec = ", ".join(f"{k} {v}" for k, v in sorted(self.decisions.items()))
        return (f"speculative   : --spec {self.mode} (width {self.width}, ngram {self.ngram}): "
                f"{self.passes} passes for {self.emitted} tokens ({j['tokens_per_pass']:.2f} per "
                f"pass); drafts accepted {self.accepted}/{self.proposed} "
                f"({100 * j['acceptance']:.0f}%), mean accepted width "
                f"{j['mean_accepted_width']:.2f}; decisions: {dec or 'none'}")


#: a drafter: (context ids, ngram, width) -> (drafts, matched suffix length)
Drafter = Callable[[Sequence[int], int, int], tuple[list[int], int]]


class Speculator:
    """Drafts, verifies and settles the passes of one generation (see the module).
    ``drafter`` replaces the n-gram lookup (tests drive acceptance and rejection with it)."""

    def __init__(self, model: Model, opts: SpecOptions, drafter: Drafter = ngram_draft):
        self.model = model
        self.opts = opts
        self.drafter = drafter
        self.policy = AutoPolicy() if opts.mode == "auto" else None
        self.stats = SpecStats(opts.mode, opts.width, opts.ngram)
        self._pending: tuple[int, list[int], str, int] = (0, [], "", 0)

    def propose(self, ids: Sequence[int], remaining: int, sure: int) -> list[int]:
        """Drafts for the next pass (``remaining`` tokens may still be emitted; ``sure`` ids
        are fed anyway)."""
        room = min(self.opts.width, remaining - 1)
        drafts, _ = self.drafter(ids, self.opts.ngram, room) if room > 0 else ([], 0)
        drafts = drafts[:room]
        reason = "ngram" if drafts else ("no-match" if room > 0 else "last-token")
        candidate = drafts
        if drafts and self.policy is not None:
            k, reason = self.policy.choose(len(drafts))
            drafts = drafts[:k]
        self._pending = (len(self.stats.log), candidate, reason, sure)
        return drafts

    def verify(self, ids: Sequence[int], state: SequenceState | None,
               drafts: Sequence[int]) -> np.ndarray:
        """The logits of the pass's last ``len(drafts) + 1`` rows."""
        model, k = self.model, len(drafts)
        if state is None:  # full recompute: a fresh state over the whole sequence
            fresh = SequenceState(model.cfg, len(ids) + k, shared_kda_slot=model.shared_kda_slot)
            return model.forward(np.array(list(ids) + list(drafts)), fresh, tail=k + 1)
        feed = list(ids[state.pos:]) + list(drafts)
        if k:
            begin(state, len(feed) - k)
        try:
            return model.forward(np.array(feed), state, tail=k + 1)
        except BaseException:
            state.trail = None
            raise

    def settle(self, state: SequenceState | None, kept_pos: int) -> None:
        """Keep ``kept_pos`` positions of the pass (drop the rejected drafts' state)."""
        if state is not None:
            truncate(self.model.k, state, kept_pos)

    def record(self, step: int, drafts: Sequence[int], emitted: Sequence[int],
               seconds: float) -> None:
        """Book one pass: ``drafts`` fed, ``emitted`` tokens it produced, its time."""
        _, candidate, reason, sure = self._pending
        acc = 0
        while acc < len(drafts) and acc < len(emitted) and emitted[acc] == drafts[acc]:
            acc += 1
        s = self.stats
        s.passes += 1
        s.emitted += len(emitted)
        s.decisions[reason] = s.decisions.get(reason, 0) + 1
        if drafts:
            s.passes_drafted += 1
            s.proposed += len(drafts)
            s.accepted += acc
        s.log.append({"step": step, "drafted": len(drafts), "accepted": acc,
                      "emitted": len(emitted), "reason": reason})
        p = self.policy
        if p is None:
            return
        if drafts:
            p.observe(len(drafts), acc)
        elif candidate and emitted:  # drafting was off: was the drafter right anyway?
            p.observe(1, 1 if emitted[0] == candidate[0] else 0)
        if sure == 1:
            p.timed(len(drafts), seconds)
