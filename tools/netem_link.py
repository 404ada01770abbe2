"""An emulated link between two network namespaces: a delay and a rate, in user space.

``tc netem`` is the usual way; a kernel built without ``sch_netem`` (as on the machine the
figures in docs/cluster.md were taken on) has no delay qdisc at all. :class:`DelayLine`
does the same job with two TUN devices, one moved into each namespace, and this process
between them: every IP packet read from one device is written to the other once
``delay`` has passed since it arrived and the packets before it have left at ``rate``
(departure = max(arrival + delay, previous departure) + size x 8 / rate), first in first
out in each direction, as netem's delay and rate do. Its own forwarding cost (a thread
hop, tens of microseconds) is in every figure, with or without a delay; the tool reports
the round-trip time it measures across the link either way.

Root only (``/dev/net/tun``, ``ip``). Used by ``tools/cluster_netem.py``.
"""

from __future__ import annotations

import collections
import fcntl
import os
import select
import struct
import subprocess
import threading
import time

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
MTU = 1500


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=60)


def _tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


class _Direction:
    """One direction: a reader queues packets with their departure time, a writer sends."""

    def __init__(self, src: int, dst: int, line: DelayLine):
        self.src, self.dst, self.line = src, dst, line
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.cv = threading.Condition()
        self.last = 0.0
        self.threads = [threading.Thread(target=self._read, daemon=True),
                        threading.Thread(target=self._write, daemon=True)]

    def _read(self) -> None:
        while not self.line.closed:
            if not select.select([self.src], [], [], 0.2)[0]:
                continue
            try:
                pkt = os.read(self.src, 65536)
            except OSError:
                return
            now = time.monotonic()
            delay, rate = self.line.delay_s, self.line.rate_bps
            with self.cv:
                dep = max(now + delay, self.last) + (len(pkt) * 8 / rate if rate else 0.0)
                self.last = dep
                self.queue.append((dep, pkt))
                self.cv.notify()

    def _write(self) -> None:
        while not self.line.closed:
            with self.cv:
                while not self.queue and not self.line.closed:
                    self.cv.wait(0.5)
                if self.line.closed:
                    return
                dep, pkt = self.queue[0]
                wait = dep - time.monotonic()
                if wait > 0:
                    self.cv.wait(wait)
                    continue
                self.queue.popleft()
            try:
                os.write(self.dst, pkt)
            except OSError:
                return


class DelayLine:
    """``ns_a`` (``ip_a``) and ``ns_b`` (``ip_b``) joined by two TUN devices and this
    process; ``delay_s`` one way and ``rate_bps`` (0: no cap) may be changed while it runs."""

    def __init__(self, ns_a: str, ns_b: str, ip_a: str, ip_b: str, tag: str):
        self.delay_s, self.rate_bps, self.closed = 0.0, 0.0, False
        self.names = (f"k3ta{tag}"[:15], f"k3tb{tag}"[:15])
        self.fds = [_tun(n) for n in self.names]
        for name, ns, mine, peer in ((self.names[0], ns_a, ip_a, ip_b),
                                     (self.names[1], ns_b, ip_b, ip_a)):
            _ip("link", "set", name, "netns", ns)
            _ip("-n", ns, "addr", "add", mine, "peer", peer, "dev", name)
            _ip("-n", ns, "link", "set", name, "mtu", str(MTU), "up")
        self.dirs = [_Direction(self.fds[0], self.fds[1], self),
                     _Direction(self.fds[1], self.fds[0], self)]
        for d in self.dirs:
            for t in d.threads:
                t.start()

    def set(self, delay_s: float, rate_bps: float) -> None:
        self.delay_s, self.rate_bps = delay_s, rate_bps

    def close(self) -> None:
        """Stop forwarding, then close the devices (each goes when its last fd closes)."""
        self.closed = True
        for d in self.dirs:
            with d.cv:
                d.cv.notify_all()
        for d in self.dirs:
            for t in d.threads:
                t.join(5)
        for fd in self.fds:
            os.close(fd)
