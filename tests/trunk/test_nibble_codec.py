"""The ``bp-nib`` codec: exact round trips, one answer from every decoder, every refusal.

Three decoders read a ``bp-nib`` window: the compiled one with its SSSE3 join, the compiled
one's portable loop, and NumPy's (used where the module was not built). Each must write the
same bytes for a good window and refuse a damaged one with the same reason, never touching
memory outside the buffers. A compressed ring slot decodes in place (its encoded bytes read
into its own tail), which must give the same bytes and never stage elsewhere.
"""

from __future__ import annotations

import struct
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from k3_storage.plain import PlainStorage
from typer.testing import CliRunner

from k3core.checkpoint.index import CheckpointIndex
from k3core.cli.app import app
from k3core.model.config import load_config
from k3core.testing.faulty_backend import disk_backed_dir
from k3core.trunk import nibble
from k3core.trunk.codec import CodecError, parse_codec
from k3core.trunk.manifest import MANIFEST_NAME, open_trunk
from k3core.trunk.part_readers import CodedPartReader
from k3core.trunk.stream import StreamedTrunk
from k3core.trunk.windows import Window, in_place_offset, linear_bytes

DEMO = Path(__file__).resolve().parents[2] / "demo-model"
runner = CliRunner()


def _decoders() -> list[tuple[str, object]]:
    got: list[tuple[str, object]] = [("numpy", nibble.decode_numpy)]
    native = nibble._native()
    if native is not None:
        got.append(("c-portable", partial(native.decode, vector=0)))
        got.append(("c-vector", partial(native.decode, vector=1)))
    return got


DECODERS = _decoders()


def test_the_compiled_decoder_is_built_here() -> None:
    """`pip install -e .` builds it wherever a C compiler is found (CI has one)."""
    assert nibble.native_available()


def _bf16(values: np.ndarray) -> np.ndarray:
    return (values.astype(np.float32).view(np.uint32) >> 16).astype("<u2").view(np.uint8).copy()


def _cases() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    specials = np.array([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x0001, 0x807F, 0x3F80,
                         0xBF80, 0x7F7F], "<u2")
    return {
        "normal": _bf16(rng.standard_normal(100_003) * 0.02),  # odd element count
        "wide": _bf16(rng.standard_normal(4_096) * np.exp(rng.uniform(-40, 40, 4_096))),
        "uniform-bytes": rng.integers(0, 256, 6_000, dtype=np.uint8),  # nearly all escapes
        "specials": np.tile(specials, 37).view(np.uint8).copy(),
        "one-element": np.array([0x34, 0x12], np.uint8),
        "constant": np.full(2 * 777, 0x3F, np.uint8),
        "33-elements": _bf16(rng.standard_normal(33)),  # one vector step and a tail
    }


@pytest.mark.parametrize("case", list(_cases()))
@pytest.mark.parametrize("decoder", [d[0] for d in DECODERS])
def test_every_decoder_gives_back_the_raw_bytes(case, decoder) -> None:
    raw = _cases()[case]
    enc = nibble.encode(raw)
    m = raw.size // 2
    assert len(enc) == nibble.stored_bytes(m, struct.unpack("<I", enc[16:20])[0])
    out = np.full(raw.size, 0xAA, np.uint8)
    fn = dict(DECODERS)[decoder]
    assert fn(enc, out) == 0
    assert out.tobytes() == raw.tobytes()


def test_bell_shaped_weights_compress_by_nearly_four_thirds() -> None:
    raw = _cases()["normal"]
    enc = nibble.encode(raw)
    (escapes,) = struct.unpack("<I", enc[16:20])
    assert escapes < raw.size // 2 // 1000  # under 0.1 % of the elements
    assert 1.30 < raw.size / len(enc) <= 4 / 3


def test_the_encoding_is_deterministic_and_tables_its_commonest_high_bytes() -> None:
    raw = _cases()["wide"]
    a, b = nibble.encode(raw), nibble.encode(raw.copy())
    assert a == b
    hi = raw.reshape(-1, 2)[:, 1]
    counts = np.bincount(hi, minlength=256)
    table = np.frombuffer(a[:15], np.uint8)
    assert a[15] == 0
    # every tabled byte is at least as common as every byte left to the escapes
    assert counts[table].min() >= np.delete(counts, table).max()


def _good() -> tuple[bytes, int]:
    raw = _cases()["normal"]
    return nibble.encode(raw), raw.size


def _with(enc: bytes, at: int, value: bytes) -> bytes:
    return enc[:at] + value + enc[at + len(value):]


def _damaged() -> dict[str, tuple[bytes, int, int]]:
    enc, n = _good()
    m = n // 2
    (e,) = struct.unpack("<I", enc[16:20])
    assert e >= 3
    idx_at = nibble.stored_bytes(m, e) - 5 * e
    first = struct.unpack("<I", enc[idx_at : idx_at + 4])[0]
    second = struct.unpack("<I", enc[idx_at + 4 : idx_at + 8])[0]
    # elements that are not escapes, for the code check (ascending order kept, so the index
    # checks pass and the code check is what refuses)
    nib = np.frombuffer(enc[20 : 20 + (m + 1) // 2], np.uint8)
    codes = np.stack([nib & 15, nib >> 4], 1).ravel()[:m]
    plain = np.flatnonzero(codes != 15)
    before_second = int(plain[plain < second][0])
    after_first = int(plain[plain > first][0])
    return {
        "odd-output": (enc, n - 1, 1),
        "empty-output": (enc, 0, 1),
        "short": (enc[:19], n, 2),
        "table-15": (_with(enc, 15, b"\x01"), n, 3),
        "count-over-m": (_with(enc, 16, struct.pack("<I", m + 1)), n, 4),
        "count-huge": (_with(enc, 16, b"\xff\xff\xff\xff"), n, 4),
        "cut": (enc[:-1], n, 5),
        "long": (enc + b"\x00", n, 5),
        "count-one-more": (_with(enc, 16, struct.pack("<I", e + 1)), n, 5),
        "index-past-end": (_with(enc, idx_at, struct.pack("<I", m)), n, 6),
        "index-huge": (_with(enc, idx_at, struct.pack("<I", 2**32 - 1)), n, 6),
        "index-repeated": (_with(enc, idx_at + 4, struct.pack("<I", first)), n, 6),
        "index-backwards": (_with(enc, idx_at + 4, struct.pack("<I", 0)), n, 6),
        "first-not-an-escape": (_with(enc, idx_at, struct.pack("<I", before_second)), n, 7),
        "second-not-an-escape": (_with(enc, idx_at + 4, struct.pack("<I", after_first)), n, 7),
    }


@pytest.mark.parametrize("case", list(_damaged()))
@pytest.mark.parametrize("decoder", [d[0] for d in DECODERS])
def test_every_decoder_refuses_a_damaged_window_for_the_same_reason(case, decoder) -> None:
    data, n, code = _damaged()[case]
    guard = np.full(n + 64, 0x5A, np.uint8)
    out = guard[:n]
    assert dict(DECODERS)[decoder](data, out) == code
    assert (guard[n:] == 0x5A).all()  # nothing written past the window


def test_the_codec_turns_a_refusal_into_one_named_codec_error() -> None:
    enc, n = _good()
    with pytest.raises(CodecError, match="bp-nib: its length does not match"):
        parse_codec("bp-nib").decode_into(memoryview(enc[:-3]), np.empty(n, np.uint8), 2)


def test_random_damage_never_escapes_and_the_decoders_agree() -> None:
    enc, n = _good()
    rng = np.random.default_rng(11)
    for _ in range(300):
        data = bytearray(enc)
        for _ in range(int(rng.integers(1, 4))):
            data[int(rng.integers(0, len(data)))] = int(rng.integers(0, 256))
        if rng.random() < 0.2:
            data = data[: int(rng.integers(0, len(data)))]
        results = []
        for _, fn in DECODERS:
            out = np.zeros(n, np.uint8)
            results.append((fn(bytes(data), out), out.tobytes()))
        assert len({r[0] for r in results}) == 1
        if results[0][0] == 0:
            assert len({r[1] for r in results}) == 1


def test_without_the_compiled_module_the_codec_decodes_through_numpy(monkeypatch) -> None:
    raw = _cases()["normal"]
    enc = parse_codec("bp-nib").encode(raw, 2)
    monkeypatch.setattr(nibble, "_native", lambda: None)  # as where setup.py found no compiler
    assert not nibble.native_available()
    out = np.empty(raw.size, np.uint8)
    parse_codec("bp-nib").decode_into(memoryview(enc), out, 2)
    assert out.tobytes() == raw.tobytes()
    with pytest.raises(CodecError, match="escape index is out of range"):
        bad = bytearray(enc)
        at = len(enc) - 5 * struct.unpack("<I", enc[16:20])[0]
        bad[at : at + 4] = struct.pack("<I", raw.size)
        parse_codec("bp-nib").decode_into(memoryview(bytes(bad)), out, 2)


def test_windows_of_other_dtypes_are_left_raw_by_the_pack() -> None:
    raw = np.arange(4000, dtype="<f4").view(np.uint8).copy()
    assert parse_codec("bp-nib").encode(raw, 4) == raw.tobytes()  # not smaller: stored raw


# ---- in place --------------------------------------------------------------------------------
def _table(raw_lens: list[int], stored: list[int]) -> tuple[Window, ...]:
    out, r, s = [], 0, 0
    for a, b in zip(raw_lens, stored, strict=True):
        out.append(Window(r, a, s, b, 2))
        r, s = r + a, s + b
    return tuple(out)


def test_in_place_needs_the_last_windows_room_and_no_more() -> None:
    wins = _table([1 << 20] * 6, [786_452] * 6)
    span = 6 << 20
    last = wins[-1].nbytes
    assert in_place_offset(wins, 0, span) is None  # the last window would overwrite itself
    assert in_place_offset(wins, 0, span + last + 3 * 4096) is not None
    at = in_place_offset(wins, 0, span + last + 3 * 4096)
    assert at is not None and at % 4096 == 0 and at + linear_bytes(wins) <= span + last + 3 * 4096
    for w in wins:  # every window's output ends before its input begins
        assert w.raw_off + w.raw_len <= at + w.off


def test_in_place_with_raw_windows_and_uneven_ratios() -> None:
    rng = np.random.default_rng(3)
    for _ in range(200):
        k = int(rng.integers(1, 12))
        raw_lens = [int(x) for x in rng.integers(1, 300_000, k) * 2]
        stored = [int(rng.integers(1, r + 1)) for r in raw_lens]
        wins = _table(raw_lens, stored)
        span = sum(raw_lens)
        size = span + max(stored) + 3 * 4096
        at = in_place_offset(wins, 0, size)
        assert at is not None  # the documented bound always suffices
        for w in wins:
            assert w.raw_off + w.raw_len <= at + w.off - wins[0].off // 4096 * 4096


@pytest.fixture(scope="module")
def nib_trunk(tmp_path_factory) -> Path:
    out = disk_backed_dir(tmp_path_factory.mktemp("nib")) / "trunk"
    res = runner.invoke(app, ["pack-trunk", str(DEMO), str(out), "--codec", "bp-nib"])
    assert res.exit_code == 0, res.output
    return out


def test_the_demo_trunk_packs_smaller_with_bp_nib(nib_trunk) -> None:
    import json

    doc = json.loads((nib_trunk / MANIFEST_NAME).read_text())
    assert doc["codec"] == "bp-nib"
    raw = sum(lay["span"] for lay in doc["layers"])
    stored = sum(lay["stored"] for lay in doc["layers"])
    assert raw / stored > 1.25


def test_ring_slots_decode_in_place_and_give_the_raw_bytes(nib_trunk, tmp_path) -> None:
    cfg = load_config(DEMO / "config.json")
    raw_dir = tmp_path / "raw"
    res = runner.invoke(app, ["pack-trunk", str(DEMO), str(raw_dir)])
    assert res.exit_code == 0, res.output
    with CheckpointIndex.open(DEMO, PlainStorage()) as idx:
        man = open_trunk(nib_trunk, idx, cfg)
        raw_man = open_trunk(raw_dir, idx, cfg)
    probe = StreamedTrunk(cfg, man, PlainStorage(), sum(lay.nbytes for lay in man.layers),
                          split=True)
    floor = max(u.nbytes for u in probe.units)
    probe.close()
    # one slot, no reader thread: this thread is the only one reading into it
    trunk = StreamedTrunk(cfg, man, PlainStorage(), floor, ring=1, split=True)
    f = PlainStorage().open(man.bin_path)
    try:
        reader = trunk.reader
        assert isinstance(reader, CodedPartReader)
        assert not reader.has_staging()  # the opening staging is gone
        raw_bytes = (raw_dir / "trunk.bin").read_bytes()
        slot = trunk.slots[0].buf
        for part in trunk.units:
            lay = man.layers[part.layer]
            reader.read_part(f, lay, slot, part.start, part.nbytes)
            rl = raw_man.layers[part.layer]
            want = raw_bytes[rl.file_off + part.start : rl.file_off + part.end]
            assert slot[: part.nbytes].tobytes() == want, part
        # every part fit in place: no staging buffer was ever made on this thread
        assert not reader.has_staging()
    finally:
        f.close()
        trunk.close()
