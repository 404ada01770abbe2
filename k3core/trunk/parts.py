"""Sub-layer streaming units: a layer's trunk run split into the parts the forward uses in turn.

The forward pass uses a layer's attention tensors, then its MLP (dense or MoE) tensors. So a
streamed layer is two *parts*, each one 4096-aligned window of the layer's run in
``trunk.bin`` that covers the matrices of one phase: ``attn`` (``self_attn.*``) and ``mlp``
(``mlp.*``, ``block_sparse_moe.*``). A ring slot then needs the largest part, not the
largest layer, and the reader fills the next part while the current one computes. The
packed format is unchanged: windows are cut at page boundaries of the existing runs, so two
windows may share one page (read twice, never written).

The *small* tensors (vectors, ``*_res_proj``, the short-conv weights, ``A_log``: the ones
``prepare_layer`` widens to float32 copies anyway) are kept resident per layer: the pages
outside every part window (*resident ranges*) are read once at open; small tensors inside a
window are copied out of the first read of that window.

Checksums stay per layer: the run ``[0, span)`` is cut at every window and range boundary
into *segments*, each owned by the first source (resident ranges, then parts) that covers
it; the segments' CRCs, taken from whichever buffer holds them, combine
(:func:`k3core.trunk.crc.crc32_combine`) into the layer's CRC.

A layer whose two windows overlap by more than one page (an interleaved layout) stays one
part (``layer``), as does every layer when splitting is off.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from k3core.api.units import ALIGN, align_up
from k3core.model import names
from k3core.model.config import ModelConfig
from k3core.model.layer_params import expected_shapes, trunk_suffixes
from k3core.model.sizes import planned_tensor_bytes
from k3core.trunk.manifest import TrunkLayer, TrunkManifest

ATTN, MLP, WHOLE = "attn", "mlp", "layer"
PHASES = (ATTN, MLP)
_MLP_SMALL = ("post_attention_layernorm.weight", "mlp_res_norm.weight", "mlp_res_proj.weight")


def phase_of(suffix: str) -> str:
    """``mlp`` for the tensors the MLP/MoE half of a layer reads, else ``attn``."""
    if suffix.startswith(("mlp.", "block_sparse_moe.")) or suffix in _MLP_SMALL:
        return MLP
    return ATTN


def is_small(suffix: str, shape: Sequence[int]) -> bool:
    """The tensors ``prepare_layer`` widens to float32 copies (kept resident when split)."""
    return (len(shape) == 1 or suffix.endswith(("_res_proj.weight", "conv1d.weight"))
            or suffix == "self_attn.A_log")


def _down(n: int) -> int:
    return n - n % ALIGN


@dataclass(frozen=True)
class LayerPart:
    """One streaming unit: ``nbytes`` of the layer's run from ``start`` (both page multiples)."""

    layer: int
    name: str  # attn, mlp or layer
    start: int
    nbytes: int
    matrices: tuple[str, ...]  # suffixes bound as views into the part's buffer

    @property
    def end(self) -> int:
        return self.start + self.nbytes

    @property
    def label(self) -> str:
        return f"{self.layer}" if self.name == WHOLE else f"{self.layer}.{self.name}"


@dataclass(frozen=True)
class Segment:
    start: int
    end: int
    owner: int  # -1: a resident range; else the index of the part in LayerSplit.parts


@dataclass(frozen=True)
class LayerSplit:
    """How one layer streams: its parts in use order, resident ranges, CRC segments."""

    layer: int
    span: int
    parts: tuple[LayerPart, ...]
    resident: tuple[tuple[int, int], ...]  # page ranges read once at open
    segments: tuple[Segment, ...]  # a partition of [0, span)
    small: dict[str, tuple[int, int]]  # suffix -> (off, nbytes) of the resident tensors

    def part_index(self, name: str) -> int:
        for i, p in enumerate(self.parts):
            if p.name == name:
                return i
        raise KeyError(name)


def stream_unit_sizes(manifest: TrunkManifest, n_layers: int | None = None,
                      split: bool = True) -> list[int]:
    """Bytes of every unit the engine streams from ``manifest`` (its first ``n_layers``
    layers, split as :class:`~k3core.trunk.stream.StreamedTrunk` splits them); their
    :func:`~k3core.trunk.plan.trunk_floor` is the smallest ``--trunk-gb`` that runs."""
    n = len(manifest.layers) if n_layers is None else n_layers
    return [p.nbytes for L in range(n) for p in split_layer(manifest.layers[L], split).parts]


def split_layer(lay: TrunkLayer, split: bool = True) -> LayerSplit:
    """The parts of ``lay`` (one ``layer`` part when ``split`` is off or the layout interleaves)."""
    suffix = {}
    for key, t in lay.tensors.items():
        s = names.split_layer_name(t.name)
        assert s is not None  # checked by the manifest reader
        suffix[key] = s[1]
    small = {suffix[k]: (t.off, t.nbytes) for k, t in lay.tensors.items()
             if is_small(suffix[k], t.shape)}
    mats = {k: t for k, t in lay.tensors.items() if suffix[k] not in small}
    parts: list[LayerPart] = []
    if split:
        for phase in PHASES:
            mine = [t for k, t in mats.items() if phase_of(suffix[k]) == phase]
            if not mine:
                continue
            lo = _down(min(t.off for t in mine))
            hi = min(align_up(max(t.off + t.nbytes for t in mine)), lay.nbytes)
            parts.append(LayerPart(lay.layer, phase, lo, hi - lo,
                                   tuple(sorted(suffix[k] for k, t in mats.items()
                                                if phase_of(suffix[k]) == phase))))
        if len(parts) == 2 and min(parts[0].end, parts[1].end) - max(parts[0].start,
                                                                      parts[1].start) > ALIGN:
            parts = []  # interleaved: one window per phase would read most bytes twice
        if len(parts) < 2:
            parts = []
    if not parts:
        parts = [LayerPart(lay.layer, WHOLE, 0, lay.nbytes,
                           tuple(sorted(suffix[k] for k in mats)))]
    resident = _complement([(p.start, p.end) for p in parts], lay.nbytes, lay.span)
    return LayerSplit(lay.layer, lay.span, tuple(parts), resident,
                      _segments(parts, resident, lay.span), small)


def _complement(windows: list[tuple[int, int]], total: int, span: int) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    pos = 0
    for a, b in sorted(windows):
        if a > pos:
            out.append((pos, a))
        pos = max(pos, b)
    if pos < total:
        out.append((pos, total))
    return tuple((a, b) for a, b in out if a < span)


def _segments(parts: list[LayerPart], resident: tuple[tuple[int, int], ...],
              span: int) -> tuple[Segment, ...]:
    cuts = {0, span}
    for a, b in resident:
        cuts |= {min(a, span), min(b, span)}
    for p in parts:
        cuts |= {min(p.start, span), min(p.end, span)}
    pts = sorted(cuts)
    segs = []
    for a, b in zip(pts, pts[1:], strict=False):
        owner = next((-1 for r0, r1 in resident if r0 <= a and b <= r1), None)
        if owner is None:
            owner = next(i for i, p in enumerate(parts) if p.start <= a and b <= p.end)
        segs.append(Segment(a, b, owner))
    return tuple(segs)


def shape_part_sizes(cfg: ModelConfig, n_layers: int | None = None,
                     split: bool = True) -> list[tuple[str, int]]:
    """``(label, bytes)`` of every streaming unit planned from the config alone (no data).

    A part is its phase's matrices at their planned dtypes, rounded up to pages plus one
    page (a window starting mid-page); a whole layer is its run padded to a page.
    """
    out: list[tuple[str, int]] = []
    for L in range(n_layers or cfg.n_layers):
        shapes = expected_shapes(cfg, L)
        shapes.setdefault("self_attn.A_log", (cfg.kda_heads,))
        by_phase = {ATTN: 0, MLP: 0}
        total = 0
        for s in trunk_suffixes(cfg, L):
            n = planned_tensor_bytes(s, shapes[s])
            total += n
            if not is_small(s, shapes[s]):
                by_phase[phase_of(s)] += n
        if split and all(by_phase.values()):
            out += [(f"{L}.{ph}", align_up(by_phase[ph]) + ALIGN) for ph in PHASES]
        else:
            out.append((f"{L}", align_up(total)))
    return out
