"""What an accepted trunk manifest promises the streamer, as assertions.

Shared by the manifest fuzz test (``tests/trunk/test_trunk_faults.py``) and the atheris
harness (``fuzz/fuzz_manifest.py``): whatever bytes a manifest was parsed from, if
:func:`k3core.trunk.manifest.parse_manifest` accepted it, these hold.
"""

from __future__ import annotations

from itertools import pairwise

from k3core.api.units import ALIGN
from k3core.checkpoint.index import CheckpointIndex
from k3core.trunk.manifest import TrunkManifest


def check_accepted(man: TrunkManifest, index: CheckpointIndex) -> None:
    """Layers in order, runs aligned and disjoint inside the file, tensors inside their run
    and exactly like the checkpoint's."""
    assert [lay.layer for lay in man.layers] == list(range(man.n_layers))
    runs = sorted(man.layers, key=lambda lay: lay.file_off)
    for a, b in pairwise(runs):
        assert a.file_off + a.nbytes <= b.file_off
    for lay in man.layers:
        assert lay.file_off % ALIGN == 0 and lay.nbytes % ALIGN == 0
        assert lay.file_off + lay.nbytes <= man.total_bytes
        for t in lay.tensors.values():
            info = index.info(t.name)
            assert 0 <= t.off and t.off + t.nbytes <= lay.span
            assert (info.dtype, info.shape, info.nbytes) == (t.dtype, t.shape, t.nbytes)
