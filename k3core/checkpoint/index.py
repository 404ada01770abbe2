"""The checkpoint index: every tensor of a safetensors model directory, by name and offset.

:meth:`CheckpointIndex.open` reads the headers of the shards (through a storage backend,
like every other byte k3 reads) and records, per tensor, its dtype, shape, file and absolute
byte range. Which shards: when ``model.safetensors.index.json`` exists, exactly those its
``weight_map`` names, each of which must be a plain relative name that stays inside the
model directory after symlinks are resolved, and each mapped tensor must really be in the
named shard; otherwise every ``*.safetensors`` in the directory, sorted by name (the
reference engine's rule). Tensors a shard holds but the ``weight_map`` omits are indexed too.

A name found in two shards, and any defect :mod:`k3core.checkpoint.safetensors_header` finds, is a
``CheckpointError`` (exit 1) naming the file and the tensor. Reads go straight into the
caller's buffer through one open :class:`~k3core.api.storage.StorageFile` per shard; a failed or
short read raises ``StorageError`` and is never handed on.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from k3core.api.errors import CheckpointError, StorageError
from k3core.api.files import FileRejected, read_capped
from k3core.api.safejson import JSONRejected, encodable, parse_json, show
from k3core.api.storage import StorageBackend, StorageFile, aligned_empty
from k3core.api.units import ALIGN
from k3core.checkpoint.safetensors_header import DTYPES, header_length, parse_header

INDEX_NAME = "model.safetensors.index.json"
#: an index.json larger than this is refused (the real one, 497,220 names, is ~50 MB)
MAX_INDEX_BYTES = 512_000_000


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: ``offset`` is absolute in ``path``."""

    name: str
    dtype: str  # "U8", "BF16", "F16" or "F32"
    shape: tuple[int, ...]
    path: Path
    offset: int
    nbytes: int

    @property
    def np_dtype(self) -> np.dtype:
        """The dtype ``read`` returns (BF16 as ``uint16`` bit patterns, little-endian)."""
        return DTYPES[self.dtype]

    @property
    def numel(self) -> int:
        return self.nbytes // DTYPES[self.dtype].itemsize


class CheckpointIndex:
    """All tensors of one model directory; build with :meth:`open`, finish with ``close``."""

    def __init__(self, model_dir: Path, storage: StorageBackend, shards: list[Path],
                 files: dict[Path, StorageFile], tensors: dict[str, TensorInfo],
                 digest: str):
        self.model_dir = model_dir
        self.storage = storage
        self.shards = shards
        self.tensors = tensors
        self._files = files
        self._digest = digest

    # ---- building ------------------------------------------------------------------------
    @classmethod
    def open(cls, model_dir: str | Path, storage: StorageBackend) -> CheckpointIndex:
        """Index ``model_dir``; raise ``CheckpointError`` on anything doubtful."""
        root = Path(model_dir)
        if not root.is_dir():
            raise CheckpointError(f"{root}: not a directory")
        weight_map = _read_index(root)
        shards = _shard_paths(root, weight_map)
        files: dict[Path, StorageFile] = {}
        tensors: dict[str, TensorInfo] = {}
        digest = hashlib.sha256()
        try:
            for path in shards:
                files[path] = _open_file(storage, path)
                _index_shard(files[path], path, tensors, digest)
            if weight_map is not None:
                _check_weight_map(root, weight_map, tensors)
        except BaseException:
            for f in files.values():
                f.close()
            raise
        return cls(root, storage, shards, files, tensors, digest.hexdigest())

    # ---- queries -------------------------------------------------------------------------
    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __len__(self) -> int:
        return len(self.tensors)

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def info(self, name: str) -> TensorInfo:
        """The tensor's record, or ``CheckpointError`` saying it is not in any shard."""
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.model_dir}: tensor {show(name)} is not in any shard "
                                  f"({len(self.shards)} shards, {len(self.tensors)} tensors)"
                                  ) from None

    @property
    def total_bytes(self) -> int:
        """Sum of all tensors' byte sizes (what ``metadata.total_size`` counts)."""
        return sum(t.nbytes for t in self.tensors.values())

    def fingerprint(self) -> str:
        """SHA-256 over each shard's name, size and header bytes, in shard order."""
        return self._digest

    # ---- reading -------------------------------------------------------------------------
    def read(self, name: str) -> np.ndarray:
        """The tensor as a new array, typed and shaped (BF16 as ``uint16`` bit patterns)."""
        t = self.info(name)
        # placed at the file offset's remainder modulo 4096, so O_DIRECT reads land in place
        skew = t.offset % ALIGN
        raw = aligned_empty(t.nbytes + skew, ALIGN)[skew:]
        out = raw.view(t.np_dtype).reshape(t.shape) if t.nbytes else np.empty(t.shape, t.np_dtype)
        if t.nbytes:
            self._read(t.path, t.offset, out, what=f"tensor {show(name)}")
        return out

    def read_into(self, name: str, out: np.ndarray | memoryview) -> None:
        """Fill ``out`` (writable, contiguous, exactly ``nbytes``) with the tensor's bytes."""
        t = self.info(name)
        if not isinstance(out, (np.ndarray, memoryview)):
            raise CheckpointError(f"tensor {show(name)}: destination is not an array or "
                                  "memoryview")
        size = out.nbytes
        if size != t.nbytes:
            raise CheckpointError(f"tensor {show(name)} is {t.nbytes} bytes but the "
                                  f"destination holds {size}")
        if t.nbytes:
            self._read(t.path, t.offset, out, what=f"tensor {show(name)}")

    def read_row(self, name: str, row: int) -> np.ndarray:
        """Row ``row`` of a 2-D tensor as a new typed array: one read, the table never loaded
        (the embedding's rows are gathered this way)."""
        t = self.info(name)
        if len(t.shape) != 2 or not 0 <= row < t.shape[0]:
            raise CheckpointError(f"tensor {show(name)} of shape {list(t.shape)} has no row {row}")
        n = t.nbytes // t.shape[0]
        at = t.offset + row * n
        raw = aligned_empty(n + at % ALIGN, ALIGN)[at % ALIGN:]
        if n:
            self._read(t.path, at, raw, what=f"tensor {show(name)} row {row}")
        return raw.view(t.np_dtype)

    def read_range(self, path: str | Path, offset: int, nbytes: int) -> np.ndarray:
        """Bytes ``[offset, offset + nbytes)`` of shard ``path`` as a new ``uint8`` array."""
        p = Path(path)
        f = self._files.get(p)
        if f is None:  # the same file spelled another way (relative vs absolute)
            p = next((q for q in self._files if os.path.abspath(q) == os.path.abspath(p)), p)
            f = self._files.get(p)
        if f is None:
            raise CheckpointError(f"{p}: not a shard of this checkpoint")
        if offset < 0 or nbytes < 0 or offset + nbytes > f.size:
            raise CheckpointError(f"{p}: range of {nbytes} bytes at offset {offset} is outside "
                                  f"the file ({f.size} bytes)")
        out = np.empty(nbytes, dtype=np.uint8)
        if nbytes:
            self._read(p, offset, out, what=f"{nbytes} bytes at offset {offset}")
        return out

    def shard_size(self, path: Path) -> int:
        """Bytes in shard ``path`` (as opened)."""
        return self._file(path).size

    def read_alignment(self, path: Path) -> int:
        """The block size shard ``path`` reads natively (``StorageFile.alignment``)."""
        return max(1, int(self._file(path).alignment))

    def _file(self, path: Path) -> StorageFile:
        f = self._files.get(path)
        if f is None:
            raise CheckpointError(f"{path}: checkpoint index is closed")
        return f

    def read_at(self, path: Path, offset: int, out: np.ndarray | memoryview, what: str) -> None:
        """Fill ``out`` from shard ``path`` at absolute ``offset`` (the expert cache's reads)."""
        self._read(path, offset, out, what)

    def _read(self, path: Path, offset: int, out: np.ndarray | memoryview, what: str) -> None:
        f = self._file(path)
        try:
            f.read_into(offset, out)
        except StorageError as exc:
            raise StorageError(f"{what}: {exc.message}", hint=exc.hint) from None

    def close(self) -> None:
        files, self._files = self._files, {}
        for f in files.values():
            f.close()

    def __enter__(self) -> CheckpointIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open_file(storage: StorageBackend, path: Path) -> StorageFile:
    try:
        return storage.open(path)
    except StorageError as exc:
        raise CheckpointError(f"{path}: cannot open shard: {exc.message}") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot open shard: {exc.strerror or exc}") from None


def _index_shard(f: StorageFile, path: Path, tensors: dict[str, TensorInfo],
                 digest: Any) -> None:
    size = f.size
    if size < 8:
        raise CheckpointError(f"{path}: {size} bytes is shorter than the 8-byte header "
                              "length; truncated or not a safetensors file")
    prefix = _read_bytes(f, path, 0, 8)
    n = header_length(prefix, size, path)
    raw = _read_bytes(f, path, 8, n)
    for e in parse_header(raw, size - 8 - n, path):
        other = tensors.get(e.name)
        if other is not None:
            raise CheckpointError(f"{path}: tensor {show(e.name)} is also in {other.path}; "
                                  "a name may appear in only one shard")
        tensors[e.name] = TensorInfo(e.name, e.dtype, e.shape, path, 8 + n + e.begin,
                                     e.end - e.begin)
    name = path.name.encode("utf-8", "surrogateescape")
    digest.update(len(name).to_bytes(8, "little") + name + size.to_bytes(8, "little"))
    digest.update(prefix + raw)


def _read_bytes(f: StorageFile, path: Path, offset: int, n: int) -> bytes:
    buf = np.empty(n, dtype=np.uint8)
    try:
        f.read_into(offset, buf)
    except StorageError as exc:
        why = exc.message.removeprefix(f"{path}: ")
        raise CheckpointError(f"{path}: cannot read the header: {why}") from None
    return buf.tobytes()


def _read_index(root: Path) -> dict[str, str] | None:
    path = root / INDEX_NAME
    if not path.exists() and not path.is_symlink():
        return None
    try:
        data = read_capped(path, MAX_INDEX_BYTES)
    except FileRejected as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    try:
        doc = parse_json(data)
    except JSONRejected as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict):
        raise CheckpointError(f"{path}: has no weight_map object")
    if not wm:
        raise CheckpointError(f"{path}: weight_map is empty")
    for tensor, shard in wm.items():
        if not isinstance(shard, str):
            raise CheckpointError(f"{path}: weight_map entry {show(tensor)} is not a file name")
    return wm


def _shard_paths(root: Path, weight_map: dict[str, str] | None) -> list[Path]:
    if weight_map is None:
        try:
            names = sorted(p.name for p in root.iterdir() if p.name.endswith(".safetensors"))
        except OSError as exc:
            raise CheckpointError(f"{root}: cannot list: {exc.strerror or exc}") from None
        if not names:
            raise CheckpointError(f"{root}: no *.safetensors files (and no {INDEX_NAME})")
        paths = [root / n for n in names]
        for p in paths:
            if not p.is_file():
                raise CheckpointError(f"{p}: not a regular file")
        return paths
    real_root = os.path.realpath(root)
    paths = []
    for name in sorted(set(weight_map.values())):
        where = f"{root / INDEX_NAME}: shard {show(name)}"
        if not name or "\0" in name or not encodable(name):
            raise CheckpointError(f"{where}: not a file name")
        if os.path.isabs(name) or name.startswith(("/", "\\")) or (len(name) > 1 and
                                                                    name[1] == ":"):
            raise CheckpointError(f"{where}: absolute paths are refused")
        if ".." in name.replace("\\", "/").split("/"):
            raise CheckpointError(f"{where}: '..' is refused (shards must be inside the model "
                                  "directory)")
        p = root / name
        real = os.path.realpath(p)
        if not _inside(real_root, real):
            raise CheckpointError(f"{where}: resolves to {show(real)}, outside the model "
                                  "directory")
        if not os.path.isfile(real):
            raise CheckpointError(f"{where}: no such file (or not a regular file)")
        paths.append(p)
    return paths


def _inside(root: str, path: str) -> bool:
    try:
        return os.path.commonpath([root, path]) == root
    except ValueError:  # different drives (Windows)
        return False


def _check_weight_map(root: Path, weight_map: dict[str, str],
                      tensors: dict[str, TensorInfo]) -> None:
    for tensor, shard in weight_map.items():
        t = tensors.get(tensor)
        want = root / shard
        if t is None or t.path != want:
            held = (f"it is in {t.path.name}" if t is not None
                    else "none of the shards the index names holds it")
            raise CheckpointError(f"{root / INDEX_NAME}: weight_map puts tensor {show(tensor)} "
                                  f"in {show(shard)}, but {held}")
