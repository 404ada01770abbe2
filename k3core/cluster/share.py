"""A worker's checkpoint share, checked against the head's before the first token.

Two digests: the index fingerprint (every shard's name, size and header bytes, from
``CheckpointIndex.fingerprint``) and a SHA-256 of the bytes of the experts the worker owns,
in plan order. The bytes are hashed whole while a share is at most ``FULL_HASH_LIMIT``;
above that (a real-size share is hundreds of GB) the first and last ``SAMPLE`` bytes of
every owned expert are hashed, which still catches a different file, a truncated or
re-quantised expert and a shifted layout. Head and worker run the same function over their
own files; any difference refuses the run.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from k3core.api.errors import CheckpointError
from k3core.checkpoint.index import CheckpointIndex
from k3core.experts.locator import ExpertLocator

FULL_HASH_LIMIT = 1 << 30
SAMPLE = 4096


@dataclass(frozen=True)
class ShareDigest:
    index: str  # shard names, sizes and headers
    experts: str  # the owned experts' bytes
    nbytes: int
    mode: str  # "full" or "sampled"

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "experts": self.experts, "bytes": self.nbytes, "mode": self.mode}


def share_digest(index: CheckpointIndex, locator: ExpertLocator, owned: dict[int, list[int]]) -> ShareDigest:
    refs = [locator.ref(L, e) for L in sorted(owned) for e in owned[L]]
    total = sum(r.nbytes for r in refs)
    full = total <= FULL_HASH_LIMIT
    h = hashlib.sha256()
    for r in refs:
        h.update(f"{r.layer}/{r.expert}:{r.nbytes};".encode())
        for p in r.parts:
            if full or p.nbytes <= 2 * SAMPLE:
                h.update(index.read_range(p.path, p.file_off, p.nbytes).tobytes())
            else:
                h.update(index.read_range(p.path, p.file_off, SAMPLE).tobytes())
                h.update(index.read_range(p.path, p.file_off + p.nbytes - SAMPLE, SAMPLE).tobytes())
    return ShareDigest(index.fingerprint(), h.hexdigest(), total, "full" if full else "sampled")


def check_share(worker: str, head: ShareDigest, theirs: ShareDigest) -> None:
    """Refuse a worker whose share differs from the head's (exit 1)."""
    if theirs.index != head.index:
        raise CheckpointError(
            f"{worker}: its checkpoint differs from the head's (shard names, sizes or headers); "
            "refusing before the first token",
            hint="give every machine the same checkpoint files (compare `k3 doctor` on each)")
    if theirs.experts != head.experts or theirs.nbytes != head.nbytes:
        raise CheckpointError(
            f"{worker}: the bytes of its {theirs.nbytes}-byte expert share differ from the "
            f"head's ({theirs.mode} checksum); refusing before the first token",
            hint="copy the shards again; a share must be byte-identical to the head's checkpoint")
