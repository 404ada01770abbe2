"""The cache fixture the expert-cache suite writes on the fly has the shipped fixture's layout
(same header, same tensor offsets), so the suite needs no fixtures directory."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from k3core.testing.expert_cache_conformance import FIXTURE_SHARD, ShardTruth, cache_fixture


def _header(path: Path) -> tuple[int, dict]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    return n, header


def test_generated_fixture_matches_the_shipped_layout(tmp_path: Path, fixtures: Path) -> None:
    made = cache_fixture(tmp_path / "fx") / FIXTURE_SHARD
    shipped = fixtures / "cache" / FIXTURE_SHARD
    assert _header(made) == _header(shipped)
    assert made.stat().st_size == shipped.stat().st_size
    truth = ShardTruth(made.parent)
    experts = [truth.expert(0, e) for e in range(24)]
    for a, b in zip(experts, experts[1:], strict=False):  # no two experts share a byte position
        assert all(x != y for k in a for x, y in zip(a[k], b[k], strict=True))
