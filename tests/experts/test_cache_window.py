"""An expert read from a shard that reads aligned blocks (O_DIRECT) is one request: the slot's
whole blocks around the expert's bytes, not its middle plus a bounce read at each unaligned
end. The bytes served are the shard's, the last expert of a shard (whose blocks run past the
end of the file) included, and nothing outside the expert's slot is written."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from k3core.experts.cache import ALIGN
from k3core.testing.disk import disk_tmpdir
from k3core.testing.expert_cache_conformance import (
    FIXTURE_EXPERTS,
    check_resident,
    drive,
    fixture_cache,
    make_storage,
)
from k3core.testing.faulty_backend import available_storage

pytestmark = pytest.mark.skipif("direct" not in available_storage(),
                                reason="no O_DIRECT here (the window is the direct backend's)")


@pytest.fixture()
def work():
    with disk_tmpdir("k3-cache-window-") as d:
        yield Path(d)


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """Record every O_DIRECT request: ``(file offset, bytes, buffer address)``."""
    from k3_storage.direct import DirectFile

    seen: list[tuple[int, int, int]] = []
    real = DirectFile._pread

    def pread(self: DirectFile, buf: np.ndarray, offset: int) -> int:
        seen.append((offset, buf.size, buf.ctypes.data))
        return real(self, buf, offset)

    monkeypatch.setattr(DirectFile, "_pread", pread)
    return seen


def test_one_aligned_request_per_expert_and_exact_bytes(work: Path, monkeypatch) -> None:
    rig = fixture_cache(work / "fx", make_storage("direct"), "lru", FIXTURE_EXPERTS)
    c = rig.cache
    try:
        offsets = [c.locator.ref(0, e).offset for e in range(FIXTURE_EXPERTS)]
        assert sum(o % 4096 != 0 for o in offsets) >= FIXTURE_EXPERTS - 1  # unaligned runs
        before = c.arena.copy()
        seen = _counting(monkeypatch)
        experts = list(range(FIXTURE_EXPERTS))  # the shard's last expert among them
        drive(rig, [[(0, experts[:8])], [(0, experts[8:])]])  # every served byte checked
        assert c.stats.misses == FIXTURE_EXPERTS
        last = max(experts, key=lambda e: c.locator.ref(0, e).offset)
        tail = c.locator.ref(0, last)
        size = rig.index.shard_size(tail.path)
        # one request an expert, whole blocks into aligned memory; the last expert's blocks
        # end at the end of the file, so its unaligned tail is a second (bounce) request
        # unless the file ends on a block
        assert len(seen) == FIXTURE_EXPERTS + (1 if size % 4096 else 0)
        assert all(off % 4096 == 0 and addr % 4096 == 0 for off, _, addr in seen)
        check_resident(rig)
        # what changed in the arena lies inside the slots read, never in a slot left empty
        changed = np.flatnonzero(c.arena != before)
        used = {c.slot_of[k] for k in c.slot_of}
        assert set((changed // c.stride).tolist()) <= used
    finally:
        rig.close()


def test_plain_storage_reads_exactly_the_expert(work: Path, monkeypatch) -> None:
    rig = fixture_cache(work / "fx", make_storage("mmap"), "lru", 4)
    try:
        assert rig.index.read_alignment(rig.cache.locator.ref(0, 0).path) == 1
        ref = rig.cache.locator.ref(0, 5)
        buf = rig.cache._slot_buf(0, ref)
        assert rig.cache._window(ref, buf) == (ref.offset, buf)
        drive(rig, [[(0, [5, 6, 7])]])
        check_resident(rig)
    finally:
        rig.close()


def test_a_declined_expert_is_one_aligned_request_too(monkeypatch) -> None:
    """An expert the policy does not keep is read into a transient buffer of whole blocks:
    one aligned request, as into a slot (not its middle and a bounce read at each unaligned
    end), and the bytes served are the shard's. The demo model's experts span several blocks."""
    from k3core.api.cache_policy import make_key
    from k3core.model.config import load_config
    from k3core.testing.expert_cache_conformance import ScriptedPolicy, make_policy, model_cache

    demo = Path(__file__).resolve().parents[2] / "demo-model"
    cfg = load_config(demo)
    inner = make_policy("lru", 4, n_layers=cfg.n_layers, n_experts=cfg.n_experts, topk=cfg.topk)
    declined = {make_key(1, e) for e in range(cfg.n_experts)}
    rig = model_cache(demo, make_storage("direct"), ScriptedPolicy(inner, decline=declined), 4)
    c = rig.cache
    try:
        refs = {e: c.locator.ref(1, e) for e in range(cfg.n_experts)}
        assert all(r.contiguous for r in refs.values())
        last = max(refs, key=lambda e: refs[e].offset)
        picked = [e for e, r in refs.items() if e != last and r.offset % 4096
                  and (r.offset + r.nbytes) % 4096  # unaligned at both ends, a whole block inside
                  and -(-r.offset // 4096) * 4096 + 4096 <= r.offset + r.nbytes][:3]
        assert len(picked) == 3
        seen = _counting(monkeypatch)
        drive(rig, [[(1, picked)]])  # every served byte checked against the shard
        assert c.stats.extra["transient"] == 3 and not c.slot_of
        assert len(seen) == 3, seen
        assert all(off % 4096 == 0 and addr % 4096 == 0 for off, _, addr in seen)
    finally:
        rig.close()


def test_a_buffer_outside_the_arena_is_read_exactly(work: Path) -> None:
    rig = fixture_cache(work / "fx", make_storage("direct"), "lru", 4)
    try:
        ref = rig.cache.locator.ref(0, 3)
        skew = ref.offset % ALIGN
        from k3core.api.storage import aligned_empty

        buf = aligned_empty(ref.nbytes + skew, ALIGN)[skew:]  # a transient read's buffer
        lo, into = rig.cache._window(ref, buf)
        assert lo == ref.offset and into is buf
    finally:
        rig.close()
