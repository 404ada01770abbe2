"""The latent MLA cache gives the same bits in every mode, on every backend.

One model, the logits of every position of one sequence computed four ways: one full pass
(full recompute), token by token (incremental), in uneven chunks (chunked prefill then
decoding), and token by token after a rollback (``pos`` lowered and the KDA state restored:
the latent rows the rejected guess wrote beyond ``pos`` are overwritten, never read). All four must be byte-identical to each other and to the numpy reference, for
every available accelerated backend at 1, 2 and 3 threads with the parallel paths forced,
with the trunk resident and streamed from a packed trunk at its floor.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
from thin import thinned
from typer.testing import CliRunner

from k3core.model.state import SequenceState
from k3core.plugins.registry import get_registry

IDS = [3, 7, 11, 5, 2, 9]
CHUNKS = [3, 2, 1]
MODES = ("full", "incremental", "chunked", "rollback")


def _available(name: str) -> bool:
    reg = get_registry()
    return name in reg.names("kernel") and reg.probe("kernel", name).ok


ACCELERATED = [n for n in ("avx2", "numba") if _available(n)]


def _model_and_trunk(root: Path) -> tuple[Path, Path, float]:
    """A tiny synthetic model, its packed trunk, and the trunk floor in GB."""
    from k3_storage.plain import PlainStorage

    from k3core.checkpoint.index import CheckpointIndex
    from k3core.cli.app import app
    from k3core.model.config import ModelConfig, load_config
    from k3core.model.shapes import size_config
    from k3core.tools.synth.writer import synthesize
    from k3core.trunk.manifest import open_trunk

    model = synthesize(root / "tiny", ModelConfig.from_json_dict(size_config("tiny")), 4)
    trunk = root / "trunk"
    res = CliRunner().invoke(app, ["pack-trunk", str(model), str(trunk)])
    assert res.exit_code == 0, res.output
    cfg = load_config(model / "config.json")
    with CheckpointIndex.open(model, PlainStorage()) as idx:
        floor = max(lay.nbytes for lay in open_trunk(trunk, idx, cfg).layers)
    return model, trunk, floor / 1e9


@pytest.fixture(scope="module")
def streamed(tmp_path_factory) -> tuple[Path, Path, float]:
    from k3core.testing.faulty_backend import disk_backed_dir

    return _model_and_trunk(disk_backed_dir(tmp_path_factory.mktemp("latent")))


def _modes(model, modes: tuple[str, ...] = MODES) -> dict[str, bytes]:
    cfg, ids = model.cfg, np.array(IDS)
    out = {"full": model.forward(ids, SequenceState(cfg, len(IDS)), all_logits=True).tobytes()}
    st = SequenceState(cfg, len(IDS))
    if "incremental" in modes or "rollback" in modes:
        out["incremental"] = b"".join(model.forward(ids[i : i + 1], st).tobytes()
                                      for i in range(len(IDS)))
    st, parts, at = SequenceState(cfg, len(IDS)), [], 0
    for n in CHUNKS:
        parts.append(model.forward(ids[at : at + n], st, all_logits=True).tobytes())
        at += n
    out["chunked"] = b"".join(parts)
    if "rollback" not in modes:
        return out
    st = SequenceState(cfg, len(IDS))
    model.forward(ids[:4], st)
    kept = copy.deepcopy(st.kda)  # the recurrent state has no rows to roll back: restore it
    model.forward(np.array([1, 1]), st)  # a speculative guess, then rolled back
    st.pos, st.kda = 4, kept
    rolled = [model.forward(ids[i : i + 1], st).tobytes() for i in range(4, len(IDS))]
    head = out["incremental"][: 4 * len(out["incremental"]) // len(IDS)]
    out["rollback"] = head + b"".join(rolled)
    return out


def _run(model_dir: Path, backend: str, threads: int, trunk: Path | None = None,
         trunk_gb: float | None = None, modes: tuple[str, ...] = MODES) -> dict[str, bytes]:
    from k3core.run.engine import open_engine
    from k3core.run.request import EngineRequest

    eng = open_engine(EngineRequest(model_dir=model_dir, backend=backend, storage="plain",
                                    threads=threads, trunk=trunk, trunk_gb=trunk_gb))
    try:
        if backend != "numpy":
            assert eng.kernels.parallel_forced
        return _modes(eng.model, modes)
    finally:
        eng.close()


def test_every_mode_gives_the_reference_bits(streamed) -> None:
    model, _, _ = streamed
    ref = _run(model, "numpy", 1)
    assert len({*ref.values()}) == 1, {k: len(v) for k, v in ref.items()}


@pytest.mark.skipif(not ACCELERATED, reason="no accelerated kernel backend here")
@pytest.mark.parametrize("threads", thinned([1, 2, 3], (2,)), ids=lambda n: f"threads{n}")
def test_accelerated_backends_every_mode_forced_parallel(streamed, monkeypatch, threads) -> None:
    model, trunk, floor_gb = streamed
    want = _run(model, "numpy", 1)["full"]
    monkeypatch.setenv("K3_FORCE_PARALLEL", "1")
    for backend in ACCELERATED:
        # (full recompute and incremental decoding streamed: tests/backends/test_parallel_paths.py)
        for where, extra in (("resident", {}),
                             ("streamed", {"trunk": trunk, "trunk_gb": floor_gb * 1.000001,
                                           "modes": ("full", "chunked")})):
            got = _run(model, backend, threads, **extra)
            for mode, data in got.items():
                assert data == want, f"{backend} {threads} threads {where} {mode}: logits differ"


def _old_style_backend():
    """A backend written before ``mla_latent_attention`` existed: only the abstract ops."""
    from k3_backends.numpy_backend import NumpyBackend

    from k3core.api.kernels import KernelBackend

    ref = NumpyBackend()
    ops = {name: (lambda op: lambda self, *a: getattr(ref, op)(*a))(name)
           for name in KernelBackend.__abstractmethods__}
    return type("OldStyle", (KernelBackend,), ops)()


def test_a_backend_without_the_fused_op_gets_the_contract_bits() -> None:
    """The non-abstract default composes the op from ``matmul`` and ``mla_attention``."""
    from k3core.testing import kernel_conformance as kc

    old = _old_style_backend()
    assert "mla_latent_attention" not in type(old).__dict__
    rng = np.random.default_rng(11)
    T, H, n, r, dv, C, pos0 = 3, 4, 24, 8, 16, 32, 4
    q = rng.standard_normal((T, H, n + r)).astype(np.float32)
    cache = rng.standard_normal((pos0 + T + 1, C + r)).astype(np.float32)
    for w in (rng.standard_normal((H * (n + dv), C)).astype(np.float32),
              kc.bf16_bits(rng, (H * (n + dv), C), finite=True) & np.uint16(0xBFFF)):
        kc.compare(old, "mla_latent_attention", q, cache, w, pos0, 0.17)
    net, prompt = kc._build_model("released", old)
    got = kc._decode_logits(net, prompt, True)
    for g, want in zip(got, kc._reference_logits("released", True), strict=True):
        kc.assert_same_bits(g, want, "old-style backend logits")
