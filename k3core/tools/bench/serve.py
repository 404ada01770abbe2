"""``k3 bench serve``: a real ``k3 serve`` driven over HTTP by one client, then by many.

:func:`run_serve_bench` starts ``python -m k3core serve MODEL`` on a free loopback port
(the engine flags and any extra server arguments passed through), waits for ``GET
/health``, and streams ``POST /v1/completions`` requests at it: each prompt a list of
``prompt_tokens`` ids drawn from a seeded generator, distinct per request (its first id
differs from every other request's, so no two share a prefix), ``max_tokens`` with
``ignore_eos`` (each reply is exactly that long), temperature 0, ``"stream": true`` with
the usage chunk (the token count is the server's ``usage.completion_tokens``).

Phases: ``warmup`` requests that are not measured; the lone client, :data:`LONE_REQUESTS`
requests (at most ``requests``) one after the other; then ``clients`` threads, each on its
own keep-alive connection, taking ``requests`` requests from one shared counter. Each
phase is summarised by :func:`phase_stats` (a pure function of the client-side times):
generated tokens/s and requests/s over the phase's wall time, time to first token (from
sending the request to the first chunk with text) and inter-token latency (the gaps
between a reply's chunks with text; a chunk normally holds one token) at p50 and p95.
``GET /health`` is read after the last phase and its batch fields, if it has any, are
reported. The server is stopped (SIGTERM, then SIGKILL) whatever happens, Ctrl-C
included; if it exits before it is ready, the error carries its last lines of output.

The HTTP client is the standard library's ``http.client`` (no dependency beyond k3's own).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from k3core.api.errors import K3Error, UsageError

#: requests of the lone-client phase (fewer when ``requests`` is smaller)
LONE_REQUESTS = 3
#: lines of the server's output kept for an error
TAIL_LINES = 30
#: seconds the server has to stop after SIGTERM before it is killed
STOP_SECONDS = 10.0
HOST = "127.0.0.1"

#: ``progress(stage, done, total)`` (``k3core.cli.progress.Stages``) and ``note(line)``
Progress = Callable[[str, int, int], None]
Note = Callable[[str], None]


class ServerFailed(K3Error):
    """The server could not be started, or went away during the run (exit 1); ``tail``
    holds its last lines of output."""

    def __init__(self, message: str, tail: Sequence[str] = ()):
        super().__init__(message)
        self.tail = list(tail)


# ---- the statistics -------------------------------------------------------------------------
@dataclass(frozen=True)
class RequestTiming:
    """One streamed request as the client saw it (``time.perf_counter`` seconds)."""

    sent: float
    #: the arrival of each chunk that carried text
    chunks: tuple[float, ...]
    #: the end of the stream (``data: [DONE]``)
    done: float
    #: the tokens generated (the usage chunk's ``completion_tokens``)
    tokens: int

    @property
    def ttft(self) -> float:
        """Seconds from sending to the first text (to the end, for a reply without text)."""
        return (self.chunks[0] if self.chunks else self.done) - self.sent

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:], strict=False)]


@dataclass(frozen=True)
class PhaseStats:
    """One phase's figures (seconds; ``None`` where there is nothing to measure)."""

    clients: int
    requests: int
    tokens: int
    seconds: float
    tokens_per_s: float | None
    requests_per_s: float | None
    ttft_p50: float | None
    ttft_p95: float | None
    itl_p50: float | None
    itl_p95: float | None
    #: each request's generated tokens, in the order they were sent
    tokens_each: list[int] = field(default_factory=list)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) of ``values`` by linear interpolation between the
    closest ranks (NumPy's default); ``None`` for no values."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in 0..100, got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _per(n: float, seconds: float) -> float | None:
    return n / seconds if seconds > 0 else None


def phase_stats(timings: Sequence[RequestTiming], seconds: float, clients: int) -> PhaseStats:
    """The figures of a phase of ``timings`` (in the order the requests were sent) that
    took ``seconds`` of wall time with ``clients`` clients."""
    ordered = sorted(timings, key=lambda t: t.sent)
    ttfts = [t.ttft for t in ordered]
    gaps = [g for t in ordered for g in t.gaps]
    tokens = sum(t.tokens for t in ordered)
    return PhaseStats(clients=clients, requests=len(ordered), tokens=tokens, seconds=seconds,
                      tokens_per_s=_per(tokens, seconds), requests_per_s=_per(len(ordered), seconds),
                      ttft_p50=percentile(ttfts, 50), ttft_p95=percentile(ttfts, 95),
                      itl_p50=percentile(gaps, 50), itl_p95=percentile(gaps, 95),
                      tokens_each=[t.tokens for t in ordered])


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or ``None`` when either is missing or ``b`` is 0."""
    return a / b if a is not None and b else None


def batch_fields(health: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of a ``/health`` answer that speak of the batch: a key holding ``batch``,
    at the top or one level down (``scheduler.batch_size``)."""
    out: dict[str, Any] = {}
    for key, value in health.items():
        if "batch" in key.lower():
            out[key] = value
        elif isinstance(value, Mapping):
            out.update({f"{key}.{k}": v for k, v in value.items() if "batch" in str(k).lower()})
    return out


# ---- the workload ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    clients: int
    requests: int
    prompt_tokens: int
    max_tokens: int
    warmup: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("clients", "requests", "prompt_tokens", "max_tokens"):
            if getattr(self, name) < 1:
                raise UsageError(f"bench serve: {name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise UsageError(f"bench serve: warmup must be >= 0, got {self.warmup}")

    @property
    def lone(self) -> int:
        return min(self.requests, LONE_REQUESTS)


def prompt_ids(index: int, length: int, vocab: int, seed: int) -> list[int]:
    """Request ``index``'s prompt: ``length`` ids in ``0..vocab-1`` from a generator seeded
    by ``seed`` and ``index``; its first id is ``index`` past the seed's (mod ``vocab``), so
    no two of the first ``vocab`` requests share a prefix."""
    base = random.Random(seed).randrange(vocab)
    rng = random.Random(seed * 1_000_003 + index + 1)
    return [(base + index) % vocab] + [rng.randrange(vocab) for _ in range(length - 1)]


# ---- the server -----------------------------------------------------------------------------
def free_port(host: str = HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """A ``k3 serve`` subprocess; its merged output read as it comes (the last lines kept)."""

    def __init__(self, argv: list[str], port: int):
        self.argv = argv
        self.port = port
        self.lines: deque[str] = deque(maxlen=TAIL_LINES)
        #: the server's first line about itself (``k3 serve: MODEL (...) on http://...``)
        self.banner: str | None = None
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, errors="replace")
        self._reader = threading.Thread(target=self._read, daemon=True, name="k3-bench-server-output")
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            if self.banner is None and line.startswith("k3 serve:") and "http://" in line:
                self.banner = line
            self.lines.append(line)

    def tail(self) -> list[str]:
        return list(self.lines)

    def failed(self, what: str) -> ServerFailed:
        """The error for ``what`` went wrong, naming how the server ended if it did."""
        code = self.proc.poll()
        if code is not None:
            self._reader.join(2)
            last = next((ln for ln in reversed(self.lines) if ln.strip()), "")
            said = f": {last.strip().removeprefix('k3: error: ')}" if last else ""
            return ServerFailed(f"bench serve: {what}: the server exited with code {code}{said}",
                                self.tail())
        return ServerFailed(f"bench serve: {what}", self.tail())

    def get(self, path: str, timeout: float) -> dict[str, Any]:
        conn = http.client.HTTPConnection(HOST, self.port, timeout=timeout)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                raise OSError(f"GET {path}: HTTP {resp.status}")
            doc = json.loads(body)
            if not isinstance(doc, dict):
                raise OSError(f"GET {path}: not a JSON object")
            return doc
        finally:
            conn.close()

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        """``GET /health`` once it answers; a :class:`ServerFailed` if the server exits first
        or ``timeout`` seconds pass."""
        end = time.monotonic() + timeout
        pause = 0.05
        while True:
            if self.proc.poll() is not None:
                raise self.failed("the server did not start")
            try:
                return self.get("/health", timeout=5.0)
            except (OSError, ValueError, http.client.HTTPException):
                pass
            if time.monotonic() > end:
                raise self.failed(f"the server did not answer /health within {timeout:g} s")
            time.sleep(pause)
            pause = min(pause * 1.5, 0.5)

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after :data:`STOP_SECONDS`; the exit code."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_SECONDS)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                self.proc.wait()
        self._reader.join(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode


@contextlib.contextmanager
def running_server(model: Path, server_args: Sequence[str], start_timeout: float,
                   python: str = sys.executable) -> Iterator[ServerProcess]:
    """A ready ``k3 serve model`` on a free loopback port, stopped on the way out."""
    port = free_port()
    argv = [python, "-m", "k3core", "serve", str(model), "--host", HOST, "--port", str(port),
            *server_args]
    server = ServerProcess(argv, port)
    try:
        server.wait_ready(start_timeout)
        yield server
    finally:
        server.stop()


# ---- the clients ----------------------------------------------------------------------------
class RequestFailed(Exception):
    """A request the server refused or cut short (the server's own words)."""


def stream_completion(conn: http.client.HTTPConnection, payload: Mapping[str, Any]) -> RequestTiming:
    """Send one streamed completion on ``conn`` and time its chunks."""
    body = json.dumps(payload).encode()
    sent = time.perf_counter()
    conn.request("POST", "/v1/completions", body=body,
                 headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RequestFailed(f"HTTP {resp.status}: {_error_text(resp.read())}")
    chunks: list[float] = []
    tokens: int | None = None
    done: float | None = None
    while True:
        line = resp.readline()
        if not line:
            break
        now = time.perf_counter()
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            done = now
            break
        doc = json.loads(data)
        if "error" in doc:
            raise RequestFailed(_error_text(data))
        choices = doc.get("choices") or []
        if choices and choices[0].get("text"):
            chunks.append(now)
        if doc.get("usage"):
            tokens = int(doc["usage"]["completion_tokens"])
    resp.read()  # the end of the chunked body, so the connection can be used again
    if done is None:
        raise RequestFailed("the stream ended before data: [DONE]")
    if tokens is None:
        raise RequestFailed("the stream had no usage chunk")
    return RequestTiming(sent=sent, chunks=tuple(chunks), done=done, tokens=tokens)


def _error_text(body: bytes) -> str:
    try:
        doc = json.loads(body)
        return str(doc["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:200].decode(errors="replace").strip() or "(no body)"


@dataclass
class _Drive:
    """Requests ``first .. first+count-1`` sent by ``clients`` threads from one counter."""

    server: ServerProcess
    payload: Callable[[int], dict[str, Any]]
    first: int
    count: int
    clients: int
    timeout: float
    on_done: Callable[[int], None]
    next: int = 0
    done: int = 0
    results: dict[int, RequestTiming] = field(default_factory=dict)
    error: BaseException | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self) -> int | None:
        with self.lock:
            if self.error is not None or self.next >= self.count:
                return None
            self.next += 1
            return self.first + self.next - 1

    def client(self) -> None:
        conn = http.client.HTTPConnection(HOST, self.server.port, timeout=self.timeout)
        try:
            while (index := self.take()) is not None:
                timing = stream_completion(conn, self.payload(index))
                with self.lock:
                    self.results[index] = timing
                    self.done += 1
                    done = self.done
                self.on_done(done)
        except BaseException as exc:  # noqa: B036 - handed to the main thread
            with self.lock:
                if self.error is None:
                    self.error = exc
        finally:
            conn.close()

    def run(self) -> tuple[list[RequestTiming], float]:
        threads = [threading.Thread(target=self.client, daemon=True, name=f"k3-bench-client-{i}")
                   for i in range(min(self.clients, self.count))]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - start
        if self.error is not None:
            raise self._failure(self.error)
        return [self.results[i] for i in sorted(self.results)], seconds

    def _failure(self, exc: BaseException) -> K3Error:
        if self.server.proc.poll() is not None:
            return self.server.failed("a request failed")
        if isinstance(exc, RequestFailed):
            return K3Error(f"bench serve: a request failed: {exc}")
        if isinstance(exc, TimeoutError):
            return K3Error(f"bench serve: the server sent nothing for {self.timeout:g} s "
                           "(raise --timeout for a slow model)")
        return K3Error(f"bench serve: a request failed: {type(exc).__name__}: {exc}")


# ---- the bench ------------------------------------------------------------------------------
@dataclass
class ServeBenchResult:
    model: str
    workload: Workload
    server_args: list[str]
    server: str | None
    lone: PhaseStats
    concurrent: PhaseStats
    health_batch: dict[str, Any] | None

    @property
    def tokens_per_s_ratio(self) -> float | None:
        return ratio(self.concurrent.tokens_per_s, self.lone.tokens_per_s)

    @property
    def ttft_p95_ratio(self) -> float | None:
        return ratio(self.concurrent.ttft_p95, self.lone.ttft_p95)

    @property
    def exact(self) -> bool:
        """Every measured reply generated exactly ``max_tokens`` tokens."""
        want = self.workload.max_tokens
        return all(n == want for n in self.lone.tokens_each + self.concurrent.tokens_each)

    def to_dict(self) -> dict[str, Any]:
        w = self.workload
        out: dict[str, Any] = {
            "model": self.model, "clients": w.clients, "requests": w.requests,
            "prompt_tokens": w.prompt_tokens, "max_tokens": w.max_tokens, "warmup": w.warmup,
            "seed": w.seed, "server_args": self.server_args, "server": self.server,
            "lone": asdict(self.lone), "concurrent": asdict(self.concurrent),
            "tokens_per_s_ratio": self.tokens_per_s_ratio, "ttft_p95_ratio": self.ttft_p95_ratio,
            "exact_tokens": self.exact,
        }
        if self.health_batch is not None:
            out["health_batch"] = self.health_batch
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict())


def run_serve_bench(model: Path, workload: Workload, *, vocab: int, server_args: Sequence[str] = (),
                    start_timeout: float = 300.0, timeout: float = 600.0,
                    progress: Progress | None = None, note: Note | None = None,
                    python: str = sys.executable) -> ServeBenchResult:
    """Start ``k3 serve model`` with ``server_args``, run ``workload`` against it (prompt ids
    in ``0..vocab-1``), stop it. ``timeout``: the longest a request may go without a byte
    from the server; ``start_timeout``: the longest the server may take to answer /health."""
    if not model.is_dir():
        raise UsageError(f"bench serve: the model directory {model} does not exist")
    if vocab < 1:
        raise UsageError(f"bench serve: vocab must be >= 1, got {vocab}")
    show = progress or (lambda stage, done, total: None)
    say = note or (lambda line: None)
    w = workload

    def payload_for(name: str) -> Callable[[int], dict[str, Any]]:
        def payload(index: int) -> dict[str, Any]:
            return {"model": name, "prompt": prompt_ids(index, w.prompt_tokens, vocab, w.seed),
                    "max_tokens": w.max_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
        return payload

    def phase(server: ServerProcess, stage: str, first: int, count: int, clients: int,
              payload: Callable[[int], dict[str, Any]]) -> tuple[list[RequestTiming], float]:
        show(stage, 0, count)
        drive = _Drive(server, payload, first, count, clients, timeout,
                       lambda done: show(stage, done, count))
        return drive.run()

    say(f"bench serve: starting k3 serve {model} {' '.join(server_args)}".rstrip())
    with running_server(model, server_args, start_timeout, python) as server:
        name = str(server.get("/v1/models", timeout=30.0)["data"][0]["id"])
        say(f"bench serve: ready on port {server.port}")
        payload = payload_for(name)
        at = 0
        if w.warmup:
            phase(server, "warm-up", at, w.warmup, 1, payload)
            at += w.warmup
        lone, lone_s = phase(server, "lone", at, w.lone, 1, payload)
        at += w.lone
        many, many_s = phase(server, "concurrent", at, w.requests, w.clients, payload)
        try:
            batch = batch_fields(server.get("/health", timeout=30.0))
        except (OSError, ValueError, http.client.HTTPException):
            batch = {}
        banner = server.banner
    return ServeBenchResult(model=str(model), workload=w, server_args=list(server_args),
                            server=banner, lone=phase_stats(lone, lone_s, 1),
                            concurrent=phase_stats(many, many_s, min(w.clients, w.requests)),
                            health_batch=batch or None)


# ---- the report -----------------------------------------------------------------------------
def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def _num(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _scalars(fields: Mapping[str, Any]) -> str:
    """``key value, ...`` of the scalar fields, a nested object's one level down (``--json``
    has them all)."""
    out = []
    for key, value in fields.items():
        if isinstance(value, Mapping):
            out += [f"{key}.{k} {json.dumps(v)}" for k, v in value.items()
                    if not isinstance(v, (Mapping, list))]
        elif not isinstance(value, list):
            out.append(f"{key} {json.dumps(value)}")
    return ", ".join(out)


def format_report(res: ServeBenchResult) -> str:
    """The table a person reads."""
    w = res.workload
    lines = [f"k3 bench serve: {res.model}, prompts of {w.prompt_tokens} ids, "
             f"{w.max_tokens} tokens each (greedy, ignore_eos), {w.warmup} warm-up"]
    if res.server:
        lines.append(f"server: {res.server.removeprefix('k3 serve: ')}")
    head = ("phase", "clients", "requests", "tokens", "seconds", "tokens/s", "req/s",
            "TTFT p50 ms", "TTFT p95 ms", "ITL p50 ms", "ITL p95 ms")
    rows = [head]
    for label, p in (("lone", res.lone), ("concurrent", res.concurrent)):
        rows.append((label, str(p.clients), str(p.requests), str(p.tokens), f"{p.seconds:.2f}",
                     _num(p.tokens_per_s), _num(p.requests_per_s, 2), _ms(p.ttft_p50),
                     _ms(p.ttft_p95), _ms(p.itl_p50), _ms(p.itl_p95)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        lines.append("  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i])
                               for i, c in enumerate(r)).rstrip())
    lines.append(f"concurrent / lone: {_num(res.tokens_per_s_ratio, 2)}x tokens/s, "
                 f"{_num(res.ttft_p95_ratio, 2)}x p95 TTFT")
    if res.health_batch:
        lines.append("server batch (/health): " + _scalars(res.health_batch))
    if not res.exact:
        short = [n for n in res.lone.tokens_each + res.concurrent.tokens_each if n != w.max_tokens]
        lines.append(f"note: {len(short)} replies did not generate {w.max_tokens} tokens "
                     f"(got {sorted(set(short))}); tokens/s counts the tokens generated")
    return "\n".join(lines)
