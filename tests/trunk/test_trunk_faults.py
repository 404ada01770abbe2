"""Refusals around the packed trunk: hostile manifests, damaged files, wrong pairings,
impossible budgets, and a trunk.bin that fails while a run streams from it."""

from __future__ import annotations

import copy
import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from k3_storage.plain import PlainStorage
from typer.testing import CliRunner

from k3core.api.errors import CheckpointError, K3Error, StorageError
from k3core.api.units import ALIGN
from k3core.checkpoint.index import CheckpointIndex
from k3core.cli.app import app
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.run.engine import open_engine
from k3core.run.generate import generate
from k3core.run.request import EngineRequest
from k3core.testing.faulty_backend import (
    available_storage,
    disk_backed_dir,
    env,
    register_faulty,
    unregister_faulty,
)
from k3core.testing.manifest_promises import check_accepted
from k3core.tools.synth.writer import synthesize
from k3core.trunk.manifest import DATA_NAME, MANIFEST_NAME, open_trunk, parse_manifest
from k3core.trunk.parts import split_layer
from k3core.trunk.plan import gb_ceil
from k3core.trunk.sample import windows

runner = CliRunner()


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return disk_backed_dir(tmp_path_factory.mktemp("faults"))


@pytest.fixture(scope="module")
def model(work) -> Path:
    return synthesize(work / "a", ModelConfig.from_json_dict(size_config("tiny")), 4)


@pytest.fixture(scope="module")
def trunk(model, work) -> Path:
    out = work / "trunk-a"
    assert runner.invoke(app, ["pack-trunk", str(model), str(out)]).exit_code == 0
    return out


@pytest.fixture(scope="module")
def doc(trunk) -> dict:
    return json.loads((trunk / MANIFEST_NAME).read_text())


def _variant(trunk: Path, work: Path, tag: str, manifest: bytes | None = None,
             blob: bytes | None = None) -> Path:
    d = work / f"variant-{tag}"
    d.mkdir()
    (d / MANIFEST_NAME).write_bytes(manifest if manifest is not None
                                    else (trunk / MANIFEST_NAME).read_bytes())
    (d / DATA_NAME).write_bytes(blob if blob is not None else (trunk / DATA_NAME).read_bytes())
    return d


@pytest.fixture
def faulty():
    """``--storage faulty`` for one test (removed again so the registry stays as found)."""
    register_faulty()
    yield
    unregister_faulty()


def _run(model: Path, trunk: Path, *extra: str):
    return runner.invoke(app, ["run", str(model), "--ids", "3,7,11", "--gen", "2",
                               "--trunk", str(trunk), *extra])


def _err(res) -> str:
    return " ".join(res.output.split())


def test_truncated_trunk_bin(model, trunk, work) -> None:
    d = _variant(trunk, work, "trunc", blob=(trunk / DATA_NAME).read_bytes()[:-ALIGN])
    res = _run(model, d)
    assert res.exit_code == 1
    assert "truncated or replaced, repack the trunk" in _err(res)


@pytest.mark.parametrize("tag, mutate, message", [
    ("not-json", lambda d: b"{\"format\": \"k3-trunk\", ", "invalid JSON"),
    ("dup-key", lambda d: b"{\"align\": 4096, \"align\": 4096}", "duplicate key"),
    ("nan", lambda d: b"{\"align\": NaN}", "NaN is not a JSON number"),
    ("layer-str", lambda d: _set(d, ["layers", 3, "layer"], "3"), "layer must be an integer"),
    ("align", lambda d: _set(d, ["align"], 512), "align must be 4096"),
    ("overlap", lambda d: _set(d, ["layers", 4, "file_off"], d["layers"][3]["file_off"]),
     "overlaps layer"),
    ("escape", lambda d: _grow_tensor(d, 2), "escapes its run"),
    ("missing-layer", lambda d: _drop_layer(d, 7), "n_layers is 13 but layers lists 12"),
    ("twice", lambda d: _set(d, ["layers", 7], d["layers"][6]), "layer 6 is listed twice"),
    ("version", lambda d: _set(d, ["version"], 3), "version 3 is not supported"),
    ("past-end", lambda d: _set(d, ["total_bytes"], d["total_bytes"] - ALIGN), "past total_bytes"),
    ("moved-tensor", lambda d: _shift_tensor(d, 1), "not where the verbatim copy puts it"),
])
def test_corrupt_manifest_is_refused(model, trunk, work, doc, tag, mutate, message) -> None:
    data = mutate(copy.deepcopy(doc))
    if isinstance(data, dict):
        data = json.dumps(data).encode()
    res = _run(model, _variant(trunk, work, tag, manifest=data))
    assert res.exit_code == 1, res.output
    assert message in _err(res), _err(res)
    assert "Traceback" not in res.output


def _set(d: dict, path: list, value: Any) -> dict:
    node = d
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return d


def _grow_tensor(d: dict, L: int) -> dict:
    lay = d["layers"][L]
    name = max(lay["tensors"], key=lambda n: lay["tensors"][n]["off"])
    lay["tensors"][name]["off"] += ALIGN
    return d


def _shift_tensor(d: dict, L: int) -> dict:
    """Swap two same-sized tensors' places: inside the run, no overlap, but not verbatim."""
    ts = d["layers"][L]["tensors"]
    a, b = (n for n in ts if n.endswith(("input_layernorm.weight", "post_attention_layernorm.weight")))
    ts[a]["off"], ts[b]["off"] = ts[b]["off"], ts[a]["off"]
    return d


def _drop_layer(d: dict, L: int) -> dict:
    del d["layers"][L]
    return d


def test_oversized_manifest_is_refused(model, trunk, work) -> None:
    d = _variant(trunk, work, "huge", manifest=b" " * (17 * 1024 * 1024))
    res = _run(model, d)
    assert res.exit_code == 1 and "MB limit" in _err(res)


def test_trunk_from_another_checkpoint(model, trunk, work) -> None:
    other = synthesize(work / "b", ModelConfig.from_json_dict(size_config("tiny")), 5)
    res = _run(other, trunk)
    assert res.exit_code == 1
    assert f"trunk at {trunk} was packed from a different checkpoint" in _err(res)


def test_missing_trunk_and_missing_manifest(model, trunk, work) -> None:
    """Missing input paths are usage errors (exit 2), like a missing --prompt-file."""
    res = _run(model, work / "nowhere")
    assert res.exit_code == 2 and "does not exist" in _err(res)
    d = work / "bin-only"
    d.mkdir()
    (d / DATA_NAME).write_bytes(b"")
    res = _run(model, d)
    assert res.exit_code == 2 and "no trunk manifest" in _err(res)


def test_budget_below_the_floor(model, trunk, doc) -> None:
    cfg = ModelConfig.from_json_dict(json.loads((model / "config.json").read_text()))
    with CheckpointIndex.open(model, PlainStorage()) as idx:
        man = open_trunk(trunk, idx, cfg)
    floor = max(p.nbytes for lay in man.layers for p in split_layer(lay).parts)  # largest part
    assert floor < max(lay["nbytes"] for lay in doc["layers"])
    res = _run(model, trunk, "--trunk-gb", f"{(floor - 1) / 1e9:.9f}")
    assert res.exit_code == 2
    assert "is below the floor" in _err(res) and f"--trunk-gb {gb_ceil(floor)}" in _err(res)
    assert "largest streaming unit" in _err(res)
    assert _run(model, trunk, "--trunk-gb", f"{floor / 1e9:.9f}").exit_code == 0


@pytest.mark.parametrize("args, message", [
    (["--ultra-low-memory"], "--ultra-low-memory needs --trunk DIR"),
    (["--trunk-gb", "1"], "--trunk-gb needs --trunk DIR"),
    (["--trunk-ring", "2"], "--trunk-ring needs --trunk DIR"),
])
def test_flags_that_need_a_trunk(model, args, message) -> None:
    res = runner.invoke(app, ["run", str(model), "--ids", "3", "--gen", "1", *args])
    assert res.exit_code == 2 and message in _err(res)


@pytest.mark.parametrize("args, message", [
    (["--trunk-gb", "0"], "--trunk-gb must be a positive number"),
    (["--trunk-gb", "nan"], "--trunk-gb must be a positive number"),
    (["--trunk-ring", "9"], "--trunk-ring must be in 1..8"),
])
def test_bad_trunk_values(model, trunk, args, message) -> None:
    res = _run(model, trunk, *args)
    assert res.exit_code == 2 and message in _err(res)


@pytest.mark.parametrize("after", [0, 5, 20])
@pytest.mark.parametrize("ring_gb_factor", [1, 2])
def test_read_failure_mid_run_fails_the_run(model, trunk, work, doc, monkeypatch, faulty, after,
                                            ring_gb_factor) -> None:
    """The faulty backend fails every trunk.bin read after the open-time sample reads and
    ``after`` good layer reads: exit 1, no --out written, never a token computed from a
    partial layer."""
    at_open = sum(len(windows(lay["span"])) for lay in doc["layers"])
    for k, v in env(after=at_open + after, match=DATA_NAME, inner="plain").items():
        monkeypatch.setenv(k, v)
    floor = max(lay["nbytes"] for lay in doc["layers"])
    out = work / f"never-{after}-{ring_gb_factor}.json"
    res = _run(model, trunk, "--storage", "faulty", "--trunk-gb",
               f"{ring_gb_factor * floor / 1e9:.9f}", "--out", str(out))
    assert res.exit_code == 1, res.output
    assert "trunk layer" in _err(res) and "injected read failure" in _err(res)
    assert "generated ids" not in res.output
    assert not out.exists()


def test_read_failure_at_open_is_refused(model, trunk, work, monkeypatch, faulty) -> None:
    for k, v in env(after=0, match=DATA_NAME, inner="plain").items():
        monkeypatch.setenv(k, v)
    res = _run(model, trunk, "--storage", "faulty")
    assert res.exit_code == 1 and "layer 0" in _err(res) and "injected read failure" in _err(res)


def test_trunk_bin_swapped_for_other_bytes(model, trunk, work) -> None:
    blob = bytearray((trunk / DATA_NAME).read_bytes())
    blob[:ALIGN] = bytes(ALIGN)
    res = _run(model, _variant(trunk, work, "swapped", blob=bytes(blob)))
    assert res.exit_code == 1
    assert "layer 0 does not hold the checkpoint's bytes" in _err(res)


@pytest.mark.parametrize("storage", [s for s in available_storage() if s != "mmap"])
def test_trunk_bin_truncated_between_tokens(model, trunk, work, doc, storage) -> None:
    """A real truncation while streaming (``mmap`` is left out: a mapped file that shrinks
    raises SIGBUS, which the mmap backend's own tests cover)."""
    d = _variant(trunk, work, f"shrinks-{storage}")
    floor = max(lay["nbytes"] for lay in doc["layers"])
    opts = EngineRequest(model_dir=model, storage=storage, trunk=d, trunk_gb=2 * floor / 1e9)
    engine = open_engine(opts)
    first_half = doc["layers"][6]["file_off"]

    def shrink(step: int) -> None:
        if step == 1:
            os.truncate(d / DATA_NAME, first_half)

    try:
        with pytest.raises(StorageError, match="trunk layer .*(short read|outside the file)"):
            generate(engine.model, [3, 7, 11], 3, incremental=True, before_step=shrink)
    finally:
        engine.close()
    assert engine.model.layers_completed <= 6  # step 1 stopped at the first missing layer
    threads = engine.model.trunk.threads  # type: ignore[attr-defined]
    assert threads and not any(t.is_alive() for t in threads)  # close() stopped the reader


# ---- fuzz: every mutated manifest is accepted (and then safe) or refused with a K3Error -------
_KEYS = ["format", "version", "align", "n_layers", "total_bytes", "source_fingerprint",
         "source_sample", "config_fingerprint", "layers"]
_LAYER_KEYS = ["layer", "file_off", "nbytes", "span", "checksum", "tensors"]
_T_KEYS = ["off", "nbytes", "dtype", "shape"]
_KINDS = ["root", "layer", "tensor", "drop", "swap", "dup", "int", "int"]
_VALUES: list[Any] = [None, True, False, -1, 0, 1, 2, 3, 4095, 4096, 8192, 1 << 31, 1 << 62,
                      1 << 70, -(1 << 70), 1.5, -0.0, "", "x", "3", "BF16", "F32", "U8", "F16",
                      "I8R", "k3-trunk", "crc32:00000000", "sha256:" + "0" * 64, "0" * 64, [],
                      {}, [1], [0, 5], [64, 128], [-1], [1 << 40, 1 << 40], {"off": 0},
                      [[1]], "\udc80"]


def _mutation(b: bytes) -> tuple:
    """Eight bytes -> (kind, layer, tensor, root key, layer key, tensor key, value, delta)."""
    delta = int.from_bytes(b[7:8], "little", signed=True) * (4096 if b[0] & 0x80 else 1)
    return (_KINDS[b[0] % len(_KINDS)], b[1], b[2], _KEYS[b[3] % len(_KEYS)],
            _LAYER_KEYS[b[4] % len(_LAYER_KEYS)], _T_KEYS[b[5] % len(_T_KEYS)],
            _VALUES[b[6] % len(_VALUES)], delta)


def _apply(doc: dict, m: tuple) -> Any:
    kind, L, t, rk, lk, tk, value, delta = m
    layers = doc.get("layers") if isinstance(doc, dict) else None
    lay = layers[L % len(layers)] if isinstance(layers, list) and layers else None
    tensors = lay.get("tensors") if isinstance(lay, dict) else None
    tname = sorted(tensors)[t % len(tensors)] if isinstance(tensors, dict) and tensors else None
    if kind == "root":
        doc[rk] = value
    elif kind == "layer" and isinstance(lay, dict):
        lay[lk] = value
    elif kind == "tensor" and tname is not None and isinstance(tensors[tname], dict):
        tensors[tname][tk] = value
    elif kind == "drop":
        target = tensors[tname] if tname is not None and delta % 3 == 0 else lay if delta % 3 == 1 else doc
        if isinstance(target, dict) and target:
            target.pop(sorted(target)[abs(delta) % len(target)])
    elif kind == "swap" and isinstance(layers, list) and len(layers) > 1:
        i, j = L % len(layers), (L + 1 + abs(delta)) % len(layers)
        layers[i], layers[j] = layers[j], layers[i]
    elif kind == "dup" and isinstance(layers, list) and lay is not None:
        layers.append(copy.deepcopy(lay))
    elif kind == "int":
        node = tensors[tname] if tname is not None and delta % 2 else lay
        key = tk if node is not lay else lk
        if isinstance(node, dict) and isinstance(node.get(key), int):
            node[key] += delta
    return doc


@pytest.fixture(scope="module")
def fuzz_env(work):
    """A 2-layer model (dense KDA, MoE MLA) keeps each fuzz case around a millisecond."""
    cfg = ModelConfig.from_json_dict(size_config("tiny", {"num_hidden_layers": 2,
                                                          "full_attn_layers": [2]}))
    small = synthesize(work / "small", cfg, 6)
    out = work / "trunk-small"
    assert runner.invoke(app, ["pack-trunk", str(small), str(out)]).exit_code == 0
    idx = CheckpointIndex.open(small, PlainStorage())
    doc = json.loads((out / MANIFEST_NAME).read_text())
    yield cfg, idx, out, pickle.dumps(doc)
    idx.close()


@settings(max_examples=10_000, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.binary(min_size=8, max_size=24))
def test_fuzzed_manifest_is_accepted_safely_or_refused(fuzz_env, data) -> None:
    """10,000 manifests, each with 1-3 structural mutations decoded from the drawn bytes
    (a byte string keeps Hypothesis's per-case cost well under a millisecond)."""
    cfg, idx, root, pickled = fuzz_env
    d = pickle.loads(pickled)
    for i in range(0, len(data) - 7, 8):
        d = _apply(d, _mutation(data[i : i + 8]))
    try:
        man = parse_manifest(d, root, idx, cfg, cfg.n_layers)
    except K3Error as exc:
        assert isinstance(exc, CheckpointError) and exc.message
        return
    check_accepted(man, idx)


@settings(max_examples=500, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, 1 << 20), st.binary(min_size=1, max_size=4))
def test_fuzzed_manifest_bytes_are_refused_cleanly(fuzz_env, work, pos, junk) -> None:
    """Damaged bytes through the whole open path (size cap, strict JSON, checks, samples)."""
    cfg, idx, root, _ = fuzz_env
    raw = bytearray((root / MANIFEST_NAME).read_bytes())
    pos %= len(raw)
    raw[pos : pos + len(junk)] = junk
    d = work / "fuzz-bytes"
    d.mkdir(exist_ok=True)
    (d / MANIFEST_NAME).write_bytes(bytes(raw))
    if not (d / DATA_NAME).exists():
        os.link(root / DATA_NAME, d / DATA_NAME)
    try:
        man = open_trunk(d, idx, cfg)
    except K3Error as exc:
        assert exc.message
        return
    check_accepted(man, idx)
