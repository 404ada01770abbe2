"""Packing the trunk: every layer's non-expert tensors, verbatim, into one aligned file.

In the released layout each layer's trunk tensors already sit in one contiguous run inside
one shard, so packing is one range copy per layer: layer ``L``'s run goes to a 4096-aligned
offset of ``trunk.bin`` and is padded with zeros to a multiple of 4096 (see
:mod:`k3core.trunk.manifest` for ``trunk.json``). A layer whose trunk tensors span two
shards, or leave a gap (which would drag expert bytes along), is refused before anything
is written. Bytes are read through a storage backend in bounded chunks and checksummed
(CRC-32 of the unpadded run) on the way. Holes stay holes: only the data extents of a
sparse shard are read and written (:mod:`k3core.trunk.holes`), the padding is never
written, and the checksum still covers every raw byte, so a sparse checkpoint
(``k3 synth --sparse``) packs into a sparse ``trunk.bin``.

Atomic: ``trunk.bin`` and ``trunk.json`` are written under partial names
(``.trunk.bin.partial-PID``, :mod:`k3core.api.partials`) and fsynced; an old ``trunk.json``
is removed, then the new ``trunk.bin`` and ``trunk.json`` are renamed into place, in that
order. Whatever fails or is interrupted, the directory never holds a manifest that
describes bytes it does not have. A write failure (full disk, unwritable directory) is an
``OutputError`` (exit 3) and leaves no partial file behind, nor the directory if the pack
made it; so do Ctrl-C, SIGTERM and SIGHUP. A pack killed outright (SIGKILL) leaves its
partial; the next pack into the directory removes it (naming it on stderr) unless its
process still runs. A full disk is named with the bytes the trunk needs, what is free and
the partial files of other packs still taking room.

TRUNK_DIR may not be MODEL_DIR or lie inside it (or inside ``--config``'s path), checked
before anything is written (:func:`k3core.api.outputs.check_outputs`, exit 3).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from k3core.api.errors import CheckpointError, OutputError, StorageError, UsageError
from k3core.api.outputs import InputSpec, Output, check_outputs
from k3core.api.partials import Partials, partial_path, space_note, sweep_stale
from k3core.api.storage import StorageBackend, aligned_empty
from k3core.api.units import ALIGN, align_up
from k3core.checkpoint.bounds import check_bind_shapes
from k3core.checkpoint.index import CheckpointIndex, TensorInfo
from k3core.model import names
from k3core.model.config import ModelConfig
from k3core.model.layer_params import trunk_suffixes
from k3core.trunk.codec import Codec
from k3core.trunk.crc import crc32_zeros
from k3core.trunk.holes import data_segments
from k3core.trunk.manifest import (
    DATA_NAME,
    MANIFEST_NAME,
    TableChecksums,
    TrunkLayer,
    TrunkManifest,
    TrunkTensor,
    crc_tag,
    table_chunk_rows,
)
from k3core.trunk.sample import source_sample
from k3core.trunk.windows import Window, plan_windows

#: bytes copied per read (bounds the packer's memory whatever the layer size)
COPY_CHUNK = 64 * 1024 * 1024

NO_CODEC = Codec("none", 0)
#: the files a packed trunk directory holds
PACKED_FILES = (DATA_NAME, MANIFEST_NAME)

PackProgress = Callable[[int, int, int, int], None]  # (layers done, layers, bytes done, total)


@dataclass(frozen=True)
class LayerRun:
    """Where one layer's trunk tensors sit in the checkpoint: one shard, one run."""

    layer: int
    path: Path
    start: int  # absolute offset of the first tensor in the shard
    span: int
    tensors: tuple[TensorInfo, ...]

    @property
    def nbytes(self) -> int:
        return align_up(self.span)


def layer_run(index: CheckpointIndex, cfg: ModelConfig, layer: int) -> LayerRun:
    """Find layer ``layer``'s run; refuse two shards or a gap."""
    infos = []
    for s in trunk_suffixes(cfg, layer):
        name = names.layer_name(layer, s)
        if name not in index:
            raise CheckpointError(f"layer {layer}: trunk tensor {name} is not in the checkpoint")
        infos.append(index.info(name))
    paths = sorted({i.path.name for i in infos})
    if len(paths) > 1:
        raise CheckpointError(f"layer {layer}: trunk tensors span {len(paths)} shards "
                              f"({', '.join(paths[:4])}); a packed layer must be one run "
                              "inside one shard")
    infos.sort(key=lambda i: (i.offset, i.nbytes))
    start = infos[0].offset
    span = max(i.offset + i.nbytes for i in infos) - start
    covered = sum(i.nbytes for i in infos)
    if covered != span:
        raise CheckpointError(f"layer {layer}: trunk tensors are not one contiguous run: "
                              f"{span - covered} bytes of gap (packing would drag expert "
                              "bytes along)")
    return LayerRun(layer, infos[0].path, start, span, tuple(infos))


def plan_pack(index: CheckpointIndex, cfg: ModelConfig) -> list[LayerRun]:
    check_bind_shapes(cfg, index, cfg.n_layers)  # a layer claiming terabytes is not copied
    return [layer_run(index, cfg, L) for L in range(cfg.n_layers)]


def pack_trunk(
    index: CheckpointIndex,
    cfg: ModelConfig,
    trunk_dir: str | Path,
    storage: StorageBackend,
    *,
    force: bool = False,
    progress: PackProgress | None = None,
    codec: Codec = NO_CODEC,
    reads: Iterable[InputSpec] = (),
) -> TrunkManifest:
    """Pack every layer of ``index`` into ``trunk_dir``; returns the manifest written.

    With a ``codec`` other than ``none`` each layer is cut into windows and every window
    encoded on its own (:mod:`k3core.trunk.windows`); the checksums stay those of the raw
    bytes. ``trunk_dir`` may not be MODEL_DIR or lie inside it, nor inside any of
    ``reads`` (more inputs: ``--config``), and its two files may not be one of them."""
    out = Path(trunk_dir)
    runs = plan_pack(index, cfg)
    check_target(index, out, force, reads)
    created = not out.exists()
    with Partials() as parts:
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OutputError(f"cannot write the packed trunk to {out}: "
                              f"{exc.strerror or exc}") from None
        if created:  # a pack stopped before its manifest is in place leaves no directory
            parts.add(out, tree=True)
        tmp_bin = parts.add(partial_path(out / DATA_NAME))
        tmp_json = parts.add(partial_path(out / MANIFEST_NAME))
        try:
            layers = (_write_bin(tmp_bin, runs, storage, progress) if codec.name == "none"
                      else _write_bin_coded(tmp_bin, runs, storage, progress, codec))
            sample = source_sample(index, ((r.path, r.start, r.span) for r in runs))
            tables = {n: table_checksums(index, n) for n in (names.EMBED, names.LM_HEAD)
                      if n in index}
            man = TrunkManifest(out, ALIGN, tuple(layers), index.fingerprint(), sample,
                                tuple(cfg.fingerprint()), sum(lay.disk_nbytes for lay in layers),
                                tables, codec=codec.name)
            _write_file(tmp_json, json.dumps(man.to_json(), indent=1).encode() + b"\n")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(out / MANIFEST_NAME)
            os.replace(tmp_bin, out / DATA_NAME)
            parts.keep(tmp_bin)
            os.replace(tmp_json, out / MANIFEST_NAME)
            parts.keep(tmp_json)
            parts.keep(out)
            _fsync_dir(out)
        except OSError as exc:
            msg = f"cannot write the packed trunk to {out}: {exc.strerror or exc}"
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                needed = sum(r.nbytes for r in runs) if codec.name == "none" else None
                note = space_note(out, PACKED_FILES, needed)
                msg += f" ({note})" if note else ""
            raise OutputError(msg) from None
    return man


def check_target(index: CheckpointIndex, out: Path, force: bool,
                 reads: Iterable[InputSpec] = ()) -> None:
    """Refuse a trunk directory ``pack_trunk`` may not write (MODEL_DIR or inside it, inside
    one of ``reads``, or holding a packed trunk without ``force``); sweep stale partials."""
    check_outputs([Output(out, "the packed trunk", directory=True, files=PACKED_FILES,
                          create=False)], inputs=[(index.model_dir, "MODEL_DIR"), *reads])
    if out.is_dir():
        sweep_stale(out, PACKED_FILES)
    if (out / MANIFEST_NAME).exists() or (out / DATA_NAME).exists():
        if not force:
            raise UsageError(f"{out} already holds a packed trunk; pass --force to replace it")


def table_checksums(index: CheckpointIndex, name: str) -> TableChecksums:
    """CRC-32s of table ``name`` in the checkpoint, one per ``table_chunk_rows`` rows."""
    info = index.info(name)
    rows = info.shape[0]
    row = info.nbytes // max(1, rows)
    per = table_chunk_rows(row)
    sums = []
    step = max(per, COPY_CHUNK // max(1, row) // per * per)  # read up to 64 MiB at a time
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        data = index.read_range(info.path, info.offset + r0 * row, (r1 - r0) * row)
        for c0 in range(0, r1 - r0, per):
            c1 = min(r1 - r0, c0 + per)
            sums.append(crc_tag(zlib.crc32(data[c0 * row : c1 * row].data)))
    return TableChecksums(name, per, tuple(sums))


def _write_bin(path: Path, runs: list[LayerRun], storage: StorageBackend,
               progress: PackProgress | None) -> list[TrunkLayer]:
    total = sum(r.nbytes for r in runs)
    segments = [data_segments(r.path, r.start, r.span) for r in runs]
    dense = all(sum(n for _, n in s) == r.span for s, r in zip(segments, runs, strict=True))
    buf = aligned_empty(min(COPY_CHUNK, max(r.nbytes for r in runs)), ALIGN)
    layers: list[TrunkLayer] = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_BINARY", 0), 0o666)
    try:
        pos = 0
        if dense:
            _reserve(fd, 0, total)
        else:  # a sparse source: reserve (and write) its data extents only, holes stay holes
            for r, segs in zip(runs, segments, strict=True):
                for off, n in segs:
                    _reserve(fd, pos + off - r.start, n)
                pos += r.nbytes
            pos = 0
        for r, segs in zip(runs, segments, strict=True):
            crc = _copy_run(fd, r, segs, pos, storage, buf)
            tensors = {t.name: TrunkTensor(t.name, t.offset - r.start, t.nbytes, t.dtype, t.shape)
                       for t in r.tensors}
            layers.append(TrunkLayer(r.layer, pos, r.nbytes, r.span, crc_tag(crc), tensors))
            pos += r.nbytes
            if progress:
                progress(r.layer + 1, len(runs), pos, total)
        os.ftruncate(fd, total)  # the padding (and any trailing hole) reads as zeros
        os.fsync(fd)
    finally:
        os.close(fd)
    return layers


def _write_bin_coded(path: Path, runs: list[LayerRun], storage: StorageBackend,
                     progress: PackProgress | None, codec: Codec) -> list[TrunkLayer]:
    """Like ``_write_bin``, each layer's windows encoded (on every core) as they are copied."""
    raw_total = sum(r.nbytes for r in runs)
    buf = aligned_empty(min(COPY_CHUNK, max(r.nbytes for r in runs)), ALIGN)
    layers: list[TrunkLayer] = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="k3-pack") as pool:
            pos = raw_done = 0
            for r in runs:
                crc, stored, windows = _encode_run(fd, r, storage, buf, codec, pool)
                padded = align_up(stored)
                if padded > stored:
                    _write_all(fd, memoryview(bytes(padded - stored)))
                tensors = {t.name: TrunkTensor(t.name, t.offset - r.start, t.nbytes, t.dtype,
                                               t.shape) for t in r.tensors}
                layers.append(TrunkLayer(r.layer, pos, r.nbytes, r.span, crc_tag(crc), tensors,
                                         stored, padded, windows))
                pos += padded
                raw_done += r.nbytes
                if progress:
                    progress(r.layer + 1, len(runs), raw_done, raw_total)
        os.fsync(fd)
    finally:
        os.close(fd)
    return layers


def _encode_run(fd: int, r: LayerRun, storage: StorageBackend, buf: np.ndarray, codec: Codec,
                pool: ThreadPoolExecutor) -> tuple[int, int, tuple[Window, ...]]:
    """Copy one run as encoded windows; returns (CRC-32 of the raw span, stored, windows)."""
    plan = plan_windows([(t.offset - r.start, t.nbytes, t.np_dtype.itemsize)
                         for t in r.tensors])
    try:
        src = storage.open(r.path)
    except (StorageError, OSError) as exc:
        raise CheckpointError(f"{r.path}: cannot open: {getattr(exc, 'message', exc)}") from None
    crc = stored = 0
    windows: list[Window] = []
    try:
        i = 0
        while i < len(plan):
            j = i + 1  # a group of whole windows of at most one buffer
            while j < len(plan) and plan[j][0] + plan[j][1] - plan[i][0] <= buf.nbytes:
                j += 1
            g0 = plan[i][0]
            n = plan[j - 1][0] + plan[j - 1][1] - g0
            src.read_into(r.start + g0, buf[:n])
            crc = zlib.crc32(buf[:n].data, crc)

            def enc(w: tuple[int, int, int], g0: int = g0) -> bytes:
                raw = buf[w[0] - g0 : w[0] - g0 + w[1]]
                out = codec.encode(raw, w[2])
                return out if len(out) < w[1] else raw.tobytes()  # never larger than raw

            for w, data in zip(plan[i:j], pool.map(enc, plan[i:j]), strict=True):
                _write_all(fd, memoryview(data))
                windows.append(Window(w[0], w[1], stored, len(data), w[2]))
                stored += len(data)
            i = j
    except StorageError as exc:
        raise StorageError(f"packing layer {r.layer}: {exc.message}") from None
    finally:
        src.close()
    return crc, stored, tuple(windows)


def _copy_run(fd: int, r: LayerRun, segments: list[tuple[int, int]], dest: int,
              storage: StorageBackend, buf: np.ndarray) -> int:
    """Copy the data extents of ``r`` to ``dest`` onward; the CRC-32 covers every byte."""
    try:
        src = storage.open(r.path)
    except (StorageError, OSError) as exc:
        raise CheckpointError(f"{r.path}: cannot open: {getattr(exc, 'message', exc)}") from None
    crc = 0
    cursor = r.start
    try:
        for off, length in segments:
            crc = crc32_zeros(crc, off - cursor)
            done = 0
            while done < length:
                n = min(buf.nbytes, length - done)
                src.read_into(off + done, buf[:n])
                crc = zlib.crc32(buf[:n].data, crc)
                _pwrite_all(fd, buf[:n].data, dest + off - r.start + done)
                done += n
            cursor = off + length
        crc = crc32_zeros(crc, r.start + r.span - cursor)
    except StorageError as exc:
        raise StorageError(f"packing layer {r.layer}: {exc.message}") from None
    finally:
        src.close()
    return crc


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        if n <= 0:
            raise OSError(errno.EIO, "write returned nothing")
        data = data[n:]
        offset += n


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        n = os.write(fd, data)
        if n <= 0:
            raise OSError(errno.EIO, "write returned nothing")
        data = data[n:]


def _reserve(fd: int, offset: int, length: int) -> None:
    """Fail early on a full disk where the filesystem can preallocate."""
    if not hasattr(os, "posix_fallocate") or length == 0:
        return
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            raise
        # EOPNOTSUPP / EINVAL: the filesystem cannot preallocate; the writes will tell


def _write_file(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_BINARY", 0), 0o666)
    try:
        _write_all(fd, memoryview(data))
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    if os.name != "posix":
        return
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
