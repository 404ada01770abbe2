"""Synthetic expert-request traces for testing cache policies away from the one real trace.

Two shapes, both in the ``expert_trace.bin`` layout (an ``(N, 2)`` int32 array of
``(layer, expert)``, layers one-based):

* :func:`incremental_trace`: incremental decode. An optional prompt is prefilled in one pass
  (each layer sees ``prompt * topk`` requests), then every generated token visits each layer
  once with ``topk`` distinct experts. Expert popularity per layer follows a Zipf-like law
  ``w ~ rank**-skew`` over a random permutation (``skew=0`` is flat), and ``stickiness`` is
  the probability that each expert of the previous token is chosen again at that layer
  (temporal locality). Sampling without replacement uses the Gumbel-top-k trick.
* :func:`full_recompute_trace`: what full-recompute decode asks for given per-position
  routing: pass ``t`` re-runs positions ``0 .. start+t-1`` through every layer.
* :func:`routing_of_recompute`: the inverse, the per-position routing a full-recompute trace
  shows (so a real recorded run can be replayed as incremental decode).

All randomness comes from ``numpy.random.default_rng(seed)``.
"""

from __future__ import annotations

import numpy as np


def routing(
    positions: int,
    n_layers: int,
    n_experts: int,
    topk: int,
    *,
    skew: float = 0.0,
    stickiness: float = 0.0,
    seed: int = 0,
) -> np.ndarray:
    """Per-position routing ``[positions, n_layers, topk]`` (expert ids, distinct per row)."""
    if not (0 < topk <= n_experts):
        raise ValueError(f"topk must be in 1..n_experts, got {topk} of {n_experts}")
    rng = np.random.default_rng(seed)
    ranks = np.empty((n_layers, n_experts))
    for layer in range(n_layers):
        ranks[layer, rng.permutation(n_experts)] = np.arange(1, n_experts + 1)
    logw = -float(skew) * np.log(ranks)
    out = np.empty((positions, n_layers, topk), dtype=np.int32)
    prev: np.ndarray | None = None
    rows = np.arange(n_layers)[:, None]
    for t in range(positions):
        score = logw + rng.gumbel(size=(n_layers, n_experts))
        if prev is not None and stickiness > 0:
            keep = rng.random((n_layers, topk)) < stickiness
            bonus = np.zeros((n_layers, n_experts))
            bonus[rows, prev] = np.where(keep, np.inf, 0.0)
            score = score + bonus
        top = np.argpartition(-score, topk - 1, axis=1)[:, :topk]
        out[t] = top
        prev = top
    return out


def incremental_trace(
    n_layers: int = 92,
    n_experts: int = 896,
    topk: int = 16,
    tokens: int = 64,
    *,
    prompt: int = 0,
    skew: float = 0.0,
    stickiness: float = 0.0,
    seed: int = 0,
) -> np.ndarray:
    """The trace of a prefill of ``prompt`` positions then ``tokens`` incremental steps."""
    r = routing(
        prompt + tokens, n_layers, n_experts, topk, skew=skew, stickiness=stickiness, seed=seed
    )
    parts = []
    if prompt:
        for layer in range(n_layers):
            e = r[:prompt, layer, :].reshape(-1)
            parts.append(np.stack([np.full_like(e, layer + 1), e], axis=1))
    for t in range(prompt, prompt + tokens):
        e = r[t].reshape(-1)
        la = np.repeat(np.arange(1, n_layers + 1, dtype=np.int32), topk)
        parts.append(np.stack([la, e], axis=1))
    return np.concatenate(parts).astype(np.int32)


def full_recompute_trace(route: np.ndarray, start: int) -> np.ndarray:
    """Full-recompute decode of ``route`` ``[positions, layers, topk]`` from ``start`` positions."""
    positions, n_layers, topk = route.shape
    if not 1 <= start <= positions:
        raise ValueError(f"start must be in 1..{positions}, got {start}")
    parts = []
    for t in range(start, positions + 1):
        for layer in range(n_layers):
            e = route[:t, layer, :].reshape(-1)
            parts.append(np.stack([np.full_like(e, layer + 1), e], axis=1))
    return np.concatenate(parts).astype(np.int32)


def routing_of_recompute(pairs: np.ndarray, topk: int = 16) -> tuple[np.ndarray, int]:
    """Per-position routing ``[positions, layers, topk]`` and the first pass's position count.

    ``pairs`` must be a full-recompute trace with layers ``1..L`` visited in order and
    ``topk`` requests per position; each position's routing is taken from the last pass that
    ran it (they agree: the computation is deterministic).
    """
    layers = pairs[:, 0]
    cuts = np.r_[0, np.flatnonzero(np.diff(layers)) + 1, len(layers)]
    n_layers = int(layers.max())
    positions = int(max(cuts[i + 1] - cuts[i] for i in range(len(cuts) - 1))) // topk
    first = int(cuts[1] - cuts[0]) // topk
    route = np.zeros((positions, n_layers, topk), dtype=np.int32)
    for s, e in zip(cuts[:-1], cuts[1:], strict=True):
        layer = int(layers[s])
        block = pairs[s:e, 1].reshape(-1, topk)
        route[: len(block), layer - 1] = block
    return route, first


def incremental_from_routing(route: np.ndarray, prompt: int) -> np.ndarray:
    """Incremental decode of ``route``: a prefill of ``prompt`` positions, then one by one."""
    positions, n_layers, topk = route.shape
    parts = []
    for layer in range(n_layers):
        e = route[:prompt, layer, :].reshape(-1)
        parts.append(np.stack([np.full_like(e, layer + 1), e], axis=1))
    for t in range(prompt, positions):
        la = np.repeat(np.arange(1, n_layers + 1, dtype=np.int32), topk)
        parts.append(np.stack([la, route[t].reshape(-1)], axis=1))
    return np.concatenate(parts).astype(np.int32)
