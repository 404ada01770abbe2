"""The ``bp-bits`` codec: exact round trips at every width, one answer from every decoder,
every refusal.

Four decoders read a ``bp-bits`` window: the compiled one's AVX-512 join, its AVX2 join, its
portable loop, and NumPy's (used where the module was not built). Each must write the same
bytes for a good window and refuse a damaged one with the same reason, never touching memory
outside the buffers. The joins this CPU lacks are left out here (the decoder never runs
them, whatever it is asked); the tests name which ran.
"""

from __future__ import annotations

import json
import struct
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from k3core.cli.app import app
from k3core.testing.faulty_backend import disk_backed_dir
from k3core.trunk import bitcode, nibble
from k3core.trunk.codec import CodecError, parse_codec
from k3core.trunk.manifest import MANIFEST_NAME

DEMO = Path(__file__).resolve().parents[2] / "demo-model"
runner = CliRunner()


def _decoders() -> list[tuple[str, object]]:
    got: list[tuple[str, object]] = [("numpy", bitcode.decode_numpy)]
    native = bitcode._native()
    names = {0: "c-portable", 1: "c-avx2", 2: "c-avx512"}
    for level in range(bitcode.native_vector() + 1):
        assert native is not None
        got.append((names[level], partial(native.decode, vector=level)))
    return got


DECODERS = _decoders()


def test_the_compiled_decoder_is_built_here() -> None:
    """`pip install -e .` builds it wherever a C compiler is found (CI has one)."""
    assert bitcode.native_available()
    assert bitcode.native_vector() >= 0


def _bf16(values: np.ndarray) -> np.ndarray:
    return (values.astype(np.float32).view(np.uint32) >> 16).astype("<u2").view(np.uint8).copy()


def _with_width(width: int, m: int, seed: int) -> np.ndarray:
    """Elements whose high bytes come mostly from ``2^width - 1`` values, with rare others."""
    rng = np.random.default_rng(seed)
    common = rng.choice(256, (1 << width) - 1, replace=False)
    hi = common[rng.integers(0, common.size, m)]
    rare = rng.random(m) < 0.01
    hi[rare] = rng.integers(0, 256, int(rare.sum()))
    out = np.empty((m, 2), np.uint8)
    out[:, 0] = rng.integers(0, 256, m)
    out[:, 1] = hi
    return out.reshape(-1)


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
        "63-elements": _bf16(rng.standard_normal(63)),
        "64-elements": _bf16(rng.standard_normal(64)),  # one whole group, no tail
        "65-elements": _bf16(rng.standard_normal(65)),  # a group and a one-element tail
        "width-2": _with_width(2, 5_000, 1),
        "width-3": _with_width(3, 5_000, 2),
        "width-4": _with_width(4, 5_000, 3),
        "all-escapes-in-a-group": np.tile(np.array([0x00, 0x3C, 0x00, 0x3C, 0x11, 0x80], np.uint8),
                                         64),
    }


@pytest.mark.parametrize("case", list(_cases()))
@pytest.mark.parametrize("decoder", [d[0] for d in DECODERS])
def test_every_decoder_gives_back_the_raw_bytes(case, decoder) -> None:
    raw = _cases()[case]
    enc = bitcode.encode(raw)
    m = raw.size // 2
    assert len(enc) == bitcode.stored_bytes(m, enc[0], struct.unpack("<I", enc[4:8])[0])
    out = np.full(raw.size, 0xAA, np.uint8)
    fn = dict(DECODERS)[decoder]
    assert fn(enc, out) == 0
    assert out.tobytes() == raw.tobytes()


@pytest.mark.parametrize("width", bitcode.WIDTHS)
def test_each_window_takes_the_width_that_stores_it_smallest(width) -> None:
    raw = _with_width(width, 5_000, width)
    enc = bitcode.encode(raw)
    assert enc[0] == width
    hi = raw.reshape(-1, 2)[:, 1]
    counts = np.sort(np.bincount(hi, minlength=256))[::-1]
    m = hi.size
    sizes = {b: bitcode.stored_bytes(m, b, m - int(counts[: (1 << b) - 1].sum()))
             for b in bitcode.WIDTHS}
    assert len(enc) == min(sizes.values()) == sizes[width]


def test_bell_shaped_weights_take_three_bits_and_beat_bp_nib() -> None:
    raw = _cases()["normal"]
    enc = bitcode.encode(raw)
    assert enc[0] == 3
    assert len(enc) < 0.96 * len(nibble.encode(raw))
    assert raw.size / len(enc) > 1.38


def test_the_encoding_is_deterministic_and_tables_its_commonest_high_bytes() -> None:
    raw = _cases()["normal"]
    a, b = bitcode.encode(raw), bitcode.encode(raw.copy())
    assert a == b
    hi = raw.reshape(-1, 2)[:, 1]
    counts = np.bincount(hi, minlength=256)
    k = (1 << a[0]) - 1
    table = np.frombuffer(a[8 : 8 + k], np.uint8)
    assert not any(a[8 + k : 24])
    # every tabled byte is at least as common as every byte left to the escapes
    assert counts[table].min() >= np.delete(counts, table).max()


def _good() -> tuple[bytes, int]:
    raw = _cases()["normal"]  # 100,003 elements: the last group holds 35
    return bitcode.encode(raw), raw.size


def _with(enc: bytes, at: int, value: bytes) -> bytes:
    return enc[:at] + value + enc[at + len(value):]


def _flip(enc: bytes, byte: int, bit: int) -> bytes:
    return _with(enc, byte, bytes([enc[byte] ^ (1 << bit)]))


def _damaged() -> dict[str, tuple[bytes, int, int]]:
    enc, n = _good()
    m = n // 2
    width = enc[0]
    assert width == 3
    (e,) = struct.unpack("<I", enc[4:8])
    groups = -(-m // 64)
    last = 24 + 8 * width * (groups - 1)  # the last group's first plane
    rest = m - 64 * (groups - 1)
    # an element of the first group that is not an escape: setting all its code bits makes
    # one escape more; clearing a bit of an escape makes one fewer
    planes = np.frombuffer(enc[24 : 24 + 8 * width], "<u8")
    escapes = int(np.bitwise_and.reduce(planes))
    plain = next(j for j in range(64) if not escapes >> j & 1)
    one_more = bytearray(enc)
    for p in range(width):
        one_more[24 + 8 * p + plain // 8] |= 1 << (plain % 8)
    esc = next(j for j in range(64 * groups) if all(
        enc[24 + 8 * (width * (j // 64) + p) + (j % 64) // 8] >> (j % 8) & 1 for p in range(width)))
    g, j = divmod(esc, 64)
    return {
        "odd-output": (enc, n - 1, 1),
        "empty-output": (enc, 0, 1),
        "short": (enc[:23], n, 2),
        "width-1": (_with(enc, 0, b"\x01"), n, 3),
        "width-5": (_with(enc, 0, b"\x05"), n, 3),
        "reserved": (_with(enc, 2, b"\x01"), n, 3),
        "table-escape-entry": (_with(enc, 8 + (1 << width) - 1, b"\x01"), n, 4),
        "table-last-entry": (_with(enc, 23, b"\x7f"), n, 4),
        "count-over-m": (_with(enc, 4, struct.pack("<I", m + 1)), n, 5),
        "count-huge": (_with(enc, 4, b"\xff\xff\xff\xff"), n, 5),
        "cut": (enc[:-1], n, 6),
        "long": (enc + b"\x00", n, 6),
        "count-one-more": (_with(enc, 4, struct.pack("<I", e + 1)), n, 6),
        "width-narrower": (_with(enc, 0, bytes([width - 1])), n, 4),  # its table is too long
        "width-wider": (_with(enc, 0, bytes([width + 1])), n, 6),
        "padding-bit": (_flip(enc, last + 7, 7), n, 7),
        "padding-bit-last-plane": (_flip(enc, last + 8 * (width - 1) + rest // 8 + 1, 0), n, 7),
        "one-escape-more": (bytes(one_more), n, 8),
        "one-escape-fewer": (_flip(enc, 24 + 8 * width * g + j // 8, j % 8), n, 8),
        "no-room-for-escapes": (_with(enc[: len(enc) - e], 4, struct.pack("<I", 0)), n, 8),
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
    with pytest.raises(CodecError, match="bp-bits: its length does not match"):
        parse_codec("bp-bits").decode_into(memoryview(enc[:-3]), np.empty(n, np.uint8), 2)


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


def test_the_escape_stream_is_read_exactly_to_its_end() -> None:
    """The last escape byte sits at the buffer's very end: an expand that read a byte more
    would read past it (the decoders run on a buffer holding nothing after the window)."""
    raw = _cases()["width-3"]
    enc = bitcode.encode(raw)
    assert struct.unpack("<I", enc[4:8])[0] > 0
    for _, fn in DECODERS:
        out = np.empty(raw.size, np.uint8)
        assert fn(np.frombuffer(enc, np.uint8).copy(), out) == 0
        assert out.tobytes() == raw.tobytes()


def test_without_the_compiled_module_the_codec_decodes_through_numpy(monkeypatch) -> None:
    raw = _cases()["normal"]
    enc = parse_codec("bp-bits").encode(raw, 2)
    monkeypatch.setattr(bitcode, "_native", lambda: None)  # as where setup.py found no compiler
    assert not bitcode.native_available()
    assert bitcode.native_vector() == -1
    out = np.empty(raw.size, np.uint8)
    parse_codec("bp-bits").decode_into(memoryview(enc), out, 2)
    assert out.tobytes() == raw.tobytes()
    with pytest.raises(CodecError, match="different number of escapes"):
        parse_codec("bp-bits").decode_into(memoryview(_damaged()["one-escape-more"][0]), out, 2)


def test_windows_of_other_dtypes_are_left_raw_by_the_pack() -> None:
    raw = np.arange(4000, dtype="<f4").view(np.uint8).copy()
    assert parse_codec("bp-bits").encode(raw, 4) == raw.tobytes()  # not smaller: stored raw


def test_the_demo_trunk_packs_smaller_with_bp_bits_than_with_bp_nib(tmp_path_factory) -> None:
    base = disk_backed_dir(tmp_path_factory.mktemp("bits"))
    sizes = {}
    for codec in ("bp-nib", "bp-bits"):
        res = runner.invoke(app, ["pack-trunk", str(DEMO), str(base / codec), "--codec", codec])
        assert res.exit_code == 0, res.output
        doc = json.loads((base / codec / MANIFEST_NAME).read_text())
        assert doc["codec"] == codec
        sizes[codec] = sum(lay["stored"] for lay in doc["layers"])
    assert sizes["bp-bits"] < sizes["bp-nib"]
