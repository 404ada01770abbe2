"""The last layer runs its MLP only over the rows whose logits are asked (k3core/model/forward.py,
``Model.layer``'s ``keep``): its attention still takes every row (the KV cache, the KDA state
and the conv history need them), and every op after it is per row, so the logits and the state
a pass leaves are the full layer's, byte for byte. An MLA last layer goes further: every row's
latent goes to the KV cache, but only the asked rows project q and attend. A hook that watches
every layer (``on_layer``) turns the cut off, which gives the reference here."""

from __future__ import annotations

import numpy as np
import pytest

import k3
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.model.state import SequenceState
from k3core.plugins.registry import get_registry
from k3core.tools.synth.writer import synthesize

IDS = [3, 7, 11, 5, 9, 2, 14, 8, 1]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return synthesize(tmp_path_factory.mktemp("last") / "tiny",
                      ModelConfig.from_json_dict(size_config("tiny")), seed=6)


def _run(eng, ids, *, watch: bool, tail: int = 1, chunk: int | None = None, then=(4, 6)):
    """Logits of ``ids`` (last ``tail`` rows), then of two single steps after them; the rows
    the last layer's MLP saw, per pass; and the rows an MLA last layer's attention output."""
    m = eng.model
    seen: list[int] = []
    attended: list[int] = []
    last = m.n_layers - 1
    mlp = m.moe if not eng.cfg.is_dense(last) else m.dense_mlp
    mla = m.mla

    def spy(p, x, *guess):  # the MoE also takes the router lookahead's guess
        if p.layer == last:
            seen.append(x.shape[0])
        return mlp(p, x, *guess)

    def mla_spy(p, x, st, keep=None):
        out = mla(p, x, st, keep)
        if p.layer == last:
            attended.append(out.shape[0])
        return out

    name = "dense_mlp" if eng.cfg.is_dense(last) else "moe"
    setattr(m, name, spy)
    m.mla = mla_spy
    m.on_layer = (lambda layer, h: None) if watch else None
    m.prefill_chunk = chunk
    try:
        st = SequenceState(eng.cfg, len(ids) + len(then), shared_kda_slot=m.shared_kda_slot)
        outs = [m.forward(np.array(ids), st, tail=tail)]
        outs += [m.forward(np.array([i]), st) for i in then]
    finally:
        delattr(m, name)
        del m.mla
        m.on_layer = None
        m.prefill_chunk = None
    return [o.tobytes() for o in outs], seen, attended


def _backends() -> list[str]:
    reg = get_registry()
    return [n for n in ("numpy", "avx2") if n in reg.names("kernel") and reg.probe("kernel", n).ok]


@pytest.mark.parametrize("layers", [None, 11])  # an MLA last layer, then a KDA one
@pytest.mark.parametrize("backend", _backends())
def test_the_cut_last_layer_gives_the_full_layers_bytes(model, layers, backend):
    with k3.load(model, backend=backend, layers=layers) as eng:
        mla_last = eng.cfg.is_mla(eng.model.n_layers - 1)
        assert mla_last == (layers is None)
        full, rows_full, att_full = _run(eng, IDS, watch=True)
        cut, rows_cut, att_cut = _run(eng, IDS, watch=False)
        assert cut == full  # the prompt's logits and the two steps after it (the KV cache)
        assert rows_full == [9, 1, 1] and rows_cut == [1, 1, 1]
        assert att_full == ([9, 1, 1] if mla_last else [])
        assert att_cut == ([1, 1, 1] if mla_last else [])

        # several rows asked (a speculative verification pass): those rows, no fewer
        full3, _, _ = _run(eng, IDS, watch=True, tail=3)
        cut3, rows3, att3 = _run(eng, IDS, watch=False, tail=3)
        assert cut3 == full3 and rows3[0] == 3
        assert att3 == ([3, 1, 1] if mla_last else [])

        # chunked: the chunks before the last ask no row, so their last MLP never runs (and
        # an MLA last layer only fills the KV cache there)
        chunked, rows_chunked, att_chunked = _run(eng, IDS, watch=False, chunk=4)
        assert chunked == full
        assert rows_chunked == [1, 1, 1]
        assert att_chunked == ([0, 0, 1, 1, 1] if mla_last else [])
