"""``k3 pack-trunk --codec auto`` (the default): the codec a trunk streams fastest with here.

A streamed trunk is read by one reader thread that reads the next piece while it decodes
this one, so from a disk of ``D`` GB/s a codec of ratio ``r`` that decodes ``d`` GB/s of raw
bytes on one core delivers ``min(r x D, d)`` raw GB/s, against ``D`` uncompressed
(:mod:`k3core.tools.bench.codec`). Both sides are measured before packing, on this machine:

* ``D``: reads of the trunk reader's 8 MiB pieces through the storage backend the pack uses,
  at queue depths 1 and 4, from a probe file written in the trunk's directory (its nearest
  existing parent: the device the trunk will live on) and removed afterwards
  (:mod:`k3core.tools.bench.probefile`); where no probe file fits there, from the model's
  largest shard, with a note;
* ``r`` and ``d``: every candidate on a sample of the model's own trunk windows
  (``SAMPLE_BYTES``), each window decoded with the engine's decoder and checked.

The choice is the candidate that delivers most, a coded one only where it delivers at least
``MARGIN`` times the raw trunk's rate (decoding costs a core the decode step shares); a model
with no two-byte weights to code, or a disk faster than every decoder, gets ``none``. Every
figure is reported so the choice can be checked (``k3 bench codec`` measures more codecs on
more bytes).

Two trunks are packed raw without measuring: one under ``SMALL_TRUNK`` raw bytes (it fits
any budget k3 runs at; measuring would take longer than reading it), and one whose
checkpoint is more than ``HOLE_SHARE`` holes (a sparse file: the real-shape rehearsal's):
only the raw trunk copies data extents alone and keeps the holes as holes, where a coded
window of zeros is stored as data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from k3core.api.errors import UsageError
from k3core.api.outputs import existing_parent
from k3core.api.units import human
from k3core.checkpoint.index import CheckpointIndex
from k3core.model.config import ModelConfig
from k3core.tools.bench.codec import run_codec_bench
from k3core.tools.bench.io import storage_read_rate
from k3core.tools.bench.probefile import probe_file
from k3core.trunk.holes import data_segments
from k3core.trunk.pack import plan_pack

#: the codecs ``auto`` weighs against ``none`` (the fast decoders: docs/trunk.md)
CANDIDATES = ("bp-bits", "bp-nib", "lz4")
SAMPLE_BYTES = 32 * 10**6
PROBE_BYTES = 256 * 10**6
#: a coded trunk must deliver this many times the raw rate to be chosen
MARGIN = 1.05
#: a checkpoint whose trunk runs are more than this share holes is packed raw (a few
#: blocks of padding left unwritten do not count)
HOLE_SHARE = 0.01
#: a trunk under this many raw bytes is packed raw without measuring
SMALL_TRUNK = 256 * 10**6


@dataclass
class CodecChoice:
    """What ``auto`` measured and chose."""

    spec: str
    disk_gb_s: float
    disk_how: str
    #: (codec, ratio, decode GB/s on one core, raw GB/s delivered from the disk)
    rows: list[tuple[str, float, float, float]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        if not self.rows:  # chosen without measuring
            return [f"codec auto: chose {self.spec}: " + "; ".join(self.notes)]
        out = [f"codec auto: the disk reads {self.disk_gb_s:.2f} GB/s ({self.disk_how})"]
        out += [f"  {c:<8} ratio {r:.3f}, decodes {d:.2f} GB/s a core: delivers {g:.2f} GB/s"
                for c, r, d, g in self.rows]
        out.append(f"  chose {self.spec}" + (" (raw delivers the disk's rate)"
                                              if self.spec == "none" else ""))
        return out + [f"  note: {n}" for n in self.notes]


def disk_rate(trunk_dir: Path, shards: list[Path], storage: str) -> tuple[float, str, list[str]]:
    """The read rate (GB/s) of the device ``trunk_dir`` will live on, how, and notes (the
    largest of ``shards`` is read where no probe file fits there)."""
    where = existing_parent(trunk_dir)
    try:
        with probe_file(where if where.is_dir() else where.parent, PROBE_BYTES) as (path, notes):
            rate, how = storage_read_rate(storage, path, (1, 4), most_reads=24)
            return rate, how, notes
    except UsageError as exc:
        largest = max(shards, key=lambda p: p.stat().st_size)
        rate, how = storage_read_rate(storage, largest, (1, 4), most_reads=24)
        return rate, how, [f"no probe file in the trunk's directory ({exc}); measured the "
                           "model's largest shard instead"]


def choose_codec(index: CheckpointIndex, cfg: ModelConfig, trunk_dir: Path,
                 storage: str) -> CodecChoice:
    """Measure the disk and the candidates (see the module docstring) and choose."""
    runs = plan_pack(index, cfg)
    raw = sum(r.nbytes for r in runs)
    if raw < SMALL_TRUNK:
        return CodecChoice("none", 0.0, "", notes=[
            f"a trunk of {human(raw)} is packed raw (under {human(SMALL_TRUNK)}, it streams "
            "from any disk faster than it would be measured)"])
    data = sum(n for r in runs for _, n in data_segments(r.path, r.start, r.nbytes))
    if raw - data > HOLE_SHARE * raw:
        return CodecChoice("none", 0.0, "", notes=[
            f"the checkpoint has holes ({human(raw - data)} of the trunk's {human(raw)}); "
            "only a raw trunk keeps them as holes"])
    rate, how, notes = disk_rate(trunk_dir, list(index.shards), storage)
    bench = run_codec_bench(index.model_dir, list(CANDIDATES), SAMPLE_BYTES, repeat=2, disks=(rate,))
    rows = [(r.codec, r.ratio, r.decode_gb_s, r.delivered_gb_s[0]) for r in bench.results]
    best = max(rows, key=lambda row: row[3], default=None)
    spec = best[0] if best is not None and best[3] >= MARGIN * rate else "none"
    if bench.bf16_share == 0:
        notes.append("the sample holds no two-byte tensors, which are what the codecs code")
    return CodecChoice(spec, rate, how, rows, notes)
