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


def test_read_ahead_waits_until_the_demand_reads_are_done() -> None:
    gate = ReadPriority()
    gate.begin()
    gate.begin()
    assert gate.active == 2
    threading.Timer(0.1, gate.end).start()
    waited: list[float] = []
    t = threading.Thread(target=lambda: waited.append(gate.wait_for_demand(5.0)))
    t.start()
    time.sleep(0.2)
    assert t.is_alive()  # one demand read is still in flight
    gate.end()
    t.join(5)
    assert not t.is_alive() and 0.15 <= waited[0] < 4.0
    assert gate.active == 0


def test_read_ahead_never_waits_past_its_timeout() -> None:
    gate = ReadPriority()
    gate.begin()  # a demand read that never ends (stuck in the kernel, say)
    t0 = time.perf_counter()
    waited = gate.wait_for_demand(0.05)
    assert 0.04 <= waited <= time.perf_counter() - t0 < 2.0
    gate.end()
    gate.end()  # an extra end never drives the count below zero
    assert gate.active == 0
