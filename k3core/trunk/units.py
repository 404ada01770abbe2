"""The units a streamed trunk serves: every walked layer's parts in walk order, and binding one.

A *unit* is one part of one layer (:mod:`k3core.trunk.parts`: a layer's attention part and
its MLP/MoE part, or the whole layer), numbered in walk order: layer 0's parts, then layer
1's, and so on. :class:`TrunkUnits` holds that numbering (the plan pins units by number and
the ring holds units by number) and binds a unit's matrices as read-only zero-copy views
into the buffer that holds its bytes (:func:`k3core.trunk.bind.bind_matrices`: bf16
matrices stay views).
"""

from __future__ import annotations

import numpy as np

from k3core.model import names
from k3core.model.config import ModelConfig
from k3core.trunk.bind import bind_matrices
from k3core.trunk.manifest import TrunkManifest
from k3core.trunk.parts import LayerPart, LayerSplit, split_layer

#: a matrix of a unit: its suffix, its offset in the unit's buffer, its bytes, dtype, shape
View = tuple[str, int, int, np.dtype, tuple[int, ...]]


class TrunkUnits:
    """The first ``n_layers`` layers of ``manifest``, each split into its parts (one part a
    layer unless ``split``), numbered in walk order."""

    def __init__(self, cfg: ModelConfig, manifest: TrunkManifest, n_layers: int, split: bool):
        self.cfg = cfg
        self.manifest = manifest
        self.splits: list[LayerSplit] = [split_layer(manifest.layers[L], split)
                                         for L in range(n_layers)]
        self.units: list[LayerPart] = [p for sp in self.splits for p in sp.parts]
        #: the unit number of each layer's first part
        self.first: list[int] = []
        acc = 0
        for sp in self.splits:
            self.first.append(acc)
            acc += len(sp.parts)
        self._views = [self._unit_views(part) for part in self.units]

    @property
    def n_layers(self) -> int:
        return len(self.splits)

    @property
    def labels(self) -> list[str]:
        return [u.label for u in self.units]

    def index(self, u: int) -> int:
        """Which part of its layer unit ``u`` is."""
        return u - self.first[self.units[u].layer]

    def last(self, layer: int) -> int:
        """The unit of ``layer``'s last part (its MLP/MoE part, or the whole layer)."""
        return self.first[layer] + len(self.splits[layer].parts) - 1

    def whole_layers(self, units: set[int]) -> tuple[int, ...]:
        """The layers every part of which is in ``units``."""
        return tuple(L for L, sp in enumerate(self.splits)
                     if all(self.first[L] + k in units for k in range(len(sp.parts))))

    def bind(self, u: int, buf: np.ndarray) -> dict[str, np.ndarray]:
        """Unit ``u``'s matrices over ``buf``, which holds its bytes from its start; valid
        as long as ``buf`` holds them."""
        raw: dict[str, np.ndarray] = {}
        for suffix, off, nbytes, dtype, shape in self._views[u]:
            view = buf[off : off + nbytes].view(dtype).reshape(shape)
            view.flags.writeable = False
            raw[suffix] = view
        return bind_matrices(self.cfg, self.units[u].layer, raw)

    def _unit_views(self, part: LayerPart) -> list[View]:
        want = set(part.matrices)
        out = []
        for t in self.manifest.layers[part.layer].tensors.values():
            split = names.split_layer_name(t.name)
            assert split is not None  # checked by the manifest reader
            if split[1] in want:
                out.append((split[1], t.off - part.start, t.nbytes, t.np_dtype, t.shape))
        return out
