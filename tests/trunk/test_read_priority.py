"""Demand reads first (k3core/api/read_priority.py): the gate itself. The trunk ring's reader
yielding to it and the expert cache counting its reads in and out are tested with the
streamed trunk (tests/trunk/test_trunk_stream.py)."""

from __future__ import annotations

import threading
import time

from k3core.api.read_priority import ReadPriority


def test_no_demand_read_means_no_wait() -> None:
    gate = ReadPriority()
    assert gate.active == 0
    assert gate.wait_for_demand(1.0) == 0.0
    assert gate.waited_seconds == 0.0


def test_read_ahead_waits_until_only_the_last_demand_read_is_left() -> None:
    gate = ReadPriority()
    for _ in range(3):
        gate.begin()
    assert gate.active == 3
    threading.Timer(0.1, gate.end).start()
    waited: list[float] = []
    t = threading.Thread(target=lambda: waited.append(gate.wait_for_demand(5.0)))
    t.start()
    time.sleep(0.2)
    assert t.is_alive()  # two demand reads are still in flight
    gate.end()  # the last one is left: the read-ahead goes beside it
    t.join(5)
    assert not t.is_alive() and 0.15 <= waited[0] < 4.0
    assert gate.active == 1
    assert gate.wait_for_demand(5.0) == 0.0
    gate.end()
    assert gate.active == 0


def test_read_ahead_never_waits_past_its_timeout() -> None:
    gate = ReadPriority()
    gate.begin()  # two demand reads that never end (stuck in the kernel, say)
    gate.begin()
    t0 = time.perf_counter()
    waited = gate.wait_for_demand(0.05)
    assert 0.04 <= waited <= time.perf_counter() - t0 < 2.0
    gate.end()
    gate.end()
    gate.end()  # an extra end never drives the count below zero
    assert gate.active == 0
