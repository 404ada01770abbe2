"""The checkpoint index against the fixtures and the safetensors package; every refusal."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors
from k3_storage.plain import PlainStorage
from safetensors import safe_open

from k3core.api.errors import CheckpointError, Exit, StorageError
from k3core.checkpoint.index import INDEX_NAME, CheckpointIndex
from k3core.testing.fixtures import fixtures_dir

FIX = fixtures_dir()
ST = FIX / "st"
SHARD1 = ST / "model-00001-of-00002.safetensors"
SHARD2 = ST / "model-00002-of-00002.safetensors"


def open_index(d: Path) -> CheckpointIndex:
    return CheckpointIndex.open(d, PlainStorage())


def shard(header: Any, data: bytes = b"", length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def refused(d: Path, *needles: str) -> str:
    with pytest.raises(CheckpointError) as info:
        open_index(d)
    assert info.value.exit_code == Exit.RUNTIME == 1
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))
    return str(info.value)


def reference(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """The safetensors package's own parse of one shard: name -> (dtype, shape, bytes)."""
    return {n: (m["dtype"], m["shape"], bytes(m["data"]))
            for n, m in safetensors.deserialize(path.read_bytes())}


def check_against_reference(ix: CheckpointIndex) -> int:
    count = 0
    for path in ix.shards:
        ref = reference(path)
        with safe_open(str(path), framework="numpy") as f:
            for name, (dtype, shape, data) in ref.items():
                t = ix.info(name)
                assert (t.dtype, list(t.shape), t.path, t.nbytes) == (dtype, shape, path,
                                                                        len(data))
                arr = ix.read(name)
                assert arr.shape == tuple(shape) and arr.tobytes() == data
                if dtype != "BF16":  # NumPy has no bfloat16; its bit patterns are compared
                    np.testing.assert_array_equal(arr, f.get_tensor(name), strict=True)
                count += 1
    assert count == len(ix.tensors)
    return count


# ---- the fixtures ----------------------------------------------------------------------
def test_st_edge_cases() -> None:
    with open_index(ST) as ix:
        assert ix.shards == [SHARD1, SHARD2]
        assert check_against_reference(ix) == 13
        assert "__metadata__" not in ix
        bf = ix.read("plain.bf16.1d")
        assert bf.dtype == np.uint16 and bf.shape == (128,)
        widened = (bf.astype(np.uint32) << 16).view(np.float32)
        assert widened[0] == np.inf and widened[1] == -np.inf and np.isnan(widened[2])
        f16 = ix.read("tricky.f16.1d")
        assert f16.dtype == np.float16 and f16.shape == (64,)
        u8 = ix.read("packed.u8.2d")
        assert u8.dtype == np.uint8 and u8.shape == (7, 32)
        scalar = ix.read("scalar.f32")
        assert scalar.shape == () and scalar.dtype == np.float32 and float(scalar) == 3.5
        assert ix.read("empty.f32").shape == (0, 8)
        second = ix.info("second.shard.f32")
        assert second.path == SHARD2 and second.offset == 8 + 253
        assert ix.read('weird\\name."with"quotes').shape == (3,)
        assert ix.info("rank4.u8").shape == (2, 2, 2, 2)


@pytest.mark.parametrize("name", ["tiny-released", "tiny-flat"])
def test_tiny_checkpoints_index_every_tensor(name: str) -> None:
    with open_index(FIX / name) as ix:
        assert check_against_reference(ix) == 916
        assert ix.total_bytes == 3676928  # the index's metadata.total_size
        assert "language_model.lm_head.weight" in ix


def test_released_and_flat_twins_hold_the_same_bytes() -> None:
    with open_index(FIX / "tiny-released") as a, open_index(FIX / "tiny-flat") as b:
        assert set(a.tensors) == set(b.tensors)
        assert len(a.shards) == 4 and len(b.shards) == 1
        for n in a.tensors:
            assert a.read(n).tobytes() == b.read(n).tobytes()
        assert a.fingerprint() != b.fingerprint()


def test_fingerprint_is_stable_and_sees_headers(tmp_path: Path) -> None:
    d = tmp_path / "m"
    shutil.copytree(ST, d)
    with open_index(ST) as a, open_index(d) as b:
        assert a.fingerprint() == b.fingerprint() and len(a.fingerprint()) == 64
    raw = bytearray((d / SHARD2.name).read_bytes())
    raw[8 + raw[8:].index(b"400")] = ord("4")  # same length, header byte unchanged
    pos = 8 + raw[8:].index(b"second.shard.u8")
    raw[pos] = ord("S")
    (d / SHARD2.name).write_bytes(bytes(raw))
    with open_index(d) as c:
        assert c.fingerprint() != open_index(ST).fingerprint()


def test_read_into_read_range_and_missing_names() -> None:
    with open_index(ST) as ix:
        t = ix.info("plain.f32.2d")
        out = np.empty(t.shape, np.float32)
        ix.read_into("plain.f32.2d", out)
        assert out.tobytes() == ix.read("plain.f32.2d").tobytes()
        raw = bytearray(t.nbytes)
        ix.read_into("plain.f32.2d", memoryview(raw))
        assert bytes(raw) == out.tobytes()
        with pytest.raises(CheckpointError, match="is 1024 bytes but the destination holds 4"):
            ix.read_into("plain.f32.2d", np.empty(1, np.float32))
        rng = ix.read_range(t.path, t.offset, t.nbytes)
        assert rng.dtype == np.uint8 and rng.tobytes() == out.tobytes()
        assert ix.read_range(str(t.path), 0, 8).tobytes() == struct.pack("<Q", 1022)
        assert ix.read_range(os.path.relpath(t.path), 0, 8).tobytes() == struct.pack("<Q", 1022)
        with pytest.raises(CheckpointError, match="outside the file"):
            ix.read_range(t.path, SHARD1.stat().st_size - 2, 4)
        with pytest.raises(CheckpointError, match="not a shard"):
            ix.read_range(FIX / "mxfp4.json", 0, 1)
        with pytest.raises(CheckpointError, match="'no.such' is not in any shard") as info:
            ix.read("no.such")
        assert info.value.exit_code == 1
        assert "no.such" not in ix and "plain.f32.2d" in ix and len(ix) == 13
        stats = ix.storage.stats.snapshot()
        assert stats[0] > 0 and stats[2] > 0


def test_data_truncated_after_open_fails_loudly(tmp_path: Path) -> None:
    d = tmp_path / "m"
    shutil.copytree(ST, d)
    with open_index(d) as ix:
        os.truncate(d / SHARD2.name, SHARD2.stat().st_size - 100)
        assert ix.read("second.shard.f32").shape == (10, 10)
        with pytest.raises(StorageError, match="tensor 'second.shard.u8'.*short read"):
            ix.read("second.shard.u8")


# ---- refusals ----------------------------------------------------------------------------
def one(tmp_path: Path, data: bytes, name: str = "model.safetensors") -> Path:
    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    (d / name).write_bytes(data)
    return d


F32 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


def test_not_a_directory_and_no_shards(tmp_path: Path) -> None:
    refused(tmp_path / "nope", "not a directory")
    (tmp_path / "config.json").write_text("{}")
    refused(tmp_path, "no *.safetensors files")


def test_truncated_copies(tmp_path: Path) -> None:
    data = SHARD1.read_bytes()
    refused(one(tmp_path, data[:4]), "4 bytes is shorter than the 8-byte header length")
    refused(one(tmp_path, data[:500]), "runs past the end of the file")
    refused(one(tmp_path, data[:2000]), "past the end of the data", "tensor '")


@pytest.mark.parametrize("mutate, needles", [
    (lambda b: b"\xff" * 8 + b[8:], ["header length 18446744073709551615", "limit"]),
    (lambda b: struct.pack("<Q", 0) + b[8:], ["header length is 0"]),
    (lambda b: struct.pack("<Q", 5000) + b[8:], ["header length 5000 runs past the end"]),
    (lambda b: b[:8] + b"[" + b[9:], ["header is not valid", "invalid JSON"]),
    (lambda b: b[:8] + b"\xff" + b[9:], ["not UTF-8"]),
])
def test_corrupted_copies(tmp_path: Path, mutate: Any, needles: list[str]) -> None:
    refused(one(tmp_path, mutate(SHARD1.read_bytes())), *needles)


@pytest.mark.parametrize("header, data, needles", [
    ([1, 2], b"", ["header is not a JSON object"]),
    ({"a": 5}, b"", ["tensor 'a': entry is not an object"]),
    ({"a": {"dtype": "F32", "shape": [2]}}, b"", ["tensor 'a': entry lacks data_offsets"]),
    ({"a": {"shape": [2]}}, b"", ["entry lacks dtype, data_offsets"]),
    ({"a": {**F32, "dtype": "I64"}}, bytes(8),
     ["tensor 'a': unsupported dtype 'I64' (supported: U8, BF16, F16, F32)"]),
    ({"a": {**F32, "dtype": "bf16"}}, bytes(8), ["unsupported dtype 'bf16'"]),
    ({"a": {**F32, "dtype": 4}}, bytes(8), ["dtype is not a string"]),
    ({"a": {**F32, "shape": [2.0]}}, bytes(8), ["shape must be an array of non-negative"]),
    ({"a": {**F32, "shape": [-2]}}, bytes(8), ["shape must be an array of non-negative"]),
    ({"a": {**F32, "shape": [True, 2]}}, bytes(8), ["shape must be an array"]),
    ({"a": {**F32, "shape": [1] * 9 + [2]}}, bytes(8), ["rank 10 is above the maximum 8"]),
    ({"a": {**F32, "shape": [2**40, 2**40]}}, bytes(8), ["overflows 64 bits"]),
    ({"a": {**F32, "shape": [3]}}, bytes(8), ["is 12 bytes but data_offsets span 8"]),
    ({"a": {**F32, "data_offsets": [0]}}, bytes(8), ["data_offsets must be an array of two"]),
    ({"a": {**F32, "data_offsets": [0, "8"]}}, bytes(8), ["data_offsets must be an array"]),
    ({"a": {**F32, "data_offsets": [-8, 0]}}, bytes(8), ["are negative"]),
    ({"a": {**F32, "data_offsets": [8, 0]}}, bytes(8), ["are inverted"]),
    ({"a": {**F32, "data_offsets": [4, 12]}}, bytes(8), ["end 12 is past the end of the data"]),
    ({"a": {**F32, "data_offsets": [0, 2**70]}}, bytes(8), ["past the end of the data"]),
    ({"a": F32, "b": {**F32, "data_offsets": [4, 12]}}, bytes(12),
     ["tensor 'b' bytes [4, 12) overlap tensor 'a' [0, 8)"]),
    ({"a": F32, "b": F32}, bytes(8), ["overlap"]),
    ({"__metadata__": {"x": 1}, "a": F32}, bytes(8), ["__metadata__ must be an object"]),
    ({"__metadata__": [], "a": F32}, bytes(8), ["__metadata__ must be an object"]),
    ({"": F32}, bytes(8), ["bad tensor name"]),
    ({"a\nb": F32}, bytes(8), ["tensor 'a\\nb': bad tensor name"]),
    ({"\ud800": F32}, bytes(8), ["tensor '\\ud800': bad tensor name"]),
])
def test_bad_headers(tmp_path: Path, header: Any, data: bytes, needles: list[str]) -> None:
    msg = refused(one(tmp_path, shard(header, data)), "model.safetensors", *needles)
    assert "\n" not in msg


@pytest.mark.parametrize("raw, needles", [
    (b'{"a": ' + json.dumps(F32).encode() + b', "a": ' + json.dumps(F32).encode() + b"}",
     ["duplicate key 'a'"]),
    (b'{"a": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 8]}}',
     ["NaN is not a JSON number"]),
    (b'{"a": ' + b"[" * 50000 + b"]" * 50000 + b"}", ["nested too deeply"]),
    (b'{"a": {"dtype": "F32", "shape": [1' + b"0" * 5000 + b'], "data_offsets": [0, 8]}}',
     ["invalid JSON"]),
])
def test_bad_header_json(tmp_path: Path, raw: bytes, needles: list[str]) -> None:
    refused(one(tmp_path, shard(raw, bytes(8))), *needles)


def test_gaps_and_zero_length_tensors_are_fine(tmp_path: Path) -> None:
    header = {"a": {**F32, "data_offsets": [8, 16]}, "z": {**F32, "shape": [0, 2],
                                                            "data_offsets": [8, 8]},
              "__metadata__": {"format": "pt"}}
    data = bytes(8) + np.array([1.5, -2], np.float32).tobytes() + b"trailing"
    with open_index(one(tmp_path, shard(header, data))) as ix:
        np.testing.assert_array_equal(ix.read("a"), [1.5, -2])
        assert ix.read("z").shape == (0, 2) and ix.total_bytes == 8


def test_duplicate_name_across_shards(tmp_path: Path) -> None:
    d = one(tmp_path, shard({"w": F32}, bytes(8)), "a.safetensors")
    one(tmp_path, shard({"x": F32, "w": F32 | {"data_offsets": [8, 16]}}, bytes(16)),
        "b.safetensors")
    msg = refused(d, "b.safetensors: tensor 'w' is also in", "a.safetensors")
    assert "one shard" in msg


def test_directory_named_like_a_shard(tmp_path: Path) -> None:
    d = one(tmp_path, shard({"w": F32}, bytes(8)))
    (d / "x.safetensors").mkdir()
    refused(d, "x.safetensors: not a regular file")


# ---- model.safetensors.index.json --------------------------------------------------------
def indexed(tmp_path: Path, weight_map: Any, extra: dict[str, bytes] | None = None) -> Path:
    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    (d / "a.safetensors").write_bytes(shard({"w": F32}, bytes(8)))
    (d / "b.safetensors").write_bytes(shard({"v": F32}, bytes(8)))
    for name, data in (extra or {}).items():
        (d / name).write_bytes(data)
    doc = {"metadata": {"total_size": 16}, "weight_map": weight_map}
    (d / INDEX_NAME).write_text(json.dumps(doc))
    return d


def test_index_names_exactly_its_shards(tmp_path: Path) -> None:
    d = indexed(tmp_path, {"w": "a.safetensors"},
                extra={"stray.safetensors": b"not a shard at all"})
    with open_index(d) as ix:
        assert ix.shards == [d / "a.safetensors"] and list(ix.tensors) == ["w"]
    d = indexed(tmp_path, {"w": "a.safetensors", "v": "./b.safetensors"})
    with open_index(d) as ix:
        assert len(ix.shards) == 2 and ix.info("v").path == d / "b.safetensors"


def test_tiny_released_uses_its_index(tmp_path: Path) -> None:
    d = tmp_path / "m"
    shutil.copytree(FIX / "tiny-released", d)
    (d / "zz-extra.safetensors").write_bytes(b"garbage")  # not named: ignored
    with open_index(d) as ix:
        assert len(ix.tensors) == 916 and len(ix.shards) == 4


def test_index_outside_names(tmp_path: Path) -> None:
    outside = tmp_path / "x.safetensors"
    outside.write_bytes(shard({"w": F32}, bytes(8)))
    refused(indexed(tmp_path, {"w": "../x.safetensors"}), "'..' is refused")
    refused(indexed(tmp_path, {"w": "sub/../../x.safetensors"}), "'..' is refused")
    refused(indexed(tmp_path, {"w": str(outside)}), "absolute paths are refused")
    d = indexed(tmp_path, {"w": "link.safetensors"})
    (d / "link.safetensors").symlink_to(outside)
    refused(d, "link.safetensors", "outside the model directory")
    (d / "inside.safetensors").symlink_to(d / "a.safetensors")
    (d / INDEX_NAME).write_text(json.dumps({"weight_map": {"w": "inside.safetensors"}}))
    with open_index(d) as ix:
        assert ix.info("w").path == d / "inside.safetensors"


@pytest.mark.parametrize("weight_map, needles", [
    ({"w": "missing.safetensors"}, ["'missing.safetensors': no such file"]),
    ({"w": "b.safetensors", "v": "a.safetensors"},
     ["weight_map puts tensor 'w' in 'b.safetensors'", "it is in a.safetensors"]),
    ({"w": "b.safetensors"}, ["tensor 'w' in 'b.safetensors', but none of the shards"]),
    ({"w": "a.safetensors", "q": "a.safetensors"}, ["tensor 'q'", "none of the shards"]),
    ({"w": 3}, ["weight_map entry 'w' is not a file name"]),
    ({}, ["weight_map is empty"]),
    ([], ["has no weight_map object"]),
    ({"w": ""}, ["not a file name"]),
    ({"w": "a\u0000.safetensors"}, ["not a file name"]),
])
def test_bad_weight_maps(tmp_path: Path, weight_map: Any, needles: list[str]) -> None:
    refused(indexed(tmp_path, weight_map), *needles)


def test_unreadable_index(tmp_path: Path) -> None:
    d = indexed(tmp_path, {"w": "a.safetensors"})
    (d / INDEX_NAME).write_bytes(b'{"weight_map": {"w": "a.safetensors"')
    refused(d, INDEX_NAME, "invalid JSON")
    (d / INDEX_NAME).write_bytes(b"\xfe\xff")
    refused(d, "not UTF-8")
