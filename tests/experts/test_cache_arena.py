"""The expert cache faults its arena in on a thread of its own, before any read lands in it."""

from __future__ import annotations

import threading

import pytest

from k3core.api import prefault as pf
from k3core.plugins.registry import get_registry
from k3core.testing.expert_cache_conformance import check_resident, drive, fixture_cache


@pytest.mark.parametrize("storage", ["plain", "direct"])
def test_the_first_read_waits_for_the_arena_and_bytes_stay_right(tmp_path, monkeypatch, storage) -> None:
    started, release = threading.Event(), threading.Event()
    real = pf.prefault
    order: list[str] = []

    def slow(buf, stop=None):  # the arena's prefault, held until the test lets it go
        started.set()
        release.wait(10)
        order.append("faulted")
        return real(buf, stop)

    monkeypatch.setattr("k3core.experts.cache.prefault", slow)
    reg = get_registry()
    made, _, _ = reg.create("storage", storage)
    rig = fixture_cache(tmp_path, made, "lru", 5)
    try:
        assert started.wait(10)
        reader = rig.cache._read

        def read(ref, buf, blocks=None):
            order.append("read")
            return reader(ref, buf, blocks)

        monkeypatch.setattr(rig.cache, "_read", read)
        t = threading.Thread(target=drive, args=(rig, [[(0, [0, 1, 2])], [(0, [3, 1])]]))
        t.start()
        t.join(0.3)
        assert t.is_alive() and order == []  # no read was submitted before the arena was mapped
        release.set()
        t.join(10)
        assert order[0] == "faulted" and "read" in order
        check_resident(rig)
        assert rig.cache.await_arena() == 0.0
    finally:
        release.set()
        rig.cache.close()
        rig.index.close()


def test_close_stops_an_unfinished_prefault(tmp_path) -> None:
    reg = get_registry()
    made, _, _ = reg.create("storage", "plain")
    rig = fixture_cache(tmp_path, made, "lru", 5)
    rig.cache.close()
    assert rig.cache._prefaulter is None
    rig.index.close()


def test_a_large_arena_sits_on_advised_huge_pages(tmp_path) -> None:
    """An arena of 2 MiB or more is 2 MiB aligned with its whole huge pages advised (O_DIRECT
    reads into huge pages pin one page per 2 MiB, k3core/api/prefault.py), and exactly its
    slots long; the bytes read into it are the shard's."""
    reg = get_registry()
    made, _, _ = reg.create("storage", "direct")
    rig = fixture_cache(tmp_path, made, "lru", 300)  # 300 slots of 8 kB: 2.3 MiB
    try:
        arena = rig.cache.arena
        assert arena.size == rig.cache.capacity * rig.cache.stride >= pf.HUGE_PAGE
        assert arena.ctypes.data % pf.HUGE_PAGE == 0
        drive(rig, [[(0, [0, 1, 2])], [(0, [3, 1])]])
        check_resident(rig)
    finally:
        rig.cache.close()
        rig.index.close()
