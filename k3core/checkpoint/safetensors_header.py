"""One safetensors shard header, checked entry by entry before any offset is trusted.

A shard is an 8-byte little-endian header length ``N``, ``N`` bytes of UTF-8 JSON, then the
data section. The JSON maps tensor names to ``{"dtype", "shape", "data_offsets"}`` (offsets
relative to the data section) plus an optional ``__metadata__`` string map. Everything a
hostile or damaged file can get wrong is refused here with a ``CheckpointError`` naming the
file and the tensor: lengths larger than the file or absurd, non-UTF-8 or non-object or
deeply nested JSON, repeated names, missing or mistyped fields, dtypes other than U8, BF16,
F16 and F32, rank above 8, element counts that overflow 64 bits or disagree with the byte
range, offsets that are negative, inverted or past the end, and ranges that overlap. Gaps
and trailing bytes are allowed (a packer may align tensors).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np

from k3core.api.errors import CheckpointError
from k3core.api.safejson import JSONRejected, encodable, parse_json, show
from k3core.api.units import human

#: safetensors dtype -> NumPy dtype of the array ``read`` returns (BF16 as its bit patterns)
DTYPES: dict[str, np.dtype] = {
    "U8": np.dtype("u1"),
    "BF16": np.dtype("<u2"),
    "F16": np.dtype("<f2"),
    "F32": np.dtype("<f4"),
}
MAX_HEADER_BYTES = 100_000_000
MAX_RANK = 8
_U64 = 1 << 64


@dataclass(frozen=True)
class Entry:
    """One tensor of one header, offsets relative to the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def header_length(prefix: bytes, file_size: int, path: Path) -> int:
    """Check the 8-byte length prefix against the file and the cap; return it."""
    n = int.from_bytes(prefix, "little")
    if n == 0:
        raise CheckpointError(f"{path}: header length is 0; not a safetensors file")
    if n > MAX_HEADER_BYTES:
        raise CheckpointError(f"{path}: header length {n} is larger than the "
                              f"{human(MAX_HEADER_BYTES)} limit; not a safetensors file "
                              "or damaged")
    if 8 + n > file_size:
        raise CheckpointError(f"{path}: header length {n} runs past the end of the file "
                              f"({file_size} bytes); truncated or damaged")
    return n


def parse_header(raw: bytes, data_size: int, path: Path) -> list[Entry]:
    """Parse and check one header; ``data_size`` is the file size minus ``8 + len(raw)``."""
    try:
        doc = parse_json(raw)
    except JSONRejected as exc:
        raise CheckpointError(f"{path}: header is not valid: {exc}") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    entries = []
    for name, value in doc.items():
        if name == "__metadata__":
            _check_metadata(value, path)
            continue
        entries.append(_entry(name, value, data_size, path))
    _check_overlaps(entries, path)
    return entries


def _entry(name: str, value: Any, data_size: int, path: Path) -> Entry:
    where = f"{path}: tensor {show(name)}"
    if not name or not name.isprintable() or not encodable(name):
        raise CheckpointError(f"{where}: bad tensor name (empty, control or unencodable "
                              "characters)")
    if not isinstance(value, dict):
        raise CheckpointError(f"{where}: entry is not an object")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in value]
    if missing:
        raise CheckpointError(f"{where}: entry lacks {', '.join(missing)}")
    dtype = value["dtype"]
    if not isinstance(dtype, str):
        raise CheckpointError(f"{where}: dtype is not a string")
    if dtype not in DTYPES:
        raise CheckpointError(f"{where}: unsupported dtype {show(dtype, 40)} (supported: "
                              f"{', '.join(DTYPES)})")
    shape = value["shape"]
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise CheckpointError(f"{where}: shape must be an array of non-negative integers")
    if len(shape) > MAX_RANK:
        raise CheckpointError(f"{where}: rank {len(shape)} is above the maximum {MAX_RANK}")
    offsets = value["data_offsets"]
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_int, offsets))):
        raise CheckpointError(f"{where}: data_offsets must be an array of two integers")
    begin, end = offsets
    if begin < 0 or end < 0:
        raise CheckpointError(f"{where}: data_offsets [{_num(begin)}, {_num(end)}] are "
                              "negative")
    if begin > end:
        raise CheckpointError(f"{where}: data_offsets [{_num(begin)}, {_num(end)}] are "
                              "inverted")
    if end > data_size:
        raise CheckpointError(f"{where}: data_offsets end {_num(end)} is past the end of the "
                              f"data ({data_size} bytes); truncated or damaged")
    nbytes = math.prod(shape) * DTYPES[dtype].itemsize
    if nbytes >= _U64:
        raise CheckpointError(f"{where}: shape {_shape(shape)} has a byte count that "
                              "overflows 64 bits")
    if nbytes != end - begin:
        raise CheckpointError(f"{where}: shape {_shape(shape)} of {dtype} is {nbytes} bytes "
                              f"but data_offsets span {end - begin}")
    return Entry(name, dtype, tuple(shape), begin, end)


def _check_metadata(value: Any, path: Path) -> None:
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise CheckpointError(f"{path}: __metadata__ must be an object of strings")


def _check_overlaps(entries: list[Entry], path: Path) -> None:
    spans = sorted((e for e in entries if e.end > e.begin), key=lambda e: (e.begin, e.end))
    for prev, cur in pairwise(spans):  # any overlap shows between neighbours
        if cur.begin < prev.end:
            raise CheckpointError(
                f"{path}: tensor {show(cur.name)} bytes [{cur.begin}, {cur.end}) overlap "
                f"tensor {show(prev.name)} [{prev.begin}, {prev.end})")


def _is_int(x: Any) -> bool:
    return type(x) is int


def _num(x: int) -> str:
    return str(x) if abs(x) < 10**30 else f"(a {x.bit_length()}-bit number)"


def _shape(shape: list[int]) -> str:
    return "[" + ", ".join(_num(d) for d in shape) + "]"
