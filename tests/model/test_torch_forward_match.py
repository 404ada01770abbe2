"""The trainer's PyTorch graph (tools/train/k3torch.py) computes what k3 computes.

On a ``k3 synth`` model loaded into torch: logits within 1e-4 of the largest logit and the
same greedy ids as k3's numpy reference, with the KDA recurrence step by step and in
chunks; the chunked form equals the sequential one; MXFP4 packing round-trips through k3's
decoder; a trained-layout export read back by k3 gives torch's logits. Skipped where torch
(the ``[train]`` extra) is not installed: the default install never needs it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from k3_backends.exact_numpy import mxfp4_to_f64  # noqa: E402

from k3core.model.config import ModelConfig  # noqa: E402
from k3core.model.shapes import size_config  # noqa: E402
from k3core.model.state import SequenceState  # noqa: E402
from k3core.run.engine import open_engine  # noqa: E402
from k3core.run.request import EngineRequest  # noqa: E402
from k3core.tools.synth.writer import synthesize  # noqa: E402
from tools.train import k3torch  # noqa: E402
from tools.train.released import export, load_model, pack_mxfp4  # noqa: E402

T = 32


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    out = tmp_path_factory.mktemp("torch") / "tiny"
    return synthesize(out, ModelConfig.from_json_dict(size_config("tiny")), seed=3)


def k3_logits(model_dir: Path, ids: np.ndarray, incremental: bool = False) -> np.ndarray:
    eng = open_engine(EngineRequest(model_dir=model_dir, backend="numpy"))
    try:
        st = SequenceState(eng.cfg, len(ids))
        if not incremental:
            return eng.model.forward(ids, st, all_logits=True)
        return np.concatenate([eng.model.forward(ids[t : t + 1], st) for t in range(len(ids))])
    finally:
        eng.close()


def torch_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(ids)[None])[0].double().numpy()


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float((np.abs(a - b).max(axis=1) / np.abs(b).max(axis=1)).max())


@pytest.mark.parametrize("chunk", [0, 16])
def test_torch_matches_k3_on_a_synthetic_model(synth, chunk):
    ids = np.random.default_rng(0).integers(0, 1024, size=T)
    ref = k3_logits(synth, ids)
    m = load_model(synth).eval()
    m.chunk = chunk
    out32 = torch_logits(m, ids)
    assert (out32.argmax(1) == ref.argmax(1)).all()
    # random weights make the 13 layers chaotic: fp32 rounding alone grows to ~1e-4 here,
    # so the tolerance is checked in float64 (the same graph), where it is ~2e-5
    out64 = torch_logits(m.double(), ids)
    assert rel(out64, ref) < 1e-4
    assert (out64.argmax(1) == ref.argmax(1)).all()


def test_chunked_kda_equals_the_recurrence():
    g = torch.Generator().manual_seed(0)
    B, L, H, D = 2, 48, 3, 8
    q, k, v = (torch.randn(B, L, H, D, generator=g, dtype=torch.float64) for _ in range(3))
    q, k = (x / x.norm(dim=-1, keepdim=True) for x in (q, k))
    gate = -5.0 * torch.rand(B, L, H, D, generator=g, dtype=torch.float64)
    beta = torch.rand(B, L, H, generator=g, dtype=torch.float64)
    a = k3torch.kda_recurrence(q, k, v, torch.exp(gate), beta)
    b = k3torch.kda_chunked(q, k, v, gate, beta, chunk=16)
    assert torch.allclose(a, b, atol=1e-10, rtol=0)


def test_mxfp4_pack_round_trips_through_k3s_decoder():
    w = torch.randn(6, 96, generator=torch.Generator().manual_seed(1)) * 0.05
    w[0, :32] = 0.0  # an all-zero group
    packed, scales = pack_mxfp4(w)
    decoded = mxfp4_to_f64(packed, scales)
    assert np.array_equal(decoded, k3torch.mxfp4_fake(w).double().numpy())
    assert np.abs(decoded - w.double().numpy()).max() < 0.05 * 0.6


def test_export_is_what_k3_runs(tmp_path):
    cfg = ModelConfig.from_json_dict(size_config("tiny", {"num_hidden_layers": 5,
                                     "full_attn_layers": [4, 5], "vocab_size": 512}))
    m = k3torch.K3(cfg, seed=4, init_std=0.1)
    out = export(m, tmp_path / "exported")
    ids = np.random.default_rng(2).integers(0, 512, size=T)
    ref = k3_logits(out, ids)
    back = load_model(out).eval()
    got = torch_logits(back, ids)
    assert rel(got, ref) < 1e-4 and (got.argmax(1) == ref.argmax(1)).all()
    inc = k3_logits(out, ids, incremental=True)
    assert inc.tobytes() == ref.tobytes()
