"""``k3 bench codec``: ratio and decode speed of each trunk codec on a model's own bytes.

The bytes measured are those ``k3 pack-trunk`` would pack: for a model directory with a
config, every layer's trunk run cut into the same windows the packer uses
(:func:`k3core.trunk.windows.plan_windows`); for a directory of safetensors shards without
a usable config, every tensor that is not a routed expert, one run each. At most
``max_bytes`` raw bytes are taken, whole runs spread evenly over the walk.

Per codec it encodes every window once (a window whose encoding is not smaller is stored
raw, as the packer does), then decodes every window into a destination buffer with the
engine's own decoder (:meth:`k3core.trunk.codec.Codec.decode_into`) on one thread,
``repeat`` times, and keeps the fastest pass: decode GB/s is raw bytes produced per second
per core. Every decoded window is compared with its raw bytes before a figure is kept. The
CRC-32 speed (what the reader pays per raw byte already) and a plain copy are the
yardsticks in the same run. From ratio ``r`` and decode speed ``d`` it also gives the raw
trunk bytes per second one reader thread delivers from a disk of ``D`` GB/s: the reader
reads the next chunk while it decodes this one, so that is ``min(r * D, d)`` against ``D``
for an uncompressed trunk (``disks``: 0.5, 2 and 6 GB/s unless told, a SATA SSD and two
NVMe generations).
"""

from __future__ import annotations

import json
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from k3core.api.errors import K3Error, UsageError
from k3core.checkpoint.index import CheckpointIndex
from k3core.model import names
from k3core.trunk.codec import Codec, parse_codec
from k3core.trunk.windows import WINDOW_BYTES, plan_windows

DEFAULT_CODECS = ("bp-bits", "bp-nib", "lz4", "zstd:0", "zstd:1", "zstd:3", "zstd:9", "bp-lz4", "bp-zstd:0",
                  "bp-zstd:1", "bp-zstd:3", "bp-zstd:9", "bp-zstd:19")
DEFAULT_MAX_BYTES = 256 * 10**6
DEFAULT_DISKS = (0.5, 2.0, 6.0)


@dataclass
class CodecResult:
    codec: str
    ratio: float
    stored_bytes: int
    windows_raw: int  # windows stored raw (their encoding was not smaller)
    encode_mb_s: float
    decode_gb_s: float
    #: raw GB/s one reader delivers from each of ``CodecBench.disks_gb_s``
    delivered_gb_s: list[float]


@dataclass
class CodecBench:
    source: str
    what: str
    raw_bytes: int
    runs: int
    windows: int
    window_bytes: int
    bf16_share: float
    crc32_gb_s: float
    copy_gb_s: float
    disks_gb_s: list[float]
    results: list[CodecResult] = field(default_factory=list)
    full_windows: int = 0
    full_results: list[CodecResult] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def _runs(index: CheckpointIndex, model_dir: Path) -> tuple[str, list[list[tuple[int, int, int, Path, int]]]]:
    """Runs of tensors ``(off, nbytes, itemsize, shard, absolute offset)`` to measure."""
    try:
        from k3core.model.config import load_config
        from k3core.run.model_dir import config_path
        from k3core.trunk.pack import plan_pack

        cfg = load_config(config_path(model_dir, None))
        runs = plan_pack(index, cfg)
        return "the trunk runs k3 pack-trunk packs", [
            [(t.offset - r.start, t.nbytes, t.np_dtype.itemsize, t.path, t.offset)
             for t in r.tensors] for r in runs]
    except K3Error:
        pass
    out = []
    for name in index:
        split = names.split_layer_name(name)
        if split is not None and names.is_routed_expert(split[1]):
            continue
        t = index.info(name)
        if t.nbytes:
            out.append([(0, t.nbytes, t.np_dtype.itemsize, t.path, t.offset)])
    return "every tensor that is not a routed expert (no usable config)", out


def _spread(runs: list[list[tuple[int, int, int, Path, int]]], max_bytes: int
            ) -> list[list[tuple[int, int, int, Path, int]]]:
    sizes = [sum(t[1] for t in r) for r in runs]
    if sum(sizes) <= max_bytes:
        return runs
    keep: list[list[tuple[int, int, int, Path, int]]] = []
    step = max(1, round(len(runs) * np.mean(sizes) / max(1, max_bytes)))
    total = 0
    for i in range(0, len(runs), step):
        if keep and total + sizes[i] > max_bytes:
            break
        keep.append(runs[i])
        total += sizes[i]
    return keep


def _best(fn: object, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def run_codec_bench(target: Path, specs: list[str], max_bytes: int = DEFAULT_MAX_BYTES,
                    repeat: int = 3, window: int = WINDOW_BYTES,
                    disks: tuple[float, ...] = DEFAULT_DISKS) -> CodecBench:
    """Measure every codec of ``specs`` on ``target``'s bytes (see the module docstring)."""
    if not target.is_dir():
        raise UsageError(f"bench codec: {target} is not a directory of safetensors shards")
    codecs: list[Codec] = [parse_codec(s) for s in specs]
    if repeat < 1 or max_bytes < 1 or window < 2:
        raise UsageError("bench codec: --repeat, --max-mb and --window-kb must be positive")
    from k3core.plugins.registry import get_registry

    storage, _, _ = get_registry().create("storage", "plain")
    with CheckpointIndex.open(target, storage) as index:
        what, runs = _runs(index, target)
        runs = _spread(runs, max_bytes)
        if not runs:
            raise UsageError(f"bench codec: {target} holds no tensor to measure")
        wins: list[tuple[np.ndarray, int]] = []
        for r in runs:
            base = r[0][4] - r[0][0]
            span = max(t[0] + t[1] for t in r)
            data = index.read_range(r[0][3], base, span)
            for a, n, item in plan_windows([(t[0], t[1], t[2]) for t in sorted(r)], window):
                wins.append((np.array(data[a : a + n]), item))
    raw = sum(w.size for w, _ in wins)
    bf16 = sum(w.size for w, item in wins if item == 2)
    out_buf = np.empty(max(w.size for w, _ in wins), np.uint8)

    def crc_all() -> None:
        for w, _ in wins:
            zlib.crc32(w.data)

    def copy_all() -> None:
        for w, _ in wins:
            out_buf[: w.size] = w

    bench = CodecBench(str(target), what, raw, len(runs), len(wins), window, bf16 / raw,
                       raw / _best(crc_all, repeat) / 1e9, raw / _best(copy_all, repeat) / 1e9,
                       list(disks))
    bench.results = _measure(codecs, wins, repeat, disks)
    two_byte = np.concatenate([w for w, item in wins if item == 2] or [np.empty(0, np.uint8)])
    full = [(two_byte[a : a + window], 2) for a in range(0, two_byte.size - window + 1, window)]
    if full:
        bench.full_windows = len(full)
        bench.full_results = _measure(codecs, full, repeat, disks)
    return bench


def _measure(codecs: list[Codec], wins: list[tuple[np.ndarray, int]], repeat: int,
             disks: tuple[float, ...]) -> list[CodecResult]:
    raw = sum(w.size for w, _ in wins)
    out_buf = np.empty(max(w.size for w, _ in wins), np.uint8)
    results = []
    for c in codecs:
        t0 = time.perf_counter()
        enc: list[bytes | None] = []
        for w, item in wins:
            coded = c.encode(w, item)
            enc.append(coded if len(coded) < w.size else None)
        enc_s = max(time.perf_counter() - t0, 1e-9)
        for (w, item), e in zip(wins, enc, strict=True):  # check every window's bits once
            if e is not None:
                c.decode_into(memoryview(e), out_buf[: w.size], item)
                if not np.array_equal(out_buf[: w.size], w):
                    raise K3Error(f"bench codec: {c.spec} does not give back the same bytes")

        def decode_all(c: Codec = c, enc: list[bytes | None] = enc) -> None:
            for (w, item), e in zip(wins, enc, strict=True):
                if e is None:
                    out_buf[: w.size] = w
                else:
                    c.decode_into(memoryview(e), out_buf[: w.size], item)

        stored = sum(w.size if e is None else len(e) for (w, _), e in zip(wins, enc, strict=True))
        ratio = raw / stored
        dec = raw / _best(decode_all, repeat) / 1e9
        results.append(CodecResult(c.spec, ratio, stored, sum(e is None for e in enc),
                                   raw / enc_s / 1e6, dec, [min(ratio * d, dec) for d in disks]))
    return results


def _table(results: list[CodecResult], disks: list[float]) -> list[str]:
    lines = [f"  {'codec':<12} {'ratio':>7} {'stored MB':>10} {'raw win':>8} {'encode MB/s':>12} "
             f"{'decode GB/s/core':>17}" + "".join(f" {f'@{d:g} GB/s':>10}" for d in disks)]
    for r in results:
        lines.append(f"  {r.codec:<12} {r.ratio:>7.3f} {r.stored_bytes / 1e6:>10.2f} "
                     f"{r.windows_raw:>8} {r.encode_mb_s:>12.1f} {r.decode_gb_s:>17.2f}"
                     + "".join(f" {x:>10.2f}" for x in r.delivered_gb_s))
    return lines


def format_lines(b: CodecBench) -> list[str]:
    lines = [f"k3 bench codec: {b.source}: {b.what}",
             f"  {b.raw_bytes / 1e6:.2f} MB raw in {b.runs} runs, {b.windows} windows of at most "
             f"{b.window_bytes // 1024} KiB, {100 * b.bf16_share:.1f} % in two-byte tensors",
             f"  yardsticks (one core): CRC-32 {b.crc32_gb_s:.2f} GB/s, copy {b.copy_gb_s:.2f} GB/s",
             "  the packer's windows on this model:"]
    lines += _table(b.results, b.disks_gb_s)
    if b.full_results:
        lines.append(f"  the same two-byte tensors' bytes as {b.full_windows} full windows (the "
                     "windows of a trunk whose tensors are larger than a window, as Kimi K3's):")
        lines += _table(b.full_results, b.disks_gb_s)
    lines.append("  @D GB/s: raw trunk GB/s one reader thread delivers from a disk of D GB/s, "
                 "min(ratio x D, decode), against D uncompressed")
    return lines
