"""``k3 perplexity``: mean cross-entropy per token of a text under a model, in sliding windows.

Windows of at most ``ctx`` tokens end every ``stride`` tokens (``1 <= stride < ctx``;
default ``ctx // 2``): the first window is ids ``0..ctx-1``, each later one ends ``stride``
ids after the previous one and starts ``ctx`` ids before its end. A window is one full
forward pass from a fresh state and scores only the ids no earlier window scored, so every
id after the first is scored exactly once, with at least ``ctx - stride`` ids of context
once the first window is past (as the sliding-window evaluation of Hugging Face
transformers; llama.cpp's tool scores the second half of disjoint windows, i.e. the same
context guarantee as ``stride = ctx // 2``). The first id has no context and is never scored.

Per token the loss is ``logsumexp(logits) - logits[target]`` in float64 from the float32
logits, and the losses are summed in a fixed order, so the figure is a function of the
logits alone: kernel backends that give the same logits bits give the same perplexity bits.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from k3core.api.errors import K3Error, UsageError
from k3core.model.forward import Model
from k3core.model.state import SequenceState

#: the longest window accepted (each window holds a KV cache and all its logits)
MAX_CTX = 32_768


@dataclass(frozen=True)
class Perplexity:
    tokens: int  # ids in the text
    scored: int  # tokens scored (tokens - 1)
    windows: int
    ctx: int
    stride: int
    nll_sum: float  # nats
    mean_nll: float  # nats per scored token
    perplexity: float  # exp(mean_nll)
    bits_per_token: float

    def to_json(self) -> dict[str, Any]:
        """The fields; a perplexity past a float's range is ``null`` (JSON has no infinity)."""
        doc = asdict(self)
        if not math.isfinite(self.perplexity):
            doc["perplexity"] = None
        return doc

    def lines(self) -> list[str]:
        return [
            f"tokens     : {self.tokens} ({self.scored} scored in {self.windows} windows of "
            f"<= {self.ctx}, stride {self.stride})",
            f"mean NLL   : {self.mean_nll:.6f} nats/token ({self.bits_per_token:.4f} bits)",
            f"perplexity : {self.perplexity:.4f}" if math.isfinite(self.perplexity) else
            "perplexity : past a float's range (mean NLL over 709 nats)",
        ]


def check_window(ctx: int, stride: int | None) -> int:
    """The stride to use (``ctx // 2`` when not given); refuse impossible windows (exit 2)."""
    if not 2 <= ctx <= MAX_CTX:
        raise UsageError(f"--ctx must be in 2..{MAX_CTX}, got {ctx}")
    s = ctx // 2 if stride is None else stride
    if not 1 <= s < ctx:
        raise UsageError(f"--stride must be in 1..ctx-1 ({ctx - 1}), got {s}")
    return s


def windows(n: int, ctx: int, stride: int) -> list[tuple[int, int, int]]:
    """``(begin, end, first_scored)`` per window over ``n`` ids: targets ``first..end-1``."""
    out: list[tuple[int, int, int]] = []
    scored_to = 1  # the first id is never a target
    end = min(ctx, n)
    while scored_to < n:
        begin = max(0, end - ctx)
        out.append((begin, end, scored_to))
        scored_to = end
        end = min(end + stride, n)
    return out


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """``logsumexp(l) - l[target]`` per row, float64 (a row with a non-finite logit gives a
    non-finite loss, which :func:`perplexity` refuses; numpy is kept quiet about it)."""
    x = logits.astype(np.float64)
    with np.errstate(all="ignore"):
        m = x.max(axis=1, keepdims=True)
        lse = m[:, 0] + np.log(np.exp(x - m).sum(axis=1))
        return lse - x[np.arange(len(targets)), targets]


def perplexity(
    model: Model,
    ids: Sequence[int],
    ctx: int,
    stride: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Perplexity:
    """Score ``ids`` under ``model`` (see the module docstring)."""
    s = check_window(ctx, stride)
    arr = np.asarray(ids, dtype=np.int64)
    n = len(arr)
    if n < 2:
        raise UsageError(f"the text has {n} token(s); perplexity needs at least 2")
    if arr.min() < 0 or arr.max() >= model.cfg.vocab:
        raise UsageError(f"token ids must be in 0..{model.cfg.vocab - 1}")
    spans = windows(n, ctx, s)
    losses = np.empty(n - 1, dtype=np.float64)
    for i, (begin, end, first) in enumerate(spans):
        logits = model.forward(arr[begin:end], SequenceState(model.cfg, end - begin),
                               all_logits=True)
        rows = np.arange(first - 1, end - 1) - begin  # row r predicts id begin + r + 1
        losses[first - 1 : end - 1] = token_nll(logits[rows], arr[first:end])
        if progress is not None:
            progress(i + 1, len(spans))
    bad = np.flatnonzero(~np.isfinite(losses))
    if bad.size:
        raise K3Error(f"the model's logits are not finite when predicting token {int(bad[0]) + 1} "
                      f"of the text ({bad.size} such tokens): no perplexity can be given")
    total = float(math.fsum(losses.tolist()))
    mean = total / (n - 1)
    # exp overflows a float past about 709 nats: such a text is past any finite perplexity
    ppl = math.exp(mean) if mean < math.log(sys.float_info.max) else math.inf
    return Perplexity(tokens=n, scored=n - 1, windows=len(spans), ctx=ctx, stride=s,
                      nll_sum=total, mean_nll=mean, perplexity=ppl,
                      bits_per_token=mean / math.log(2))
