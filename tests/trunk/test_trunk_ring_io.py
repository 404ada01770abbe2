"""A coded ring is read by one thread and decoded by another, and still serves only good bytes.

With a codec and two or more ring slots, the I/O thread (``k3-trunk-io``) reads part after
part into the slots' tails and the reader thread (``k3-trunk-reader``) decodes them in
place: the next part's reads start as soon as a slot is free, while the last one still
decodes. These tests drive :class:`~k3core.trunk.stream.StreamedTrunk` directly over the
trained demo model's trunk packed with ``bp-nib``, ``bp-bits`` and ``bp-zstd``, in chunks of 96 kB so
that every layer is several chunks: the reads really overlap a decode, every served matrix
is the checkpoint's bytes, a read or a decode failing mid-part is that layer's error (the
slot is emptied, the threads live on, a later acquire reads it again), and ``close`` leaves
no thread behind.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
from k3_storage.plain import PlainStorage
from typer.testing import CliRunner

from k3core.api.errors import CheckpointError, StorageError
from k3core.checkpoint.index import CheckpointIndex
from k3core.cli.app import app
from k3core.model.config import load_config
from k3core.testing.faulty_backend import FaultyStorage, disk_backed_dir
from k3core.trunk import read_ahead, windows
from k3core.trunk.manifest import MANIFEST_NAME, open_trunk
from k3core.trunk.stream import StreamedTrunk

DEMO = Path(__file__).resolve().parents[2] / "demo-model"
NAME = "language_model.model.layers.{L}.self_attn.o_proj.weight"
CHUNK = 96 << 10


@pytest.fixture(scope="module", params=["bp-nib", "bp-bits", "bp-zstd"])
def packed(request, tmp_path_factory) -> Path:
    out = disk_backed_dir(tmp_path_factory.mktemp("ringio")) / request.param
    res = CliRunner().invoke(app, ["pack-trunk", str(DEMO), str(out), "--codec", request.param])
    assert res.exit_code == 0, res.output
    assert (out / MANIFEST_NAME).exists()
    return out


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch) -> None:
    whole = windows.chunks
    monkeypatch.setattr(windows, "chunks", lambda wins, limit=CHUNK: whole(wins, limit))


def _open(packed: Path, storage, ring: int = 3) -> tuple[StreamedTrunk, CheckpointIndex, object]:
    cfg = load_config(DEMO / "config.json")
    idx = CheckpointIndex.open(DEMO, PlainStorage())
    man = open_trunk(packed, idx, cfg)
    floor = max(lay.nbytes for lay in man.layers)
    return StreamedTrunk(cfg, man, storage, ring * floor, ring=ring), idx, man


def _walk(tr: StreamedTrunk, layers) -> None:
    for L in layers:
        tr.acquire(L)
        tr.release(L)
    deadline = time.monotonic() + 20  # and let the reads ahead of the walk land
    while any(state == "reading" for _, state in tr.slot_states()):
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _right(tr: StreamedTrunk, idx: CheckpointIndex, L: int) -> None:
    p = tr.acquire(L)
    try:
        assert np.asarray(p["self_attn.o_proj.weight"]).tobytes() == idx.read(NAME.format(L=L)).tobytes()
    finally:
        tr.release(L)


def _trunk_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name in ("k3-trunk-io", "k3-trunk-reader")]


def test_the_next_part_is_read_while_the_last_one_decodes(packed, monkeypatch) -> None:
    """Layer 3's decode is held; the I/O thread meanwhile reads layer 4 into a free slot."""
    faulty = FaultyStorage(PlainStorage())
    tr, idx, man = _open(packed, faulty)
    try:
        assert tr.plan.ring == 3 and tr.has_reader
        _walk(tr, range(tr.stats.n_layers))  # every layer read once (its checksum taken)
        # the walk is past layer 7 (released): the reader wraps around, and the ring comes to
        # hold 0, 1 and 2 (on a busy machine the reader may not have started those reads
        # when the walk's wait for reads in flight ends)
        deadline = time.monotonic() + 20
        while (sorted(L for L, _ in tr.slot_states()) != [0, 1, 2]
               and time.monotonic() < deadline):
            time.sleep(0.01)
        assert sorted(L for L, _ in tr.slot_states()) == [0, 1, 2]
        held, release = threading.Event(), threading.Event()
        real = read_ahead.decode_chunk

        def slow(buf, start, wins, a, b, codec, dest, bin_path, layer):
            if layer == 3 and threading.current_thread().name == "k3-trunk-reader":
                held.set()
                assert release.wait(20)
            yield from real(buf, start, wins, a, b, codec, dest, bin_path, layer)

        monkeypatch.setattr(read_ahead, "decode_chunk", slow)
        lay4 = man.layers[4]
        before = len(faulty.log)
        tr.acquire(1)  # wanted 1, 2, 3: layer 3 is read and its decode held
        assert held.wait(20)
        tr.release(1)  # wanted 2, 3, 4: layer 4 is read while layer 3 still decodes
        deadline = time.monotonic() + 20
        read4 = 0
        while time.monotonic() < deadline:
            read4 = sum(nb for _, off, nb in faulty.log[before:]
                        if lay4.file_off <= off < lay4.file_off + lay4.file_nbytes)
            if read4 >= lay4.file_nbytes - 4096:
                break
            time.sleep(0.01)
        assert read4 >= lay4.file_nbytes - 4096, "layer 4 was not read while layer 3 decoded"
        assert dict(tr.slot_states()).get(3) == "reading"
        release.set()
        for L in (2, 3, 4, 0, 1):
            _right(tr, idx, L)
    finally:
        tr.close()
        idx.close()
    assert not _trunk_threads()


@pytest.mark.parametrize("chunk", [0, 2])
def test_a_read_failing_mid_part_is_that_layers_error(packed, chunk) -> None:
    faulty = FaultyStorage(PlainStorage())
    tr, idx, man = _open(packed, faulty)
    try:
        _walk(tr, range(tr.stats.n_layers))
        lay = man.layers[5]
        cut = windows.chunks(lay.windows)
        at = lay.file_off + (lay.windows[cut[chunk][0]].off // 4096) * 4096
        if chunk:  # a later chunk's read begins where the last one ended
            prev = lay.windows[cut[chunk - 1][1] - 1]
            at = max(at, lay.file_off + -(-(prev.off + prev.nbytes) // 4096) * 4096)
        faulty.fail_offsets.add(at)
        _walk(tr, range(5))
        with pytest.raises(StorageError, match="trunk layer 5: .*injected read failure"):
            tr.acquire(5)
        assert tr.held_layers() == [] and all(L != 5 for L, _ in tr.slot_states())
        assert len(_trunk_threads()) == 2  # the failure is the layer's, not the threads'
        faulty.fail_offsets.clear()
        _right(tr, idx, 5)
        _walk(tr, range(6, tr.stats.n_layers))
        for L in range(tr.stats.n_layers):
            _right(tr, idx, L)
    finally:
        tr.close()
        idx.close()
    assert not _trunk_threads()


def test_a_window_failing_to_decode_is_that_layers_error(packed, monkeypatch) -> None:
    tr, idx, _ = _open(packed, PlainStorage())
    try:
        _walk(tr, range(tr.stats.n_layers))
        real = read_ahead.decode_chunk
        broken = {"on": True}

        def bad(buf, start, wins, a, b, codec, dest, bin_path, layer):
            if layer == 4 and broken["on"] and a > 0:
                raise CheckpointError(f"{bin_path}: layer {layer} window {a} does not decode")
            yield from real(buf, start, wins, a, b, codec, dest, bin_path, layer)

        monkeypatch.setattr(read_ahead, "decode_chunk", bad)
        _walk(tr, range(4))
        with pytest.raises(CheckpointError, match="layer 4 window"):
            tr.acquire(4)
        assert all(L != 4 for L, _ in tr.slot_states()) and len(_trunk_threads()) == 2
        broken["on"] = False
        _right(tr, idx, 4)
    finally:
        tr.close()
        idx.close()
    assert not _trunk_threads()


def test_close_with_a_part_in_flight_leaves_no_thread(packed) -> None:
    faulty = FaultyStorage(PlainStorage())
    tr, idx, man = _open(packed, faulty)
    gate = threading.Event()
    try:
        _walk(tr, range(tr.stats.n_layers))
        lay = man.layers[3]
        faulty.gates[lay.file_off] = gate  # layer 3's first chunk waits in the device
        tr.acquire(1)  # wanted 1, 2, 3: the ring holds 0, 1, 2, so layer 3 is read
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(
                off == lay.file_off for _, off, _ in faulty.log[-8:]):
            time.sleep(0.01)
        assert any(off == lay.file_off for _, off, _ in faulty.log), "layer 3 was never read"
    finally:
        t0 = time.monotonic()
        closer = threading.Thread(target=tr.close)
        closer.start()
        time.sleep(0.2)
        gate.set()  # the device answers; the I/O thread sees the stop before its next chunk
        closer.join(10)
        idx.close()
    assert not closer.is_alive() and time.monotonic() - t0 < 8
    deadline = time.monotonic() + 5
    while _trunk_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _trunk_threads()


def test_the_run_says_which_thread_reads_and_which_decodes(packed) -> None:
    cfg = load_config(DEMO / "config.json")
    with CheckpointIndex.open(DEMO, PlainStorage()) as idx:
        floor = max(lay.nbytes for lay in open_trunk(packed, idx, cfg).layers)
    res = CliRunner().invoke(app, ["run", str(DEMO), "--ids", "3,7,11", "--gen", "2",
                                   "--trunk", str(packed), "--trunk-gb", f"{2 * floor / 1e9:.9f}",
                                   "--trunk-ring", "2", "--storage", "plain"])
    assert res.exit_code == 0, res.output
    mode = next(line for line in res.output.splitlines() if line.startswith("read mode"))
    assert "coded windows" in mode and "an I/O thread reads ahead, the reader thread decodes" in mode
