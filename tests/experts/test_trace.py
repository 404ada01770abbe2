"""Trace files: round trip, every refusal, atomic writes, the recorder, and a fuzz of the reader."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k3core.api.errors import Exit, K3Error, OutputError
from k3core.experts import trace as trace_mod
from k3core.experts.trace import (
    HIST_NAME,
    TRACE_NAME,
    TraceError,
    TraceRecorder,
    histogram,
    parse_trace_bytes,
    read_hist,
    read_trace,
    trace_keys,
    write_trace,
)

PAIRS = np.array([[1, 5], [1, 7], [2, 5], [1, 5], [92, 895]], dtype=np.int32)


def test_round_trip(tmp_path) -> None:
    tpath, hpath = write_trace(tmp_path, PAIRS, n_layers=92, n_experts=896)
    assert (tpath.name, hpath.name) == (TRACE_NAME, HIST_NAME)
    assert tpath.read_bytes() == PAIRS.astype("<i4").tobytes()  # little-endian, no header
    back = read_trace(tpath, n_layers=92, n_experts=896)
    assert back.dtype == np.int32 and back.shape == (5, 2)
    assert np.array_equal(back, PAIRS)
    doc = json.loads(hpath.read_text())
    assert doc == {
        "n_layers": 92,
        "n_experts": 896,
        "counts": {"1,5": 2, "1,7": 1, "2,5": 1, "92,895": 1},
    }
    h = read_hist(hpath)
    assert h["counts"] == {(1, 5): 2, (1, 7): 1, (2, 5): 1, (92, 895): 1}
    assert h["counts"] == histogram(PAIRS)
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_keys() -> None:
    assert trace_keys(PAIRS).tolist()[:2] == [(1 << 20) | 5, (1 << 20) | 7]


def test_shipped_trace_reads() -> None:
    from k3core.testing.fixtures import fixtures_dir

    pairs = read_trace(fixtures_dir() / "expert_trace.bin", n_layers=92, n_experts=896)
    assert pairs.shape == (100_096, 2)
    assert len(np.unique(trace_keys(pairs))) == 10_010


def _write(tmp_path, data: bytes, name: str = "t.bin"):
    p = tmp_path / name
    p.write_bytes(data)
    return p


@pytest.mark.parametrize(
    ("data", "kwargs", "message"),
    [
        (b"", {}, "empty"),
        (np.array([1, 2, 3], "<i4").tobytes(), {}, "odd count"),
        (b"\x01\x00\x00\x00\x02\x00", {}, "whole number of int32"),
        (np.array([[1, 2], [-1, 3]], "<i4").tobytes(), {}, "layer -1"),
        (np.array([[1, -2]], "<i4").tobytes(), {}, "expert -2"),
        (np.array([[1, 896]], "<i4").tobytes(), {"n_experts": 896}, "expert 896, outside 0..895"),
        (np.array([[93, 0]], "<i4").tobytes(), {"n_layers": 92}, "layer 93, outside 0..92"),
        (np.array([[1, 1 << 20]], "<i4").tobytes(), {}, "expert 1048576"),
        (np.array([[5000, 1]], "<i4").tobytes(), {}, "layer 5000"),
    ],
)
def test_refusals(tmp_path, data: bytes, kwargs: dict, message: str) -> None:
    with pytest.raises(TraceError, match=message) as info:
        read_trace(_write(tmp_path, data), **kwargs)
    assert info.value.exit_code == Exit.USAGE
    assert "\n" not in str(info.value)
    with pytest.raises(TraceError):
        parse_trace_bytes(data, **kwargs)


def test_refuses_missing_directory_and_huge(tmp_path) -> None:
    with pytest.raises(TraceError, match="no such file"):
        read_trace(tmp_path / "nope.bin")
    with pytest.raises(TraceError, match="directory"):
        read_trace(tmp_path)
    huge = tmp_path / "huge.bin"
    with open(huge, "wb") as f:  # sparse: costs no disk
        f.truncate(trace_mod.MAX_TRACE_BYTES + 8)
    with pytest.raises(TraceError, match="larger than"):
        read_trace(huge)


def test_write_refusals_leave_nothing_behind(tmp_path, monkeypatch) -> None:
    with pytest.raises(OutputError, match="not an existing directory") as info:
        write_trace(tmp_path / "missing", PAIRS)
    assert info.value.exit_code == Exit.OUTPUT
    with pytest.raises(OutputError, match="outside int32"):
        write_trace(tmp_path, np.array([[1, -3]]))

    def boom(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(trace_mod.os, "replace", boom)
    with pytest.raises(OutputError, match="No space left"):
        write_trace(tmp_path, PAIRS)
    assert os.listdir(tmp_path) == []


def test_read_hist_refusals(tmp_path) -> None:
    bad = [
        "not json",
        "[]",
        '{"n_layers": 2, "n_experts": 4}',
        '{"n_layers": 2, "n_experts": 4, "counts": {"1;2": 3}}',
        '{"n_layers": 2, "n_experts": 4, "counts": {"1,9": 3}}',
        '{"n_layers": 2, "n_experts": 4, "counts": {"1,2": 0}}',
    ]
    for i, text in enumerate(bad):
        p = tmp_path / f"h{i}.json"
        p.write_text(text)
        with pytest.raises(TraceError):
            read_hist(p)
    with pytest.raises(TraceError, match="no such file"):
        read_hist(tmp_path / "none.json")


def test_recorder_across_chunks(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(TraceRecorder, "_CHUNK", 4)
    rec = TraceRecorder(n_layers=3, n_experts=8)
    expect = []
    for layer in (1, 2, 3, 1):
        experts = [(layer * 3 + j) % 8 for j in range(3)]
        rec.record_many(layer, experts)
        expect += [(layer, e) for e in experts]
    rec.record(2, 7)
    expect.append((2, 7))
    assert len(rec) == len(expect) == 13
    assert rec.pairs().tolist() == [list(p) for p in expect]
    tpath, hpath = rec.write(tmp_path)
    assert read_trace(tpath, 3, 8).tolist() == [list(p) for p in expect]
    assert read_hist(hpath)["counts"] == histogram(np.array(expect))


_INPUT = st.one_of(
    st.binary(max_size=64),
    st.lists(st.integers(-3, 1100), max_size=24).map(lambda xs: np.array(xs, "<i4").tobytes()),
)


def _check_one(data: bytes, n_layers: int | None, n_experts: int | None) -> None:
    try:
        pairs = parse_trace_bytes(data, n_layers=n_layers, n_experts=n_experts)
    except K3Error as exc:
        assert isinstance(exc, TraceError) and exc.exit_code == Exit.USAGE
        return
    assert pairs.dtype == np.int32 and pairs.ndim == 2 and pairs.shape[1] == 2
    assert len(pairs) * 8 == len(data) > 0
    assert (pairs >= 0).all()
    if n_layers is not None and n_experts is not None:
        assert pairs[:, 0].max() <= n_layers and pairs[:, 1].max() < n_experts


# 1,000 examples of 10 inputs each: 10,000 reader calls with hypothesis's overhead paid once
# per example; either a valid (N, 2) array or a TraceError (exit 2), never anything else
@settings(max_examples=1_000, deadline=None, database=None)
@given(
    st.lists(_INPUT, min_size=10, max_size=10),
    st.sampled_from([(None, None), (92, 896), (4, 8)]),
)
def test_fuzz_reader(inputs: list[bytes], bounds: tuple) -> None:
    for data in inputs:
        _check_one(data, *bounds)


# ---- gzipped traces (the committed fixtures) ------------------------------------------------
def test_a_gzipped_trace_reads_as_its_bytes(tmp_path) -> None:
    import gzip

    tpath, _ = write_trace(tmp_path, PAIRS, n_layers=92, n_experts=896)
    zipped = tmp_path / "expert_trace.bin.gz"
    zipped.write_bytes(gzip.compress(tpath.read_bytes(), mtime=0))
    assert zipped.read_bytes()[:2] == b"\x1f\x8b"  # no raw trace starts so: layer > 35,000
    assert np.array_equal(read_trace(zipped, n_layers=92, n_experts=896), PAIRS)
    with pytest.raises(TraceError, match="layer 92, outside 0..91"):  # the same checks
        read_trace(zipped, n_layers=91)


@pytest.mark.parametrize(
    "data, message",
    [
        (b"\x1f\x8b\x08\x00garbage", "does not decompress"),
        (b"\x1f\x8b", "does not decompress"),
        ("empty", "empty"),
        ("odd", "not a whole number of int32"),
    ],
)
def test_gzipped_refusals(tmp_path, data, message: str) -> None:
    import gzip

    if data == "empty":
        data = gzip.compress(b"", mtime=0)
    elif data == "odd":
        data = gzip.compress(b"\x01\x00\x00\x00\x05\x00", mtime=0)
    path = tmp_path / "t.bin.gz"
    path.write_bytes(data)
    with pytest.raises(TraceError, match=message) as info:
        read_trace(path)
    assert info.value.exit_code == Exit.USAGE


def test_a_gzipped_trace_over_the_limit_is_refused(tmp_path, monkeypatch) -> None:
    import gzip

    path = tmp_path / "t.bin.gz"
    path.write_bytes(gzip.compress(PAIRS.astype("<i4").tobytes() * 4, mtime=0))
    monkeypatch.setattr(trace_mod, "MAX_TRACE_BYTES", 100)
    with pytest.raises(TraceError, match="decompresses to more than the 100-byte limit"):
        read_trace(path)
