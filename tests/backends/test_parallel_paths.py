"""The multi-threaded code paths, really taken, give the reference's bytes.

The test models are far below every backend's threading threshold, so without help a
"two-thread" run would execute serial code. ``set_force_parallel`` (``K3_FORCE_PARALLEL=1``
for backends made through the registry) switches the thresholds off. Here: the avx2
backend proves that it then enters multi-threaded regions; the numba backend runs the
whole models at three threads (in a child process, because Numba fixes its thread pool at
import); and a streamed trunk (the packed-trunk ring at its floor, and everything resident)
gives the numpy reference's logits bytes at 1, 2 and 3 threads, full recompute and
incremental, for every available accelerated backend.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from thin import SLOW
from typer.testing import CliRunner

from k3core.api.errors import PluginError
from k3core.api.kernels import force_parallel_from_env
from k3core.plugins.registry import get_registry

runner = CliRunner()
PROMPT = [3, 7, 11, 5]
STEPS = 3


def _available(name: str) -> bool:
    reg = get_registry()
    return name in reg.names("kernel") and reg.probe("kernel", name).ok


ACCELERATED = [n for n in ("avx2", "numba") if _available(n)]


def test_switch_from_the_environment(monkeypatch) -> None:
    for raw, want in (("", False), ("0", False), ("no", False), ("1", True), ("TRUE", True)):
        monkeypatch.setenv("K3_FORCE_PARALLEL", raw)
        assert force_parallel_from_env() is want
    monkeypatch.setenv("K3_FORCE_PARALLEL", "sometimes")
    with pytest.raises(PluginError, match="K3_FORCE_PARALLEL"):
        force_parallel_from_env()


@pytest.mark.skipif("avx2" not in ACCELERATED, reason="the avx2 backend is not available here")
def test_avx2_forced_runs_multithreaded_regions(monkeypatch) -> None:
    from k3_backends.avx2_backend import Avx2Backend

    rng = np.random.default_rng(5)
    w = rng.integers(0, 1 << 15, (8, 64), dtype=np.uint16)
    x = rng.standard_normal((1, 64)).astype(np.float32)
    quiet = Avx2Backend(threads=2, force_parallel=False)
    lib = quiet._lib
    before = lib.k3_parallel_regions()
    quiet.matmul_bf16(w, x)
    assert lib.k3_parallel_regions() == before, "a tiny product must stay on one thread"
    forced = Avx2Backend(threads=2, force_parallel=True)
    assert forced.parallel_forced
    got = forced.matmul_bf16(w, x)
    assert lib.k3_parallel_regions() > before, "forced: the product must run multi-threaded"
    assert got.tobytes() == quiet.matmul_bf16(w, x).tobytes()
    monkeypatch.setenv("K3_FORCE_PARALLEL", "1")
    assert Avx2Backend(threads=2).parallel_forced


# ---- numba at three threads (a child process: Numba's pool is sized at import) -------------
_CHILD = textwrap.dedent(
    """
    import hashlib, json
    from k3_backends.numba_backend import NumbaBackend
    from k3core.testing import kernel_conformance as kc

    b = NumbaBackend(threads=3, force_parallel=True)
    assert b.threads == 3, b.threads
    out = {}
    for model in ("float32", "released"):
        for inc in (False, True):
            net, prompt = kc._build_model(model, b)
            logits = kc._decode_logits(net, prompt, inc)
            out[f"{model}-{inc}"] = [hashlib.sha256(a.tobytes()).hexdigest() for a in logits]
    print(json.dumps(out))
    """
)


@pytest.mark.skipif("numba" not in ACCELERATED, reason="the numba backend is not available here")
def test_numba_three_threads_forced_whole_models() -> None:
    import hashlib

    from k3core.testing import kernel_conformance as kc

    env = dict(os.environ, NUMBA_NUM_THREADS="3")
    env.pop("K3_FORCE_PARALLEL", None)
    res = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    for model in ("float32", "released"):
        for inc in (False, True):
            want = [hashlib.sha256(a.tobytes()).hexdigest() for a in kc._reference_logits(model, inc)]
            assert got[f"{model}-{inc}"] == want, (model, inc)


# ---- a streamed trunk, forced parallel, every thread count ------------------------------------
def _model_and_trunk(root: Path) -> tuple[Path, Path, float]:
    from k3_storage.plain import PlainStorage

    from k3core.checkpoint.index import CheckpointIndex
    from k3core.cli.app import app
    from k3core.model.config import ModelConfig, load_config
    from k3core.model.shapes import size_config
    from k3core.tools.synth.writer import synthesize
    from k3core.trunk.manifest import open_trunk

    model = synthesize(root / "tiny", ModelConfig.from_json_dict(size_config("tiny")), 2)
    trunk = root / "trunk"
    res = runner.invoke(app, ["pack-trunk", str(model), str(trunk)])
    assert res.exit_code == 0, res.output
    cfg = load_config(model / "config.json")
    with CheckpointIndex.open(model, PlainStorage()) as idx:
        floor = max(lay.nbytes for lay in open_trunk(trunk, idx, cfg).layers)
    return model, trunk, floor / 1e9


@pytest.fixture(scope="module")
def streamed(tmp_path_factory) -> tuple[Path, Path, float]:
    from k3core.testing.faulty_backend import disk_backed_dir

    return _model_and_trunk(disk_backed_dir(tmp_path_factory.mktemp("forced")))


def _step_logits(model: Path, backend: str, threads: int, incremental: bool,
                 trunk: Path | None = None, trunk_gb: float | None = None) -> list[bytes]:
    from k3core.run.engine import open_engine
    from k3core.run.generate import generate
    from k3core.run.request import EngineRequest

    opts = EngineRequest(model_dir=model, backend=backend, storage="plain", threads=threads,
                         trunk=trunk, trunk_gb=trunk_gb)
    eng = open_engine(opts)
    try:
        if backend != "numpy":
            assert eng.kernels.parallel_forced, "K3_FORCE_PARALLEL=1 must reach the backend"
        run = generate(eng.model, PROMPT, STEPS, incremental=incremental, keep_logits=True)
    finally:
        eng.close()
    return [a.tobytes() for a in run.step_logits]


@pytest.mark.skipif(not ACCELERATED, reason="no accelerated kernel backend here")
@pytest.mark.parametrize("incremental", [pytest.param(False, marks=SLOW), True], ids=["full", "incremental"])
def test_streamed_and_resident_forced_parallel(streamed, monkeypatch, incremental) -> None:
    model, trunk, floor_gb = streamed
    want = _step_logits(model, "numpy", 1, incremental)
    monkeypatch.setenv("K3_FORCE_PARALLEL", "1")
    for backend in ACCELERATED:
        for threads in (1, 2, 3):
            for where, extra in (("resident", {}),
                                 ("streamed", {"trunk": trunk, "trunk_gb": floor_gb * 1.000001})):
                got = _step_logits(model, backend, threads, incremental, **extra)
                assert got == want, f"{backend} {threads} threads {where}: logits differ"
