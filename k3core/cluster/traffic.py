"""What crosses the network per token, from the shapes alone, and when it stops paying.

Per MoE layer and generated token the head sends each worker that owns at least one of the
token's ``topk`` experts the token's latent row (``latent`` float32) with the expert ids and
row indices (int64 each), and gets back one ``latent`` float32 row per routed expert. All
workers are called at once, so one layer is one round trip. The disk a worker saves the
head is its share of the expert reads: with every read a miss, N workers read the same
``topk`` experts a layer in 1/N of the time on N disks; the network costs more than that
saving above ``bytes / seconds_saved``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.model.sizes import sizes_from_config

#: one NVMe drive's sequential read, the disk the arithmetic assumes (decimal GB/s)
DISK_GBPS = 7.0
#: the ceiling the issue sets for the bytes one token may move at the real shape
MAX_BYTES_PER_TOKEN = 32_000_000
INDEX_BYTES = 8  # int64


@dataclass(frozen=True)
class Traffic:
    workers: int
    moe_layers: int
    sent_per_token: int  # head -> workers (upper bound: every worker gets a row each layer)
    received_per_token: int  # workers -> head
    round_trips_per_token: int
    expert_read_bytes: int  # the expert bytes one token reads when every read is a miss
    seconds_saved: float  # disk seconds the workers take off the head a token (all misses)

    @property
    def bytes_per_token(self) -> int:
        return self.sent_per_token + self.received_per_token

    @property
    def break_even_gbit_s(self) -> float | None:
        """The link speed below which the network costs more than the disk it saves."""
        if self.seconds_saved <= 0:
            return None
        return self.bytes_per_token * 8 / self.seconds_saved / 1e9

    def line(self, name: str) -> str:
        be = self.break_even_gbit_s
        tail = ("one worker saves no disk time: the network is pure cost" if be is None else
                f"the network costs more than the disk it saves below {be:.3f} Gbit/s "
                f"(disk {DISK_GBPS:g} GB/s, every expert read a miss)")
        return (f"traffic ({name} shape, {self.workers} worker(s)): {self.bytes_per_token / 1e6:.2f} MB "
                f"a token ({self.sent_per_token / 1e6:.2f} MB sent, {self.received_per_token / 1e6:.2f} MB "
                f"received), {self.round_trips_per_token} round trips; {tail}")

    def to_json(self) -> dict[str, Any]:
        return {"workers": self.workers, "bytes_per_token": self.bytes_per_token,
                "sent_per_token": self.sent_per_token, "received_per_token": self.received_per_token,
                "round_trips_per_token": self.round_trips_per_token,
                "expert_read_bytes_per_token": self.expert_read_bytes,
                "disk_seconds_saved_per_token": self.seconds_saved,
                "disk_gb_s": DISK_GBPS, "break_even_gbit_s": self.break_even_gbit_s}


def traffic(cfg: ModelConfig, workers: int, n_layers: int | None = None) -> Traffic:
    """The per-token arithmetic for ``workers`` workers over the first ``n_layers`` layers."""
    n = n_layers or cfg.n_layers
    moe = sum(1 for L in range(n) if not cfg.is_dense(L))
    row = cfg.latent * 4
    involved = min(workers, cfg.topk)
    sent = moe * (involved * row + cfg.topk * 2 * INDEX_BYTES)
    received = moe * cfg.topk * row
    read = moe * cfg.topk * sizes_from_config(cfg).expert_bytes
    saved = (1.0 - 1.0 / workers) * read / (DISK_GBPS * 1e9)
    return Traffic(workers, moe, sent, received, moe, read, saved)


def real_traffic(workers: int) -> Traffic:
    """The arithmetic at the released Kimi K3 shape (``k3core.model.shapes`` "real")."""
    return traffic(ModelConfig.from_json_dict(size_config("real")), workers)
