"""The server's figures: ``GET /metrics`` (Prometheus text format) and each reply's own.

One :class:`Metrics` per app, with its own ``prometheus_client`` registry (never the
process-wide default), so several servers in one process keep apart. It holds:

* what the HTTP side counts: requests by route, method and status (the request log,
  ``k3core.serve.access``, reports each one as it ends);
* what the engine thread measures per generation (:meth:`Metrics.run` wraps the service's
  run): prompt, reused and generated tokens, generations by how they finished, time to the
  first token (from the request's entry into the engine's queue) and between tokens, the
  queue's depth, the generations running and the batch's size (the sequences of the last
  batched step, :mod:`k3core.model.scheduler`);
* the engine's own whole-life counters, read when scraped: expert-cache lookups, resident
  hits and misses (a lookup of an expert already fetched in the same step is neither), the bytes read for the trunk and for the experts, and the seconds the forward pass
  waited on reads that did not overlap compute (exposed waits).

Each reply also gets its own figures (:meth:`Metrics.figures`, the ``k3.figures`` field):
its seconds in the queue, to its first token, its decode rate, and the expert-cache
lookups, resident hits and misses, and the bytes read (trunk and experts) while it ran.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from k3core.model.steps import Step
from k3core.serve.service import Prepared, Service
from k3core.serve.worker import Job, Outcome
from k3core.trunk.source import report_json

#: seconds: from a few milliseconds (a tiny model's step) to minutes (a long prompt on a disk)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


@dataclass
class EngineFigures:
    """The engine's whole-life counters at one moment."""

    expert_requests: int = 0
    expert_hits: int = 0
    expert_misses: int = 0
    expert_bytes: int = 0
    expert_wait: float = 0.0
    trunk_bytes: int = 0
    trunk_wait: float = 0.0

    @classmethod
    def of(cls, engine: Any) -> EngineFigures:
        stats = getattr(getattr(engine, "experts", None), "stats", None)
        out = cls()
        if stats is not None:
            out.expert_requests, out.expert_hits = int(stats.requests), int(stats.hits)
            out.expert_misses = int(stats.misses)
            out.expert_bytes, out.expert_wait = int(stats.bytes_read), float(stats.exposed_wait_seconds)
        model = getattr(engine, "model", None)
        if model is not None:
            trunk = report_json(getattr(model, "trunk", None), getattr(model, "tables", None))
            out.trunk_bytes = _int(trunk.get("trunk_bytes_read"))
            out.trunk_wait = _float(trunk.get("trunk_exposed_wait_seconds"))
        return out


def _int(v: object) -> int:
    return int(v) if isinstance(v, (int, float)) else 0


def _float(v: object) -> float:
    return float(v) if isinstance(v, (int, float)) else 0.0


class EngineCollector(Collector):
    """The engine's counters, read at each scrape."""

    def __init__(self, engine: Any):
        self.engine = engine

    def collect(self) -> Iterator[CounterMetricFamily]:
        f = EngineFigures.of(self.engine)
        yield _counter("k3_expert_requests", "Routed-expert lookups by the forward pass", f.expert_requests)
        yield _counter("k3_expert_cache_hits", "Routed-expert lookups resident in the expert cache "
                       "before their step began", f.expert_hits)
        yield _counter("k3_expert_cache_misses", "Routed-expert lookups read from storage", f.expert_misses)
        read = CounterMetricFamily("k3_read_bytes", "Bytes read from storage, by what they hold",
                                   labels=["what"])
        read.add_metric(["trunk"], f.trunk_bytes)
        read.add_metric(["experts"], f.expert_bytes)
        yield read
        wait = CounterMetricFamily("k3_io_exposed_wait_seconds",
                                   "Seconds the forward pass waited on reads (not overlapped by compute)",
                                   labels=["what"])
        wait.add_metric(["trunk"], f.trunk_wait)
        wait.add_metric(["experts"], f.expert_wait)
        yield wait


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


@dataclass
class _Timing:
    """One generation's token times (engine thread only)."""

    submitted: float
    started: float = 0.0
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)

    def token(self, now: float) -> None:
        if self.first is None:
            self.first = now
        elif self.last is not None:
            self.gaps.append(now - self.last)
        self.last = now
        self.tokens += 1


class Metrics:
    """The registry of one app and the hooks the app calls."""

    def __init__(self, service: Service, waiting: Callable[[], int]):
        self.service = service
        self.registry = r = CollectorRegistry()
        self.requests = Counter("k3_requests", "HTTP requests answered, by route, method and status",
                                ["route", "method", "status"], registry=r)
        self.prompt_tokens = Counter("k3_prompt_tokens", "Prompt tokens of the generations run "
                                     "(the reused ones included)", registry=r)
        self.reused_tokens = Counter("k3_prompt_tokens_reused", "Prompt tokens a kept prefix "
                                     "state already held (not fed again)", registry=r)
        self.generated_tokens = Counter("k3_generated_tokens", "Tokens generated", registry=r)
        self.generations = Counter("k3_generations", "Generations run, by how they finished",
                                   ["finish"], registry=r)
        self.ttft = Histogram("k3_time_to_first_token_seconds", "From a request's entry into the "
                              "engine's queue to its first generated token", buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("k3_inter_token_latency_seconds", "Between two generated tokens of one "
                             "generation", buckets=ITL_BUCKETS, registry=r)
        self._running = 0
        self.queue = Gauge("k3_queue_depth", "Requests waiting for the engine (not yet running)", registry=r)
        self.queue.set_function(lambda: max(waiting() - self._running, 0))
        self.running = Gauge("k3_requests_running", "Generations the engine is running", registry=r)
        self.running.set_function(lambda: self._running)
        self.batch = Gauge("k3_batch_size", "Sequences the engine decoded together in its last "
                           "step (0 when idle)", registry=r)
        sched = service.worker.engine.model.scheduler
        self.batch.set_function(lambda: sched.stats.last if self._running else 0)
        r.register(EngineCollector(service.worker.engine))
        self._submitted: weakref.WeakKeyDictionary[Job, float] = weakref.WeakKeyDictionary()
        self._figures: weakref.WeakKeyDictionary[Job, dict[str, Any]] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    # ---- the scrape ---------------------------------------------------------------------
    def render(self) -> tuple[bytes, str]:
        """The exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    # ---- the HTTP side ------------------------------------------------------------------
    def count_request(self, route: str, method: str, status: int) -> None:
        self.requests.labels(route, method, str(status)).inc()

    def submitted(self, job: Job) -> None:
        """``job`` entered the engine's queue (the time to first token counts from here)."""
        with self._lock:
            self._submitted[job] = time.perf_counter()

    def figures(self, job: Job) -> dict[str, Any] | None:
        """The reply's own figures (``None`` before its generation ended)."""
        with self._lock:
            return self._figures.get(job)

    # ---- the engine thread --------------------------------------------------------------
    def run(self, prep: Prepared) -> Outcome:
        """The service's run of ``prep``, measured."""
        job = prep.job
        with self._lock:
            submitted = self._submitted.pop(job, None)
        timing = _Timing(submitted if submitted is not None else time.perf_counter())
        inner = job.on_step

        def on_step(step: Step | None, piece: str) -> bool:
            if step is not None:
                timing.token(time.perf_counter())
            return inner(step, piece) if inner is not None else True

        job.on_step = on_step
        before = EngineFigures.of(self.service.worker.engine)
        timing.started = time.perf_counter()
        with self._lock:
            self._running += 1
        try:
            out = self.service.run(prep)
        finally:
            with self._lock:
                self._running -= 1
            job.on_step = inner
        after = EngineFigures.of(self.service.worker.engine)
        self._record(prep, out, timing, before, after)
        return out

    def _record(self, prep: Prepared, out: Outcome, t: _Timing, before: EngineFigures,
                after: EngineFigures) -> None:
        self.prompt_tokens.inc(prep.prompt_tokens)
        self.reused_tokens.inc(out.reused)
        self.generated_tokens.inc(len(out.ids))
        self.generations.labels(out.finish).inc()
        if t.first is not None:
            self.ttft.observe(t.first - t.submitted)
        for gap in t.gaps:
            self.itl.observe(gap)
        rate = None
        if t.first is not None and t.last is not None and t.tokens > 1 and t.last > t.first:
            rate = round((t.tokens - 1) / (t.last - t.first), 3)
        figures = {
            "queue_seconds": round(t.started - t.submitted, 6),
            "first_token_seconds": None if t.first is None else round(t.first - t.started, 6),
            "tokens_per_second": rate,
            "expert_requests": after.expert_requests - before.expert_requests,
            "expert_hits": after.expert_hits - before.expert_hits,
            "expert_misses": after.expert_misses - before.expert_misses,
            "bytes_read": (after.expert_bytes - before.expert_bytes) + (after.trunk_bytes - before.trunk_bytes),
        }
        with self._lock:
            self._figures[prep.job] = figures


def metrics_routes(metrics: Metrics, check_key: Callable[[Request], None]) -> list[Route]:
    """``GET /metrics``, keyed as the ``/v1`` routes are (``check_key``: the app's)."""

    async def scrape(request: Request) -> Response:
        check_key(request)
        body, content_type = metrics.render()
        return Response(body, headers={"Content-Type": content_type})

    return [Route("/metrics", scrape, methods=["GET"])]
