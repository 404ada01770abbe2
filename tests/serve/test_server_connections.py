"""``k3 serve`` survives abusive connections (loopback only, bounded in sockets and time):
a flood of idle connections closes its own oldest sockets while ``/health`` still answers,
under a low file limit, with a short log and no traceback; a partial request head is closed
after the header timeout, a quiet keep-alive connection after the idle timeout, a stalled
body gets a 408; when every connection is in a request the next one is refused with a 503."""

from __future__ import annotations

import errno
import json
import resource
import select
import socket
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest
from conftest import K3, Served, cli_env, k3_inprocess

MODEL = "tiny"
FLOOD = 300
CAP = 32


def low_file_limit(n: int = 256):
    def apply() -> None:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))
    return apply


def address(s: Served) -> tuple[str, int]:
    host, port = s.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def open_many(addr: tuple[str, int], n: int, wave: int = 20, deadline: float = 15.0) -> list[socket.socket]:
    """``n`` connections opened in quick waves (non-blocking), each left idle. (A wave at a
    time, so that the kernel's accept queue, which the server keeps short under a low file
    limit, does not drop SYNs and make the test wait out TCP's retransmissions.)"""
    socks = []
    for i in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        err = s.connect_ex(addr)
        assert err in (0, errno.EINPROGRESS), err
        socks.append(s)
        if i % wave == wave - 1:
            time.sleep(0.02)
    pending = set(socks)
    t0 = time.monotonic()
    while pending and time.monotonic() - t0 < deadline:
        _, ready, _ = select.select([], list(pending), [], 0.5)
        pending -= set(ready)
    return socks


def closed_by_server(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True  # reset


def read_until_closed(s: socket.socket, limit: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes (or ``limit`` seconds pass)."""
    s.setblocking(True)
    s.settimeout(limit)
    t0 = time.monotonic()
    data = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return data, time.monotonic() - t0


def stop_clean(s: Served) -> str:
    rc, err = s.stop()
    assert rc == 0, err
    assert "Traceback" not in err and "Too many open files" not in err, err
    return err


def test_a_flood_of_idle_connections_does_not_cut_the_server_off(tiny_model):
    s = Served(tiny_model, "--threads", "1", "--max-connections", str(CAP), "--timeout-header", "60",
               "--timeout-idle", "60", preexec_fn=low_file_limit(256))
    socks: list[socket.socket] = []
    t0 = time.monotonic()
    try:
        socks = open_many(address(s), FLOOD)  # more than the cap, more than the file limit allows
        t1 = time.monotonic()
        h = httpx.get(s.url + "/health", timeout=10)
        assert h.status_code == 200 and h.json()["status"] == "ok"
        assert time.monotonic() - t1 < 8  # answered at once (a dropped SYN may cost a retry)
        conns = h.json()["connections"]
        assert conns["max"] == CAP and conns["open"] <= CAP
        # the flood's own oldest sockets were closed to make room, not the new connection
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            closed = sum(closed_by_server(x) for x in socks)
            if closed >= FLOOD - CAP:
                break
            time.sleep(0.1)
        assert FLOOD - CAP <= closed < FLOOD, closed
        conns = httpx.get(s.url + "/health", timeout=10).json()["connections"]
        assert conns["closed_idle"] >= FLOOD - CAP and conns["open"] <= CAP, conns
        # and real work still gets done
        r = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": [4, 5], "max_tokens": 1},
                       timeout=30)
        assert r.status_code == 200, r.text
    finally:
        for x in socks:
            x.close()
        err = stop_clean(s)
    took = time.monotonic() - t0
    # the start banner's two lines and the one line per request (INFO) aside
    lines = [ln for ln in err.strip().splitlines()[2:] if ": INFO: " not in ln]
    assert len(lines) <= took + 4, err  # one summary line a second at most, and the stop line
    assert any("idle connections closed to make room" in ln for ln in lines), err


def test_more_connections_than_the_file_limit_allows_is_refused(tiny_model):
    r = subprocess.run([*K3, "serve", str(tiny_model), "--max-connections", "1000"], capture_output=True,
                       text=True, timeout=60, env=cli_env(), preexec_fn=low_file_limit(256))
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("k3: error: --max-connections 1000") and "ulimit -n" in r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


@pytest.mark.parametrize("args,words", [
    (["--max-connections", "0"], "--max-connections"),
    (["--timeout-header", "0"], "--timeout-header"),
    (["--timeout-idle", "inf"], "--timeout-idle"),
    (["--timeout-idle", "nan"], "--timeout-idle"),
])
def test_bad_connection_flags_are_refused(tiny_model, args, words):
    r = k3_inprocess("serve", tiny_model, *args)
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith("k3: error:") and words in r.stderr and "Traceback" not in r.output


@pytest.fixture(scope="module")
def strict(tiny_model) -> Iterator[Served]:
    """Four connections at most, one second to send a head, one second of keep-alive."""
    s = Served(tiny_model, "--threads", "1", "--max-connections", "4", "--timeout-header", "1",
               "--timeout-idle", "1")
    yield s
    stop_clean(s)


def test_a_partial_request_head_is_closed_after_the_header_timeout(strict):
    with socket.create_connection(address(strict)) as c:
        c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        data, took = read_until_closed(c, 10)
    assert data == b"" and 0.8 <= took < 5, (data, took)
    with socket.create_connection(address(strict)) as c:  # nothing at all: the same
        data, took = read_until_closed(c, 10)
    assert data == b"" and 0.8 <= took < 5, (data, took)


def test_a_quiet_keep_alive_connection_is_closed_after_the_idle_timeout(strict):
    with socket.create_connection(address(strict)) as c:
        c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        data, took = read_until_closed(c, 10)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and json.loads(body)["status"] == "ok"
    assert 0.8 <= took < 5, took  # the answer, then a second of keep-alive, then closed


def test_busy_connections_refuse_the_next_and_a_stalled_body_gets_a_408(strict):
    addr = address(strict)
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{\"model\":")
    busy = [socket.create_connection(addr) for _ in range(4)]
    try:
        for c in busy:
            c.sendall(head)  # a request begun, its body stalled: each connection is in a request
        time.sleep(0.3)
        with socket.create_connection(addr) as extra:
            data, took = read_until_closed(extra, 5)
        assert data.startswith(b"HTTP/1.1 503"), data
        assert json.loads(data.partition(b"\r\n\r\n")[2])["error"]["code"] == "too_many_connections"
        assert took < 1.0  # refused at once, not queued
        for c in busy:  # then the header timeout ends each stalled body
            data, _ = read_until_closed(c, 10)
            assert data.startswith(b"HTTP/1.1 408"), data
            assert json.loads(data.partition(b"\r\n\r\n")[2])["error"]["code"] == "body_timeout"
    finally:
        for c in busy:
            c.close()
    h = httpx.get(strict.url + "/health", timeout=10).json()["connections"]
    assert h["refused"] >= 1
