"""The counters of a streamed trunk over a whole run: reads, waits, hits, decodes, checks.

:class:`k3core.trunk.stream.StreamedTrunk` keeps one :class:`TrunkStats`; the run report prints
its lines (``trunk [final]``, docs/engine-behaviours.md §3) and ``--out`` carries its JSON.
The counters the trunk's threads share are added to under :attr:`TrunkStats.lock`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from k3core.api.units import human


@dataclass
class TrunkStats:
    """Whole-run trunk counters (docs/engine-behaviours.md §3)."""

    n_layers: int
    pinned: int
    ring: int
    slot_bytes: int
    pinned_bytes: int
    binds: int = 0
    hits: int = 0  # binds served by a pinned layer
    reads: int = 0  # completed ring reads
    bytes_read: int = 0  # ring bytes
    read_seconds: float = 0.0  # device time inside ring reads
    exposed_wait_seconds: float = 0.0  # acquire blocked on a read
    failed_reads: int = 0
    pin_bytes: int = 0  # read once at open
    pin_seconds: float = 0.0
    verified: int = 0  # checksum checks passed (pinned at open, ring reads)
    verify_seconds: float = 0.0  # CPU time inside those checks
    verify_every: bool = False
    codec: str = "none"
    decoded_bytes: int = 0  # raw bytes decoded from a compressed trunk (ring and pinned)
    decode_seconds: float = 0.0  # time inside those reads and decodes, on their threads
    n_units: int = 0  # streaming units (a layer's parts, or whole layers)
    pinned_units: int = 0
    small_slot_bytes: int = 0  # the second, smaller slot of an unequal ring (0: none)
    #: held while a thread adds to the counters other threads add to too
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def overlapped_seconds(self) -> float:
        return max(0.0, self.read_seconds - self.exposed_wait_seconds)

    def report_lines(self) -> list[str]:
        binds = max(self.binds, 1)
        rate = self.bytes_read / self.read_seconds / 1e6 if self.read_seconds > 0 else 0.0
        lines = [
            f"trunk [final]: pinned {self.pinned}/{self.n_layers} layers"
            + (f" ({self.pinned_units}/{self.n_units} parts)" if self.n_units > self.n_layers
               else "")
            + (f", ring 2 slots ({human(self.slot_bytes)} + {human(self.small_slot_bytes)})"
               if self.small_slot_bytes else
               f", ring {self.ring} slots x {human(self.slot_bytes)}"),
            f"  binds {self.binds}, hits {self.hits} ({100 * self.hits / binds:.1f} %), "
            f"reads {self.reads}" + (f", FAILED reads {self.failed_reads}"
                                     if self.failed_reads else ""),
            f"  read {human(self.bytes_read)} in {self.read_seconds:.2f} s "
            f"({rate:.0f} MB/s); pinned load {human(self.pin_bytes)} in "
            f"{self.pin_seconds:.2f} s",
        ]
        if self.codec != "none":
            rate = self.decoded_bytes / self.decode_seconds / 1e9 if self.decode_seconds else 0.0
            lines.append(f"  codec {self.codec}: decoded {human(self.decoded_bytes)} from "
                         f"{human(self.bytes_read + self.pin_bytes)} read, "
                         f"{self.decode_seconds:.2f} s reading and decoding "
                         f"({rate:.2f} GB/s of raw bytes)")
        when = "on every read" if self.verify_every else "before first use"
        lines.append(f"  checksums: {self.verified} layer checks passed ({when}) in "
                     f"{self.verify_seconds:.2f} s")
        if self.read_seconds > 0:
            share = 100 * self.overlapped_seconds / self.read_seconds
            lines.append(f"  read = {self.read_seconds:.2f} s of device work, of which "
                         f"{self.overlapped_seconds:.2f} s ({share:.0f} %) overlapped compute "
                         f"on the reader thread; {self.exposed_wait_seconds:.2f} s exposed "
                         "waiting in acquire")
        return lines

    def to_json(self) -> dict[str, float | int | str]:
        return {
            "trunk_bytes_read": self.bytes_read + self.pin_bytes,
            "trunk_ring_bytes_read": self.bytes_read,
            "trunk_pin_bytes_read": self.pin_bytes,
            "trunk_pinned_layers": self.pinned,
            "trunk_layers": self.n_layers,
            "trunk_units": self.n_units,
            "trunk_pinned_units": self.pinned_units,
            "trunk_ring_slots": self.ring,
            "trunk_slot_bytes": self.slot_bytes,
            "trunk_small_slot_bytes": self.small_slot_bytes,
            "trunk_pinned_bytes": self.pinned_bytes,
            "trunk_binds": self.binds,
            "trunk_hits": self.hits,
            "trunk_reads": self.reads,
            "trunk_read_seconds": self.read_seconds,
            "trunk_exposed_wait_seconds": self.exposed_wait_seconds,
            "trunk_overlapped_seconds": self.overlapped_seconds,
            "trunk_pin_seconds": self.pin_seconds,
            "trunk_checksums_verified": self.verified,
            "trunk_verify_seconds": self.verify_seconds,
            "trunk_verify_every_read": self.verify_every,
            "trunk_codec": self.codec,
            "trunk_decoded_bytes": self.decoded_bytes,
            "trunk_decode_seconds": self.decode_seconds,
        }
