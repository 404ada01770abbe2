"""The packed trunk's manifest (``trunk.json``): what it says, and every check before use.

``k3 pack-trunk`` copies each layer's non-expert tensors verbatim into one ``trunk.bin``,
one run per layer at a 4096-aligned offset with its length padded to 4096, so a layer is
one aligned read (O_DIRECT needs no fix-up). ``trunk.json`` describes it::

    {"format": "k3-trunk", "version": 1, "align": 4096, "n_layers": N,
     "total_bytes": size of trunk.bin, "source_fingerprint": CheckpointIndex.fingerprint(),
     "source_sample": "sha256:..." (k3core.trunk.sample: sampled bytes of every run),
     "config_fingerprint": ModelConfig.fingerprint(),
     "layers": [{"layer": L, "file_off": ..., "nbytes": padded run, "span": unpadded run,
                 "checksum": "crc32:xxxxxxxx" (of the span bytes),
                 "tensors": {full name: {"off": relative to the run, "nbytes", "dtype",
                                         "shape"}}}, ...],
     "tables": {name: {"chunk_rows": R, "checksums": ["crc32:...", ...]}}}

``tables`` (written by this k3, optional to read) holds CRC-32s of the embedding and
``lm_head`` as they sit in the checkpoint, one per ``chunk_rows`` rows (about 1 MiB), so
``--ultra-low-memory``, which streams those tables from the checkpoint, can check what it
reads (:mod:`k3core.trunk.tables`). A trunk without them cannot run ultra-low-memory.

A manifest is untrusted input. :func:`open_trunk` refuses, with one ``CheckpointError``
(exit 1) naming the problem, a file over the size cap, anything but strict JSON, a field of
the wrong type or out of range, layers other than ``0..n-1`` each once, runs that are
unaligned, overlap or leave ``trunk.bin`` (whose size must equal ``total_bytes``), tensors
that escape their run or overlap, or whose dtype/shape/size/relative position disagree with
the checkpoint, a trunk packed from another checkpoint (other headers, or the same headers
but other weights: the sampled bytes differ) or for another model shape, and a trunk with
fewer layers than the run needs. ``verify=True`` re-checksums every layer at open; without
it each layer's checksum is still checked before its bytes are first used
(:mod:`k3core.trunk.stream`).
"""

from __future__ import annotations

import math
import os
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np

from k3core.api.errors import CheckpointError, StorageError, UsageError
from k3core.api.files import FileRejected, read_capped
from k3core.api.safejson import JSONRejected, parse_json, show
from k3core.api.storage import StorageBackend, StorageFile, aligned_empty
from k3core.api.units import ALIGN, align_up
from k3core.checkpoint.index import CheckpointIndex
from k3core.checkpoint.safetensors_header import DTYPES
from k3core.model import names
from k3core.model.config import ModelConfig
from k3core.model.layer_params import trunk_suffixes
from k3core.trunk.codec import NAMES as CODEC_NAMES
from k3core.trunk.codec import codec_for_manifest
from k3core.trunk.sample import check_samples
from k3core.trunk.windows import (
    CodedWindows,
    Window,
    WindowTableError,
    parse_windows,
    staged_windows,
    staging_bytes,
)

FORMAT = "k3-trunk"
VERSION = 1
#: the version of a trunk packed with a codec (an older k3 refuses it instead of misreading)
VERSION_CODEC = 2
MANIFEST_NAME = "trunk.json"
DATA_NAME = "trunk.bin"
#: a manifest larger than this is refused (93 layers x ~30 tensors is ~0.5 MB)
MAX_MANIFEST_BYTES = 16_000_000
MAX_LAYERS = 100_000
MAX_TENSORS_PER_LAYER = 4096
MAX_RANK = 8
#: bytes checksummed per read while verifying
VERIFY_CHUNK = 64 * 1024 * 1024
_CHECKSUM_RE = re.compile(r"^crc32:[0-9a-f]{8}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class TrunkTensor:
    name: str
    off: int  # relative to the layer's run
    nbytes: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def np_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class TrunkLayer:
    layer: int
    file_off: int
    nbytes: int  # padded to ALIGN: what one read fetches
    span: int  # the tensors' bytes, unpadded
    checksum: str
    tensors: dict[str, TrunkTensor]
    #: a compressed layer (:mod:`k3core.trunk.windows`): encoded bytes, their padded run
    #: in ``trunk.bin`` and the window table; an uncompressed layer has no windows
    stored: int = 0
    file_nbytes: int = 0
    windows: tuple[Window, ...] = ()

    @property
    def disk_nbytes(self) -> int:
        """The bytes of ``trunk.bin`` this layer occupies (what reading it fetches)."""
        return self.file_nbytes if self.windows else self.nbytes

    def to_json(self) -> dict[str, Any]:
        codec = {"stored": self.stored, "file_nbytes": self.file_nbytes,
                 "windows": [[w.raw_len, w.nbytes] for w in self.windows]}
        return {
            "layer": self.layer, "file_off": self.file_off, "nbytes": self.nbytes,
            "span": self.span, "checksum": self.checksum,
            **(codec if self.windows else {}),
            "tensors": {t.name: {"off": t.off, "nbytes": t.nbytes, "dtype": t.dtype,
                                 "shape": list(t.shape)} for t in self.tensors.values()},
        }


@dataclass(frozen=True)
class TableChecksums:
    """CRC-32s of one model table, ``chunk_rows`` rows each (the last chunk may be short)."""

    name: str
    chunk_rows: int
    checksums: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"chunk_rows": self.chunk_rows, "checksums": list(self.checksums)}


#: rows per table checksum: about this many bytes
TABLE_CHUNK_BYTES = 1 << 20


def table_chunk_rows(row_bytes: int) -> int:
    return max(1, TABLE_CHUNK_BYTES // max(1, row_bytes))


@dataclass(frozen=True)
class TrunkManifest:
    """A validated packed trunk; ``layers[L].layer == L``."""

    trunk_dir: Path
    align: int
    layers: tuple[TrunkLayer, ...]
    source_fingerprint: str
    source_sample: str
    config_fingerprint: tuple[int, ...]
    total_bytes: int
    tables: dict[str, TableChecksums] | None = None
    codec: str = "none"

    @property
    def compressed(self) -> bool:
        return self.codec != "none"

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def bin_path(self) -> Path:
        return self.trunk_dir / DATA_NAME

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "version": VERSION_CODEC if self.compressed else VERSION,
            **({"codec": self.codec} if self.compressed else {}), "align": self.align,
            "n_layers": self.n_layers, "total_bytes": self.total_bytes,
            "source_fingerprint": self.source_fingerprint,
            "source_sample": self.source_sample,
            "config_fingerprint": list(self.config_fingerprint),
            "layers": [lay.to_json() for lay in self.layers],
            **({"tables": {n: t.to_json() for n, t in self.tables.items()}}
               if self.tables is not None else {}),
        }


def crc_tag(crc: int) -> str:
    return f"crc32:{crc & 0xFFFFFFFF:08x}"


# ---- reading and checking ------------------------------------------------------------------
def open_trunk(
    trunk_dir: str | Path,
    index: CheckpointIndex,
    cfg: ModelConfig,
    n_layers: int | None = None,
    *,
    verify: bool = False,
    storage: StorageBackend | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> TrunkManifest:
    """Read and check ``trunk_dir`` against ``index`` and ``cfg``; needs ``n_layers`` layers."""
    root = Path(trunk_dir)
    if not root.exists():  # a missing input path is a usage error (docs/exit-codes.md)
        raise UsageError(f"--trunk {root} does not exist (pack one with "
                         "`k3 pack-trunk MODEL_DIR TRUNK_DIR`)")
    if not root.is_dir():
        raise UsageError(f"--trunk {root} is not a directory (it names the directory "
                         "`k3 pack-trunk` wrote)")
    doc = _load(root / MANIFEST_NAME)
    man = parse_manifest(doc, root, index, cfg, n_layers or cfg.n_layers)
    _check_bin(man)
    layers = [(lay.layer, *run_source(lay, index), lay.span, lay.file_off) for lay in man.layers]
    check_samples(root, man.bin_path, index, storage or index.storage, layers, man.source_sample,
                  compare_bin=not man.compressed)
    if verify:
        verify_trunk(man, storage or index.storage, progress)
    return man


def _load(path: Path) -> Any:
    if not path.is_file():
        raise UsageError(f"{path}: no trunk manifest, so {path.parent} is not a packed "
                         "trunk (not packed, or packing did not finish); run `k3 pack-trunk`")
    try:
        data = read_capped(path, MAX_MANIFEST_BYTES)
    except FileRejected as exc:
        raise CheckpointError(f"{path}: {exc} (a trunk manifest)") from None
    try:
        return parse_json(data)
    except JSONRejected as exc:
        raise CheckpointError(f"{path}: {exc}") from None


class _Bad(Exception):
    pass


def _int(d: dict[str, Any], key: str, lo: int = 0, hi: int = 1 << 62) -> int:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise _Bad(f"{key} must be an integer, got {_kind(v)}")
    if not lo <= v <= hi:
        raise _Bad(f"{key} = {v} is out of range {lo}..{hi}")
    return v


def _kind(v: Any) -> str:
    if v is None:
        return "nothing (missing or null)"
    return type(v).__name__ if not isinstance(v, str) else f"string {show(v, 40)}"


def parse_manifest(doc: Any, root: Path, index: CheckpointIndex, cfg: ModelConfig,
                   n_needed: int) -> TrunkManifest:
    """Check a parsed ``trunk.json`` document; raise ``CheckpointError`` naming the problem."""
    where = root / MANIFEST_NAME
    try:
        man = _parse_root(doc, root)
    except _Bad as exc:
        raise CheckpointError(f"{where}: {exc}") from None
    if man.source_fingerprint != index.fingerprint():
        raise CheckpointError(f"trunk at {root} was packed from a different checkpoint than "
                              f"{index.model_dir}; repack it with `k3 pack-trunk "
                              f"{index.model_dir} {root} --force`")
    if man.config_fingerprint != tuple(cfg.fingerprint()):
        raise CheckpointError(f"trunk at {root} was packed for a different model shape "
                              f"({list(man.config_fingerprint)} vs {list(cfg.fingerprint())})")
    if man.n_layers < n_needed:
        raise CheckpointError(f"trunk at {root} has {man.n_layers} layers but this run needs "
                              f"{n_needed}")
    for lay in man.layers:
        try:
            _check_against_index(lay, index, cfg if lay.layer < cfg.n_layers else None)
        except _Bad as exc:
            raise CheckpointError(f"{where}: layer {lay.layer}: {exc}") from None
    try:
        tables = _parse_tables(doc.get("tables"), index)
    except _Bad as exc:
        raise CheckpointError(f"{where}: tables: {exc}") from None
    return replace(man, tables=tables)


def _parse_tables(raw: Any, index: CheckpointIndex) -> dict[str, TableChecksums] | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise _Bad(f"must be an object, got {_kind(raw)}")
    out: dict[str, TableChecksums] = {}
    for name, t in raw.items():
        if name not in (names.EMBED, names.LM_HEAD):
            raise _Bad(f"{show(name)} is not a streamed model table")
        info = index.tensors.get(name)
        if info is None or len(info.shape) != 2:
            raise _Bad(f"{show(name)} is not a two-dimensional tensor of the checkpoint")
        if not isinstance(t, dict):
            raise _Bad(f"{show(name)} must be an object")
        try:
            rows = _int(t, "chunk_rows", 1, 1 << 40)
            sums = t.get("checksums")
            want = -(-info.shape[0] // rows)
            if not isinstance(sums, list) or len(sums) != want:
                raise _Bad(f"checksums must be a list of {want} entries")
            if not all(isinstance(c, str) and _CHECKSUM_RE.match(c) for c in sums):
                raise _Bad("every checksum must be 'crc32:' and 8 lowercase hex digits")
        except _Bad as exc:
            raise _Bad(f"{show(name)}: {exc}") from None
        out[name] = TableChecksums(name, rows, tuple(sums))
    return out


def _parse_root(doc: Any, root: Path) -> TrunkManifest:
    if not isinstance(doc, dict):
        raise _Bad(f"must be a JSON object, got {_kind(doc)}")
    if doc.get("format") != FORMAT:
        raise _Bad(f"format must be {FORMAT!r}, got {_kind(doc.get('format'))}")
    version = _int(doc, "version", 0, 1 << 31)
    if version not in (VERSION, VERSION_CODEC):
        raise _Bad(f"version {version} is not supported (this k3 reads versions {VERSION} "
                   f"and {VERSION_CODEC}); repack the trunk")
    codec = doc.get("codec") if version == VERSION_CODEC else "none"
    if version == VERSION_CODEC and codec is None:
        raise _Bad(f"version {VERSION_CODEC} is a compressed trunk but names no codec")
    if version == VERSION and "codec" in doc:
        raise _Bad(f"a version {VERSION} trunk has no codec; repack the trunk")
    if not isinstance(codec, str) or codec not in CODEC_NAMES or (
            version == VERSION_CODEC and codec == "none"):
        raise _Bad(f"codec {_kind(codec)} is not one this k3 decodes (known: "
                   f"{', '.join(CODEC_NAMES[1:])}); repack the trunk or upgrade k3")
    align = _int(doc, "align", 1, 1 << 30)
    if align != ALIGN:
        raise _Bad(f"align must be {ALIGN}, got {align}; repack the trunk")
    n = _int(doc, "n_layers", 1, MAX_LAYERS)
    total = _int(doc, "total_bytes")
    fp = doc.get("source_fingerprint")
    if not isinstance(fp, str) or not _HEX64.match(fp):
        raise _Bad("source_fingerprint must be 64 lowercase hex digits")
    sample = doc.get("source_sample")
    if not isinstance(sample, str) or not sample.startswith("sha256:") or not _HEX64.match(
            sample[7:]):
        raise _Bad("source_sample must be 'sha256:' and 64 lowercase hex digits")
    cfp = doc.get("config_fingerprint")
    if (not isinstance(cfp, list) or len(cfp) > 64
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in cfp)):
        raise _Bad("config_fingerprint must be a list of integers")
    raw_layers = doc.get("layers")
    if not isinstance(raw_layers, list):
        raise _Bad(f"layers must be a list, got {_kind(raw_layers)}")
    if len(raw_layers) != n:
        raise _Bad(f"n_layers is {n} but layers lists {len(raw_layers)}")
    layers: list[TrunkLayer | None] = [None] * n
    for i, raw in enumerate(raw_layers):
        try:
            lay = _parse_layer(raw, n, total, codec != "none")
        except _Bad as exc:
            raise _Bad(f"layers[{i}]: {exc}") from None
        if layers[lay.layer] is not None:
            raise _Bad(f"layer {lay.layer} is listed twice")
        layers[lay.layer] = lay
    done = [lay for lay in layers if lay is not None]  # all present: n entries, no repeats
    runs = sorted(done, key=lambda lay: lay.file_off)
    for a, b in pairwise(runs):
        if a.file_off + a.disk_nbytes > b.file_off:
            raise _Bad(f"layer {a.layer}'s run overlaps layer {b.layer}'s in {DATA_NAME}")
    return TrunkManifest(root, align, tuple(done), fp, sample, tuple(cfp), total, codec=codec)


def _parse_layer(raw: Any, n: int, total: int, compressed: bool) -> TrunkLayer:
    if not isinstance(raw, dict):
        raise _Bad(f"must be an object, got {_kind(raw)}")
    L = _int(raw, "layer", 0, n - 1)
    try:
        off = _int(raw, "file_off")
        nbytes = _int(raw, "nbytes", ALIGN)
        span = _int(raw, "span", 1)
        if off % ALIGN or nbytes % ALIGN:
            raise _Bad(f"file_off {off} and nbytes {nbytes} must be multiples of {ALIGN}")
        if not nbytes - ALIGN < span <= nbytes:
            raise _Bad(f"span {span} does not pad to nbytes {nbytes} (align {ALIGN})")
        stored = file_nbytes = 0
        if compressed:
            stored = _int(raw, "stored", 1)
            file_nbytes = _int(raw, "file_nbytes", ALIGN)
            if file_nbytes % ALIGN or not file_nbytes - ALIGN < stored <= file_nbytes:
                raise _Bad(f"stored {stored} does not pad to file_nbytes {file_nbytes} "
                           f"(align {ALIGN})")
        elif "windows" in raw:
            raise _Bad("has a window table but the trunk has no codec")
        disk = file_nbytes if compressed else nbytes
        if off + disk > total:
            raise _Bad(f"run [{off}, {off + disk}) ends past total_bytes {total}")
        checksum = raw.get("checksum")
        if not isinstance(checksum, str) or not _CHECKSUM_RE.match(checksum):
            raise _Bad("checksum must be 'crc32:' and 8 lowercase hex digits")
        tensors = raw.get("tensors")
        if not isinstance(tensors, dict) or not tensors:
            raise _Bad("tensors must be a non-empty object")
        if len(tensors) > MAX_TENSORS_PER_LAYER:
            raise _Bad(f"{len(tensors)} tensors is more than {MAX_TENSORS_PER_LAYER}")
        parsed = {name: _parse_tensor(name, t, L, span) for name, t in tensors.items()}
        ordered = sorted(parsed.values(), key=lambda t: (t.off, t.nbytes))
        for a, b in pairwise(ordered):
            if a.off + a.nbytes > b.off:
                raise _Bad(f"tensors {show(a.name)} and {show(b.name)} overlap")
        windows: tuple[Window, ...] = ()
        if compressed:
            try:
                windows = parse_windows(raw.get("windows"), span, stored, [
                    (t.off, t.nbytes, t.np_dtype.itemsize) for t in ordered])
            except WindowTableError as exc:
                raise _Bad(str(exc)) from None
    except _Bad as exc:
        raise _Bad(f"layer {L}: {exc}") from None
    return TrunkLayer(L, off, nbytes, span, checksum, parsed, stored, file_nbytes, windows)


def _parse_tensor(name: str, t: Any, L: int, span: int) -> TrunkTensor:
    split = names.split_layer_name(name)
    if split is None or split[0] != L or names.is_routed_expert(split[1]):
        raise _Bad(f"tensor {show(name)} is not a trunk tensor of layer {L}")
    if not isinstance(t, dict):
        raise _Bad(f"tensor {show(name)} must be an object")
    try:
        off = _int(t, "off")
        nbytes = _int(t, "nbytes")
        dtype = t.get("dtype")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise _Bad(f"dtype must be one of {', '.join(DTYPES)}, got {_kind(dtype)}")
        shape = t.get("shape")
        if (not isinstance(shape, list) or len(shape) > MAX_RANK or not all(
                isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 40
                for x in shape)):
            raise _Bad(f"shape must be a list of at most {MAX_RANK} non-negative integers")
        if math.prod(shape) * DTYPES[dtype].itemsize != nbytes:
            raise _Bad(f"shape {shape} of {dtype} is not {nbytes} bytes")
        if off + nbytes > span:
            raise _Bad(f"[{off}, {off + nbytes}) escapes its run of {span} bytes")
    except _Bad as exc:
        raise _Bad(f"tensor {show(name)}: {exc}") from None
    return TrunkTensor(name, off, nbytes, dtype, tuple(shape))


def _check_against_index(lay: TrunkLayer, index: CheckpointIndex, cfg: ModelConfig | None) -> None:
    """Same tensors, dtypes, shapes, sizes and relative positions as in the checkpoint."""
    if cfg is not None:
        for s in trunk_suffixes(cfg, lay.layer):
            if names.layer_name(lay.layer, s) not in lay.tensors:
                raise _Bad(f"tensor {names.layer_name(lay.layer, s)} is missing")
    base: int | None = None
    for t in lay.tensors.values():
        info = index.tensors.get(t.name)
        if info is None:
            raise _Bad(f"tensor {show(t.name)} is not in the checkpoint")
        if (info.dtype, info.shape, info.nbytes) != (t.dtype, t.shape, t.nbytes):
            raise _Bad(f"tensor {show(t.name)} is {t.dtype} {list(t.shape)} here but "
                       f"{info.dtype} {list(info.shape)} in the checkpoint")
        rel = info.offset - t.off
        if base is None:
            base = rel
        elif rel != base:
            raise _Bad(f"tensor {show(t.name)} is not where the verbatim copy puts it")


def run_source(lay: TrunkLayer, index: CheckpointIndex) -> tuple[Path, int]:
    """The shard and absolute start of a checked layer's run in the checkpoint."""
    t = next(iter(lay.tensors.values()))
    info = index.info(t.name)
    return info.path, info.offset - t.off


def _check_bin(man: TrunkManifest) -> None:
    path = man.bin_path
    try:
        st = os.stat(path)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot open the packed trunk: "
                              f"{exc.strerror or exc}") from None
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: not a regular file")
    if st.st_size != man.total_bytes:
        raise CheckpointError(f"{path} is {st.st_size} bytes but {MANIFEST_NAME} says "
                              f"{man.total_bytes}; truncated or replaced, repack the trunk")


def checksum_failure(man: TrunkManifest, lay: TrunkLayer, crc: int) -> str | None:
    """``None`` when ``crc``, the CRC-32 of the layer's ``span`` bytes, is its checksum; else
    the message of the ``CheckpointError`` that refuses the layer."""
    got = crc_tag(crc)
    if got == lay.checksum:
        return None
    return (f"{man.bin_path}: layer {lay.layer} fails its checksum ({got}, manifest "
            f"{lay.checksum}); the file is damaged, repack the trunk")


def verify_trunk(man: TrunkManifest, storage: StorageBackend,
                 progress: Callable[[int, int], None] | None = None) -> None:
    """Re-read every run and compare its checksum; ``CheckpointError`` on a mismatch."""
    layer_crc = _coded_crc(man) if man.compressed else _raw_crc(man)
    f = storage.open(man.bin_path)
    try:
        for lay in man.layers:
            try:
                crc = layer_crc(f, lay)
            except StorageError as exc:
                raise CheckpointError(f"{man.bin_path}: layer {lay.layer}: "
                                      f"{exc.message}") from None
            problem = checksum_failure(man, lay, crc)
            if problem is not None:
                raise CheckpointError(problem)
            if progress:
                progress(lay.layer + 1, man.n_layers)
    finally:
        f.close()


def _raw_crc(man: TrunkManifest) -> Callable[[StorageFile, TrunkLayer], int]:
    """The CRC-32 of a layer's ``span`` bytes, read in chunks of :data:`VERIFY_CHUNK`."""
    buf = aligned_empty(min(VERIFY_CHUNK, max(lay.nbytes for lay in man.layers)), ALIGN)

    def layer_crc(f: StorageFile, lay: TrunkLayer) -> int:
        crc = done = 0
        while done < lay.span:
            n = min(buf.nbytes, align_up(lay.span - done))
            f.read_into(lay.file_off + done, buf[:n])
            crc = zlib.crc32(buf[: min(n, lay.span - done)].data, crc)
            done += n
        return crc

    return layer_crc


def _coded_crc(man: TrunkManifest) -> Callable[[StorageFile, TrunkLayer], int]:
    """The CRC-32 of a compressed layer's raw bytes: every window decoded, in order."""
    codec = codec_for_manifest(man.codec)
    staging = aligned_empty(max(staging_bytes(lay.windows) for lay in man.layers), ALIGN)
    scratch = np.empty(max(w.raw_len for lay in man.layers for w in lay.windows), np.uint8)

    def layer_crc(f: StorageFile, lay: TrunkLayer) -> int:
        crc = 0
        src = CodedWindows(f, man.bin_path, lay.layer, lay.file_off, lay.windows, codec)
        for w in staged_windows(src, staging, lambda w: scratch[: w.raw_len]):
            crc = zlib.crc32(scratch[: w.raw_len].data, crc)
        return crc

    return layer_crc
