"""A trunk packed with a codec gives back the same bits, and a damaged one is refused.

The trained demo model's trunk (real bf16 statistics, so its windows really compress) is
packed raw and with each codec; every available storage backend at every budget (all
pinned, the floor with one and two ring slots, half) must give the resident run's ids and
step-0 logits bytes. A flipped byte inside an encoded window, a truncated ``trunk.bin``, an
unknown codec and a window table that does not describe the layer are each refused with
one ``k3: error:`` line and exit 1; an unknown ``--codec`` is exit 2.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
from k3_storage.plain import PlainStorage
from thin import thinned
from typer.testing import CliRunner

from k3core.api.errors import CheckpointError, UsageError
from k3core.checkpoint.index import CheckpointIndex
from k3core.cli.app import app
from k3core.model.config import load_config
from k3core.testing.faulty_backend import available_storage, disk_backed_dir
from k3core.testing.fixtures import fixtures_dir
from k3core.trunk.codec import NAMES, join_planes, parse_codec, split_planes
from k3core.trunk.manifest import DATA_NAME, MANIFEST_NAME, open_trunk
from k3core.trunk.windows import WINDOW_BYTES, plan_windows

runner = CliRunner()
DEMO = Path(__file__).resolve().parents[2] / "demo-model"
PROMPT = "3,7,11,5"
GEN = "3"
CODECS = ["bp-zstd", "zstd:3", "lz4", "bp-lz4", "bp-nib", "bp-bits"]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return disk_backed_dir(tmp_path_factory.mktemp("codec"))


def _pack(work: Path, codec: str) -> Path:
    out = work / f"trunk-{codec.replace(':', '-')}"
    if not (out / MANIFEST_NAME).exists():
        res = runner.invoke(app, ["pack-trunk", str(DEMO), str(out), "--codec", codec])
        assert res.exit_code == 0, res.output
    return out


@pytest.fixture(scope="module")
def raw(work) -> Path:
    return _pack(work, "none")


@pytest.fixture(scope="module")
def coded(work) -> Path:
    return _pack(work, "bp-zstd")


@pytest.fixture(scope="module")
def sizes(raw) -> list[int]:
    cfg = load_config(DEMO / "config.json")
    with CheckpointIndex.open(DEMO, PlainStorage()) as idx:
        return [lay.nbytes for lay in open_trunk(raw, idx, cfg).layers]


def _run(work: Path, tag: str, *extra: str) -> tuple[str, bytes]:
    logits = work / f"logits-{tag}.f32"
    res = runner.invoke(app, ["run", str(DEMO), "--ids", PROMPT, "--gen", GEN, "--incremental",
                              "--dump-logits", str(logits), *extra])
    assert res.exit_code == 0, res.output
    ids = next(line for line in res.output.splitlines() if line.startswith("generated ids:"))
    return ids, logits.read_bytes()


@pytest.fixture(scope="module")
def resident(work) -> tuple[str, bytes]:
    return _run(work, "resident")


def _budgets(sizes: list[int]) -> dict[str, tuple[float, int]]:
    floor, total = max(sizes), sum(sizes)
    return {"floor-ring1": (floor / 1e9, 1), "floor-ring2": (2 * floor / 1e9, 2),
            "half": ((total // 2) / 1e9, 2), "all-pinned": (total / 1e9, 2)}


# ---- the codecs themselves ------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("itemsize", [1, 2, 4])
@pytest.mark.parametrize("kind", ["weights", "patterned"])
def test_every_codec_gives_back_the_same_bytes(name, itemsize, kind) -> None:
    rng = np.random.default_rng(itemsize)
    bf16 = (rng.standard_normal(40_000).astype(np.float32).view(np.uint32) >> 16).astype("<u2")
    if kind == "patterned":  # a low plane that compresses: stored encoded, not raw
        bf16 = (np.arange(40_000) % 97 * 3 + 0x3F00).astype("<u2")
    raw = bf16.view(np.uint8)[: 80_000 // itemsize * itemsize].copy()
    codec = parse_codec(name)
    enc = codec.encode(raw, itemsize)
    out = np.full(raw.size, 0xAA, np.uint8)
    codec.decode_into(memoryview(enc), out, itemsize)
    assert out.tobytes() == raw.tobytes()


def test_byte_planes_round_trip_and_put_exponents_first() -> None:
    raw = np.arange(512, dtype="<u2").view(np.uint8).copy()
    planes = split_planes(raw)
    assert planes[:512].tobytes() == (np.arange(512, dtype="<u2") >> 8).astype(np.uint8).tobytes()
    out = np.empty_like(raw)
    join_planes(planes[:512], planes[512:], out)
    assert out.tobytes() == raw.tobytes()


@pytest.mark.parametrize("spec", ["gzip", "zstd:x", "zstd:99", "lz4:-1", "bp-zstd:30"])
def test_unknown_codec_or_level_is_a_usage_error(spec) -> None:
    with pytest.raises(UsageError, match="--codec"):
        parse_codec(spec)


def test_pack_with_an_unknown_codec_is_exit_2_and_writes_nothing(work) -> None:
    out = work / "never"
    res = runner.invoke(app, ["pack-trunk", str(DEMO), str(out), "--codec", "brotli"])
    assert res.exit_code == 2
    assert "unknown codec" in res.output and "Traceback" not in res.output
    assert not out.exists()


def test_windows_lie_inside_one_tensor_and_tile_the_run() -> None:
    tensors = [(0, 10, 2), (10, 3 * WINDOW_BYTES + 6, 2), (3 * WINDOW_BYTES + 16, 8, 4)]
    wins = plan_windows(tensors)
    assert sum(n for _, n, _ in wins) == 3 * WINDOW_BYTES + 24
    assert [a for a, _, _ in wins] == [0, 10, 10 + WINDOW_BYTES, 10 + 2 * WINDOW_BYTES,
                                       10 + 3 * WINDOW_BYTES, 3 * WINDOW_BYTES + 16]
    assert all(n <= WINDOW_BYTES for _, n, _ in wins)


# ---- packing ------------------------------------------------------------------------------
def test_the_demo_trunk_compresses_and_keeps_the_raw_checksums(raw, coded) -> None:
    r = json.loads((raw / MANIFEST_NAME).read_text())
    c = json.loads((coded / MANIFEST_NAME).read_text())
    assert c["version"] == 2 and c["codec"] == "bp-zstd" and "codec" not in r
    assert (coded / DATA_NAME).stat().st_size == c["total_bytes"] < 0.85 * r["total_bytes"]
    for a, b in zip(r["layers"], c["layers"], strict=True):
        assert (a["checksum"], a["span"], a["nbytes"], a["tensors"]) == (
            b["checksum"], b["span"], b["nbytes"], b["tensors"])
        assert b["file_off"] % 4096 == 0 and b["file_nbytes"] % 4096 == 0
        assert sum(w[0] for w in b["windows"]) == b["span"]
        assert sum(w[1] for w in b["windows"]) == b["stored"] <= b["file_nbytes"]
        assert any(w[1] < w[0] for w in b["windows"])  # real windows are encoded


# ---- the same bits ------------------------------------------------------------------------
@pytest.mark.parametrize("storage", thinned(available_storage(), ("direct",)))
def test_same_ids_and_logits_at_every_budget(coded, work, sizes, resident, storage) -> None:
    for name, (gb, ring) in _budgets(sizes).items():
        got = _run(work, f"{storage}-{name}", "--storage", storage, "--trunk", str(coded),
                   "--trunk-gb", f"{gb:.9f}", "--trunk-ring", str(ring))
        assert got[0] == resident[0], (name, got[0])
        assert got[1] == resident[1], f"{storage} {name}: step-0 logits differ"


@pytest.mark.parametrize("codec", CODECS[1:])
def test_every_codec_streams_the_same_bits(work, sizes, resident, codec) -> None:
    trunk = _pack(work, codec)
    floor = max(sizes)
    for ring in (1, 2):
        got = _run(work, f"{codec}-{ring}", "--trunk", str(trunk), "--trunk-gb",
                   f"{ring * floor / 1e9:.9f}", "--trunk-ring", str(ring))
        assert got == resident, (codec, ring)


def test_ultra_low_memory_from_a_coded_trunk_is_bit_identical(coded, work, sizes, resident):
    got = _run(work, "ultra", "--trunk", str(coded), "--trunk-gb", f"{2 * max(sizes) / 1e9:.9f}",
               "--ultra-low-memory")
    assert got == resident


def test_verify_trunk_decodes_every_window(coded, work, resident) -> None:
    assert _run(work, "verify", "--trunk", str(coded), "--verify-trunk") == resident


def test_run_reports_codec_and_bytes(coded, work, sizes) -> None:
    out = work / "report.json"
    res = runner.invoke(app, ["run", str(DEMO), "--ids", PROMPT, "--gen", GEN, "--incremental",
                              "--trunk", str(coded), "--trunk-gb", f"{max(sizes) / 1e9:.9f}",
                              "--trunk-ring", "1", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "bp-zstd-coded windows" in res.output and "codec bp-zstd: decoded" in res.output
    doc = json.loads(out.read_text())
    assert doc["trunk_codec"] == "bp-zstd"
    assert doc["trunk_decoded_bytes"] > doc["trunk_ring_bytes_read"] > 0


# ---- refusals -----------------------------------------------------------------------------
def _copy(coded: Path, work: Path, tag: str) -> Path:
    dst = work / f"bad-{tag}"
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(coded, dst)
    return dst


def _refused(trunk: Path, *extra: str) -> str:
    res = runner.invoke(app, ["run", str(DEMO), "--ids", PROMPT, "--gen", GEN, "--incremental",
                              "--trunk", str(trunk), *extra])
    assert res.exit_code == 1, res.output
    assert "Traceback" not in res.output and "generated ids:" not in res.output
    errors = [line for line in res.output.splitlines() if line.startswith("k3: error:")]
    assert len(errors) == 1, res.output
    return errors[0]


def _encoded_window(doc: dict, layer: int) -> tuple[int, int]:
    """The file offset of the middle of layer ``layer``'s largest encoded window."""
    lay = doc["layers"][layer]
    off, best = 0, (0, 0)
    for rl, sl in lay["windows"]:
        if sl < rl and sl > best[1]:
            best = (off, sl)
        off += sl
    assert best[1] > 0
    return lay["file_off"] + best[0] + best[1] // 2, best[1]


@pytest.mark.parametrize("storage", thinned(available_storage(), ("direct", "mmap")))
@pytest.mark.parametrize("where", ["all-pinned", "floor-ring1", "floor-ring2"])
def test_a_flipped_byte_in_a_window_is_refused(coded, work, sizes, storage, where) -> None:
    bad = _copy(coded, work, f"flip-{storage}-{where}")
    doc = json.loads((bad / MANIFEST_NAME).read_text())
    pos, _ = _encoded_window(doc, 3)
    with open(bad / DATA_NAME, "r+b") as fh:
        fh.seek(pos)
        b = fh.read(1)
        fh.seek(pos)
        fh.write(bytes([b[0] ^ 0x5A]))
    gb, ring = _budgets(sizes)[where]
    line = _refused(bad, "--storage", storage, "--trunk-gb", f"{gb:.9f}", "--trunk-ring",
                    str(ring))
    assert "layer 3" in line and ("checksum" in line or "does not decode" in line), line


def test_a_window_that_does_not_decode_names_layer_and_window(coded, work) -> None:
    bad = _copy(coded, work, "garbage")
    doc = json.loads((bad / MANIFEST_NAME).read_text())
    pos, n = _encoded_window(doc, 2)
    with open(bad / DATA_NAME, "r+b") as fh:
        fh.seek(pos - n // 2)
        fh.write(bytes(n))  # zeros: not a zstd frame at all
    line = _refused(bad)
    assert "layer 2 window" in line and "does not decode" in line, line


def test_a_truncated_trunk_bin_is_refused(coded, work) -> None:
    bad = _copy(coded, work, "short")
    with open(bad / DATA_NAME, "r+b") as fh:
        fh.truncate((bad / DATA_NAME).stat().st_size - 4096)
    assert "truncated" in _refused(bad)


def _edit(coded: Path, work: Path, tag: str, change) -> Path:
    bad = _copy(coded, work, tag)
    doc = json.loads((bad / MANIFEST_NAME).read_text())
    change(doc)
    (bad / MANIFEST_NAME).write_text(json.dumps(doc))
    return bad


def test_an_unknown_codec_in_the_manifest_is_refused_by_name(coded, work) -> None:
    bad = _edit(coded, work, "codec", lambda d: d.update(codec="brotli-9"))
    line = _refused(bad)
    assert "brotli-9" in line and "codec" in line, line


def _shift_window(d: dict) -> None:
    w = d["layers"][1]["windows"]
    w[0][0] += 1
    w[1][0] -= 1


@pytest.mark.parametrize("tag,change,words", [
    ("version1", lambda d: d.update(version=1), "no codec"),
    ("nowin", lambda d: d["layers"][1].pop("windows"), "windows must be"),
    ("span", lambda d: d["layers"][1]["windows"].pop(), "not the span"),
    ("straddle", _shift_window, "inside one tensor"),
    ("stored", lambda d: d["layers"][1].update(stored=d["layers"][1]["stored"] + 1), "stored"),
    ("grow", lambda d: d["layers"][1]["windows"][0].__setitem__(1, 10**9), "stored_len"),
])
def test_a_window_table_that_does_not_fit_is_refused(coded, work, tag, change, words) -> None:
    line = _refused(_edit(coded, work, tag, change))
    assert words in line, line


def test_open_trunk_refuses_with_checkpoint_error(coded, work) -> None:
    bad = _edit(coded, work, "api", lambda d: d.update(codec="xz"))
    cfg = load_config(DEMO / "config.json")
    with CheckpointIndex.open(DEMO, PlainStorage()) as idx, pytest.raises(CheckpointError,
                                                                           match="'xz'"):
        open_trunk(bad, idx, cfg)


# ---- the measurement ----------------------------------------------------------------------
def test_bench_codec_measures_real_format_bytes() -> None:
    res = runner.invoke(app, ["bench", "codec", str(fixtures_dir() / "tiny-released"),
                              "--codecs", "none,bp-zstd,lz4", "--repeat", "1", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["what"].startswith("the trunk runs") and doc["bf16_share"] > 0.5
    got = {r["codec"]: r for r in doc["results"]}
    assert set(got) == {"none", "bp-zstd:0", "lz4:0"}
    assert got["none"]["ratio"] == 1.0
    assert got["bp-zstd:0"]["ratio"] > 1.2 and got["bp-zstd:0"]["decode_gb_s"] > 0


def test_bench_codec_refuses_a_non_directory(tmp_path) -> None:
    res = runner.invoke(app, ["bench", "codec", str(tmp_path / "nope"), "--codecs", "lz4"])
    assert res.exit_code == 2 and "not a directory" in res.output


@pytest.mark.parametrize("name", NAMES[1:])
def test_a_cut_or_bitten_window_is_a_codec_error_never_a_wrong_size(name) -> None:
    from k3core.trunk.codec import CodecError

    raw = (np.arange(20_000) % 251).astype("<u2").view(np.uint8).copy()
    codec = parse_codec(name)
    enc = codec.encode(raw, 2)
    out = np.empty(raw.size, np.uint8)
    for bad in (enc[: len(enc) // 2], b"", b"\xff" * 8, enc + b"\x00" * 64):
        try:
            codec.decode_into(memoryview(bad), out, 2)
        except CodecError:
            continue
        # it decoded to the right size (wrong bytes are the CRC-32's to catch); any other
        # exception escaping here would reach the user as a traceback


# ---- failed reads and the prefetch thread -------------------------------------------------
@pytest.mark.parametrize("ring", [1, 2])
def test_a_failed_window_read_is_raised_and_never_served(coded, sizes, ring) -> None:
    from k3core.api.errors import StorageError
    from k3core.testing.faulty_backend import FaultyStorage
    from k3core.trunk.stream import StreamedTrunk

    cfg = load_config(DEMO / "config.json")
    with CheckpointIndex.open(DEMO, PlainStorage()) as idx:
        man = open_trunk(coded, idx, cfg)
        faulty = FaultyStorage(PlainStorage())
        faulty.fail_offsets.add(man.layers[5].file_off)
        tr = StreamedTrunk(cfg, man, faulty, ring * max(sizes), ring=ring)
        try:
            for L in range(5):
                tr.acquire(L)
                tr.release(L)
            with pytest.raises(StorageError, match="trunk layer 5: .*injected read failure"):
                tr.acquire(5)
            assert tr.held_layers() == [] and all(s != 5 for s, _ in tr.slot_states())
            faulty.fail_offsets.clear()  # the device recovers: the layer is read again, whole
            p5 = tr.acquire(5)
            name = "language_model.model.layers.5.self_attn.o_proj.weight"
            got = p5["self_attn.o_proj.weight"]
            assert np.asarray(got).tobytes() == idx.read(name).tobytes()
            tr.release(5)
        finally:
            tr.close()


def test_the_prefetcher_hands_back_results_and_errors_and_stops() -> None:
    import threading

    from k3core.api.daemon_executor import DaemonExecutor

    p = DaemonExecutor("k3-trunk-prefetch")
    assert p.submit(lambda a, b: a + b, 2, 3).result(5) == 5
    boom = p.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        boom.result(5)
    t = next(t for t in threading.enumerate() if t.name == "k3-trunk-prefetch")
    assert t.daemon  # a read stuck in the kernel never keeps the process alive
    p.shutdown()
    assert not t.is_alive()
    with pytest.raises(RuntimeError):
        p.submit(lambda: None)


# ---- a layer read in many chunks --------------------------------------------------------------
def _small_chunks(monkeypatch, limit: int = 96 << 10) -> None:
    """Chunks of ``limit`` stored bytes: every layer of the demo is several chunks, so the
    ring's in-place reads take the one-job chunk reader (``Landing``) and the pinned
    layers the two-halves staging."""
    from k3core.trunk import windows

    whole = windows.chunks
    monkeypatch.setattr(windows, "chunks", lambda wins, limit_=limit: whole(wins, limit_))


@pytest.mark.parametrize("codec", thinned(["bp-nib", "bp-bits", "bp-zstd"], ("bp-bits",)))
def test_layers_read_in_many_chunks_give_the_same_bits(work, sizes, resident, codec, monkeypatch):
    _small_chunks(monkeypatch)
    trunk = _pack(work, codec)
    for name, (gb, ring) in _budgets(sizes).items():
        got = _run(work, f"chunks-{codec}-{name}", "--trunk", str(trunk), "--trunk-gb", f"{gb:.9f}",
                   "--trunk-ring", str(ring))
        assert got == resident, (codec, name)


#: the threads that read a coded layer's chunks ahead: the ring's I/O thread, and the
#: prefetch thread beside it in a layer's first read (k3core/trunk/read_ahead.py)
CHUNK_THREADS = ("k3-trunk-prefetch", "k3-trunk-io")


@pytest.mark.parametrize("nth", [2, 5, 9])
def test_a_read_failing_mid_layer_is_refused_not_served(coded, work, sizes, monkeypatch, nth):
    """A chunk read that fails after a layer's first chunk (on the chunk reader's thread) is
    the run's error: exit 1, one message naming the trunk layer, no hang, nothing served."""
    from k3_storage.plain import PlainFile

    from k3core.api.errors import StorageError

    _small_chunks(monkeypatch)
    calls = {"n": 0}
    real = PlainFile.read_into

    def flaky(self, offset, out):  # the nth chunk read on a chunk reader's thread fails
        if self.path.name == "trunk.bin" and threading.current_thread().name in CHUNK_THREADS:
            calls["n"] += 1
            if calls["n"] == nth:
                raise StorageError(f"{self.path}: injected read failure")
        return real(self, offset, out)

    monkeypatch.setattr(PlainFile, "read_into", flaky)
    msg = _refused(coded, "--storage", "plain", "--trunk-gb", f"{2 * max(sizes) / 1e9:.9f}",
                   "--trunk-ring", "2")
    assert calls["n"] >= nth
    assert "trunk layer" in msg and "injected read failure" in msg, msg
    assert not [t for t in threading.enumerate() if t.name in CHUNK_THREADS]
