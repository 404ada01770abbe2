"""Decode benchmark: a whole model's speed next to the machine's bandwidth floor, same run.

``run_decode_bench(request, ...)`` opens every engine the way ``k3 run`` does
(:func:`k3core.run.engine.open_engine`: the preset, the environment, the plugins and the
memory plan of the :class:`~k3core.run.request.EngineRequest`; a packed trunk when it names
one) and measures, each ``repeat`` times from a fresh engine (medians reported):

* **s/token**: the median decode step after the first (the first step also prefills the
  prompt), incremental by default;
* **prefill**: ``prefill`` random prompt ids (seeded) and one generated token; seconds and
  prompt tokens per second, and the routed-expert bytes that prefill read and requested
  against ``prefill x`` one token's; with ``prefill_chunk`` the prompt goes in chunks of that
  many ids (each routed expert read once per chunk) and the check is against the one-pass
  numpy run;
* **bytes read per token** (experts and trunk from storage) and **bytes touched per token**
  (the weights one decode step multiplies: trunk layers, lm_head, one embedding row, and
  every routed expert it requests);
* **exposed I/O wait** per token (expert and trunk reads the compute waited for);
* **kernel calls per token** (Python -> kernel backend calls, counted on the leaf ops);
* **the bandwidth floor**: bytes touched per token over the memory read bandwidth measured
  in the same run with the same thread count (``k3core.tools.bench.kernels``);
* **the disk floor** (a run that reads weights from storage as it decodes): the bytes read
  per token over the best read rate of the run's storage backend on the file it streams
  (the packed trunk, else the largest checkpoint shard), measured in the same run
  (``k3core.tools.bench.io.storage_read_rate``): no decode that reads those bytes from that
  device can be faster;
* **the device's own view** of the same steady tokens (Linux): the share of the time the
  disk the run streams from had reads in flight, the rate it read at while busy, and the
  bytes per token over that rate (``k3core.tools.bench.device_counters``): the floor at the
  rate this run actually got, where the probe above measures another minute of a disk whose
  rate may move by 2x;
* **the prefill's compute floor**: the multiply-adds of its weight products (counted at the
  kernel interface from the operands' shapes) over the float64 FMA peak measured in the same
  run on the same threads: under the kernel contract every product is a float64 FMA, so no
  prefill of that model on that machine can take less.

With ``check`` (the default) the same ids are decoded with ``--backend numpy`` and the
generated ids must be identical (the kernel contract is bit-exact), for the decode run
and for the prefill run.

``spec`` (``--spec ngram|auto``, docs/speculative.md) decodes with drafts verified in one
pass; the figures then also come as means over the steady tokens (every token after the
first pass), since a pass's bytes and time land on its first token, and the ids must equal
a ``--spec off`` run's (``spec_ids_match``). ``prompt_file`` (``--prompt-file``) takes the
decode prompt as text through the model's tokenizer instead of ``--ids``.

``batch`` (``--batch B``, B > 1) decodes B sequences together in every timed round, beside
the single-sequence timed run and alternating with it: B distinct prompts of the decode
prompt's length (the first is the decode prompt, the others seeded random ids), greedy, the
same number of tokens each, on B threads of one fresh engine whose passes the model's
scheduler batches (:mod:`k3core.model.scheduler`). It reports, over the steady window (every
row's tokens after its first: the prefill excluded, as s/token excludes it), the aggregate
tokens/s of all rows, the wall seconds of a batched step, the trunk and routed-expert bytes
read and the kernel calls per generated token, the largest batch the scheduler ran and the
sequences per pass, and the ratio to the single-sequence runs' tokens/s over the same window.
With ``check`` every row's ids must equal its prompt decoded alone with ``--backend numpy``.

``python -m k3core.tools.bench.decode MODEL [--trunk DIR] [--backend avx2] [--json]`` (the CLI
wires the same code as ``k3 bench decode``).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from k3core.api.errors import K3Error, UsageError
from k3core.api.kernels import KernelBackend, Mxfp4
from k3core.model.config import ModelConfig
from k3core.model.sizes import sizes_from_config
from k3core.model.speculative import SpecOptions
from k3core.model.steps import Step
from k3core.run.engine import Engine, open_engine
from k3core.run.generate import RunResult, generate
from k3core.run.memory_plan import peak_rss_bytes
from k3core.run.plan import EnginePlan
from k3core.run.request import EngineRequest, build
from k3core.tools.bench import context as ctx
from k3core.tools.bench import device_counters
from k3core.tools.bench.context import check_contexts
from k3core.tools.bench.decode_record import (
    BatchFigures,
    BenchSetup,
    ContextFigures,
    DecodeBench,
    DecodeTiming,
    Floors,
    IdsCheck,
    PrefillFigures,
    TokenBytes,
    format_report,
)

DEFAULT_IDS = (3, 7, 11, 5, 9)
Progress = Callable[[str, int, int], None]
#: Interface members that are not kernel calls (counted ops are every other public method).
_NOT_OPS = {"set_threads", "set_force_parallel", "matmul", "threads", "parallel_forced", "name"}


def kernel_ops(backend: KernelBackend) -> list[str]:
    """The leaf kernel methods of ``backend`` (``matmul`` only dispatches to them)."""
    names = []
    for name in dir(type(backend)):
        if name.startswith("_") or name in _NOT_OPS:
            continue
        if callable(getattr(type(backend), name, None)):
            names.append(name)
    return names


def _tokens(x: Any) -> int:
    """Rows of a matrix product's input (a 1-D input is one token)."""
    shape = getattr(x, "shape", ())
    return int(np.prod(shape[:-1])) if len(shape) > 1 else 1


def _mlp_macs(w1: Any, w2: Any, x: Any) -> int:
    inter, cols = w1.shape
    return (2 * inter * cols + w2.shape[0] * w2.shape[1]) * _tokens(x)


#: the weight-product ops: the only ones with multiply-adds or decoded weights to count
PRODUCT_OPS = frozenset({"matmul_bf16", "matmul_f32", "matmul_mxfp4", "matmul_many", "situ_mlp",
                         "situ_mlp_many", "kda_mix", "mla_mix", "moe_combine", "moe_route"})


def _matrices(op: str, args: tuple[Any, ...]) -> list[tuple[list[Any], int]] | None:
    """The weight matrices a fused layer part multiplies, in groups with the rows each group
    takes (``kda_mix``: its eight matrices over ``x``'s rows; ``mla_mix``: the latent's
    down-projection over every row, the query's, the gate's, ``q_b`` and ``o_proj`` over the
    attending rows; ``moe_route``: the router's gate and the latent down-projection over
    the block's input rows; ``moe_combine``: its up-projection over the summed latent rows)."""
    if op == "kda_mix" and len(args) >= 2:
        w = args[1]
        return [([*w.proj, w.f_b, w.o_proj], _tokens(args[0]))]
    if op == "mla_mix" and len(args) >= 3:
        w, seqs = args[1], args[2]
        rest = [w.q_a, w.q_b, w.o_proj] + ([w.gate] if w.gate is not None else [])
        return [([w.kv_a], _tokens(args[0])), (rest, sum(s.attend for s in seqs))]
    if op == "moe_route" and len(args) >= 6:
        src = args[0]
        return [([args[4], args[5]], int(src.shape[1]) if getattr(src, "ndim", 0) == 3 else 1)]
    if op == "moe_combine" and len(args) >= 5:
        outs = args[1]
        return [([args[4]], int(outs.shape[0]) if getattr(outs, "ndim", 0) == 3 else 1)]
    return None


def product_macs(op: str, args: tuple[Any, ...]) -> int:
    """The multiply-adds of a weight-product op's call (``rows x cols x tokens`` per matrix),
    from its operands' shapes; 0 for every other op."""
    if op in ("matmul_bf16", "matmul_f32", "matmul_mxfp4") and len(args) >= 2:
        rows, cols = args[0].shape
        return rows * cols * _tokens(args[1])
    if op == "matmul_many" and len(args) >= 2:
        return sum(w.shape[0] * w.shape[1] for w in args[0]) * _tokens(args[1])
    if op == "situ_mlp" and len(args) >= 4:
        return _mlp_macs(args[0], args[2], args[3])
    if op == "situ_mlp_many" and len(args) >= 2:
        return sum(_mlp_macs(m[0], m[2], x) for m, x in zip(args[0], args[1], strict=False))
    groups = _matrices(op, args)
    if groups is not None:
        return sum(sum(w.shape[0] * w.shape[1] for w in ws) * t for ws, t in groups)
    return 0


def _mx(w: Any) -> int:
    return int(w.shape[0] * w.shape[1]) if isinstance(w, Mxfp4) else 0


def decoded_weights(op: str, args: tuple[Any, ...]) -> int:
    """The MXFP4 weights a weight-product op's call turns into float64 lanes: every weight of
    each MXFP4 matrix it multiplies by at least one token (the kernels decode a weight once
    for all of a call's tokens at best); 0 for every other op."""
    if op == "matmul_mxfp4" and len(args) >= 2:
        return _mx(args[0]) if _tokens(args[1]) else 0
    if op == "matmul_many" and len(args) >= 2:
        return sum(_mx(w) for w in args[0]) if _tokens(args[1]) else 0
    if op == "situ_mlp" and len(args) >= 4:
        return sum(_mx(w) for w in args[:3]) if _tokens(args[3]) else 0
    if op == "situ_mlp_many" and len(args) >= 2:
        return sum(sum(_mx(w) for w in m[:3]) for m, x in zip(args[0], args[1], strict=False)
                   if _tokens(x))
    groups = _matrices(op, args)
    if groups is not None:
        return sum(sum(_mx(w) for w in ws) for ws, t in groups if t)
    return 0


class CallCounter:
    """Counts calls of every kernel op of one backend instance (wrapping its methods), and
    the wall seconds spent inside them: an op that calls another op (a fused op's fallback)
    is timed once, at the outermost call. Everything else of a token is the engine's own
    work between kernel calls (the *host* time: Python, NumPy glue, waits). With
    ``count_macs``, ``macs`` adds up the weight products' multiply-adds (``product_macs``,
    outermost calls only) and ``decoded`` the MXFP4 weights they decode
    (``decoded_weights``); off, the timed decode steps pay nothing for it."""

    def __init__(self, backend: KernelBackend, count_macs: bool = False):
        self.calls = 0
        self._count_macs = count_macs
        self.seconds = 0.0
        self.macs = 0
        self.decoded = 0
        #: seconds inside each op (outermost calls), by name
        self.op_seconds: dict[str, float] = {}
        self._depth = 0
        for name in kernel_ops(backend):
            setattr(backend, name, self._wrap(name, getattr(backend, name)))

    def _wrap(self, name: str, fn: Any) -> Any:
        count = self._count_macs and name in PRODUCT_OPS  # decided once, not every call

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self._depth:
                return fn(*args, **kwargs)
            if count:
                self.macs += product_macs(name, args)
                self.decoded += decoded_weights(name, args)
            self._depth = 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                self.seconds += dt
                self.op_seconds[name] = self.op_seconds.get(name, 0.0) + dt
                self._depth = 0

        return counted


#: a run's per-step figures (one entry a generated token; a forward pass's land on its first)
PER_STEP = ("seconds", "calls", "expert_bytes", "expert_requests", "trunk_bytes",
            "wait_seconds", "expert_distinct", "trunk_wait", "trunk_read", "kernel_seconds",
            "macs", "decoded", "disk_bytes", "disk_busy")


@dataclass
class RunFigures:
    """One decode run (steps after the first) or one prefill run."""

    seconds: list[float] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)
    expert_bytes: list[int] = field(default_factory=list)
    expert_requests: list[int] = field(default_factory=list)
    trunk_bytes: list[int] = field(default_factory=list)
    wait_seconds: list[float] = field(default_factory=list)
    expert_distinct: list[int] = field(default_factory=list)  # distinct experts per layer visit
    trunk_wait: list[float] = field(default_factory=list)
    trunk_read: list[float] = field(default_factory=list)
    kernel_seconds: list[float] = field(default_factory=list)  # inside the kernel ops
    macs: list[int] = field(default_factory=list)  # the weight products' multiply-adds
    decoded: list[int] = field(default_factory=list)  # the MXFP4 weights they decoded
    #: the streamed-from device's bytes read and seconds busy per step (device_counters.py)
    disk_bytes: list[int] = field(default_factory=list)
    disk_busy: list[float] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    first_pass: int = 1  # tokens the first forward pass emitted (the prefill pass)
    spec: dict[str, Any] | None = None
    chunks: int = 0  # forward passes of a one-step (prefill) run
    stamps: list[float] = field(default_factory=list)  # perf_counter as each token came
    most: int = 0  # the largest batch the model's scheduler ran

    def steady_tokens_per_s(self) -> float:
        """The steady tokens over their wall seconds (from the first pass's last token)."""
        f = self.first_pass
        wall = self.stamps[-1] - self.stamps[f - 1] if len(self.stamps) > f else 0.0
        return (len(self.stamps) - f) / wall if wall > 0 else 0.0

    def steady(self) -> RunFigures:
        """The steps after the first forward pass (the steady tokens)."""
        f = self.first_pass
        return replace(self, chunks=0, **{n: getattr(self, n)[f:] for n in PER_STEP})

    @classmethod
    def pooled(cls, runs: list[RunFigures]) -> RunFigures:
        """Every step of ``runs`` in one list a figure."""
        out = cls()
        for n in PER_STEP:
            setattr(out, n, [x for r in runs for x in getattr(r, n)])
        return out

    def median(self, name: str) -> float:
        return _median([float(x) for x in getattr(self, name)])

    def mean(self, name: str) -> float:
        return _mean([float(x) for x in getattr(self, name)])


def _counters(eng: Engine, counter: CallCounter) -> dict[str, float]:
    """The whole-run counters a step's figures are differences of (named as in PER_STEP)."""
    st = eng.experts.stats
    tstats = getattr(eng.model.trunk, "stats", None)
    trunk_wait = float(getattr(tstats, "exposed_wait_seconds", 0.0) or 0.0)
    return {"calls": counter.calls, "expert_bytes": int(st.bytes_read),
            "expert_requests": int(st.requests),
            "trunk_bytes": int(getattr(tstats, "bytes_read", 0) or 0),
            "wait_seconds": float(st.exposed_wait_seconds) + trunk_wait,
            "expert_distinct": int(st.requests) - int(st.extra.get("reuse", 0)),
            "trunk_wait": trunk_wait,
            "trunk_read": float(getattr(tstats, "read_seconds", 0.0) or 0.0),
            "kernel_seconds": counter.seconds, "macs": counter.macs,
            "decoded": counter.decoded}


def _open(request: EngineRequest, positions: int,
          on_plan: Callable[[EnginePlan], None] | None = None) -> Engine:
    """Every engine the bench opens, opened here (as ``k3 run`` opens one)."""
    return open_engine(request.model_copy(update={"positions": positions}), on_plan=on_plan)


def _decode_run(request: EngineRequest, ids: list[int], gen: int, incremental: bool,
                spec: SpecOptions | None = None, count_macs: bool = False,
                disk: Path | None = None,
                on_token: Callable[[int], None] | None = None) -> RunFigures:
    """One decode from a fresh engine; ``on_token(n)`` after its n-th token."""
    eng = _open(request, len(ids) + gen)
    fig = RunFigures()
    try:
        counter = CallCounter(eng.kernels, count_macs)
        last = [_counters(eng, counter)]
        dev_at = [device_counters.sample(disk)]

        def on_step(st: Step) -> None:
            fig.stamps.append(time.perf_counter())
            dev = device_counters.sample(disk)
            was, dev_at[0] = dev_at[0], dev
            fig.disk_bytes.append(dev.bytes_read - was.bytes_read if dev and was else 0)
            fig.disk_busy.append(dev.busy_seconds - was.busy_seconds if dev and was else 0.0)
            now = _counters(eng, counter)
            prev, last[0] = last[0], now
            fig.seconds.append(st.seconds)
            for name, value in now.items():
                getattr(fig, name).append(value - prev[name])
            if on_token is not None:
                on_token(st.index + 1)

        res: RunResult = generate(eng.model, ids, gen, incremental=incremental, on_step=on_step,
                                  spec=spec)
        fig.ids = list(res.generated_ids)
        if res.spec is not None:
            fig.spec = res.spec.to_json()
            fig.first_pass = int(res.spec.log[0]["emitted"]) if res.spec.log else 1
        fig.chunks = eng.model.chunks_last if gen == 1 else 0
        fig.most = eng.model.scheduler.stats.most
    finally:
        eng.close()
    return fig


class _Stopped(BaseException):
    """Ends a batched run's rows at their next step (Ctrl-C in the bench's thread)."""


@dataclass
class BatchRun:
    """One batched decode run: its rows' ids, and its steady window (every row has its first
    token, the prefill's, to the last row's last token)."""

    ids: list[list[int]]
    seconds: float  # the window's wall seconds
    tokens: int  # generated tokens in it (all rows)
    step_seconds: list[float]  # each steady step: the longest row's (a row's step is its pass)
    trunk_bytes: int
    expert_bytes: int
    calls: int
    passes: int  # the scheduler's passes in it, and the sequences they held
    feeds: int
    most: int  # the largest batch the scheduler ran (the whole run)
    #: the streamed-from device's bytes read and seconds busy in the window (0: unknown)
    disk_bytes: int = 0
    disk_busy: float = 0.0
    #: the engine's memory plan (opened for ``len(ids)`` slots), and the process's peak RSS
    #: over the run (0: unknown)
    plan_bytes: int = 0
    peak_rss: int = 0
    #: the weight products' multiply-adds in the window, and the MXFP4 weights they decoded
    macs: int = 0
    decoded: int = 0
    #: seconds in the window the compute waited for trunk parts and for routed experts, and
    #: seconds inside kernel ops
    trunk_wait: float = 0.0
    expert_wait: float = 0.0
    kernel_seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def _batch_run(request: EngineRequest, prompts: list[list[int]], gen: int, incremental: bool,
               on_token: Callable[[int], None] | None = None,
               disk: Path | None = None) -> BatchRun:
    """``prompts`` decoded together from one fresh engine planned for as many slots (as
    ``k3 serve --max-batch`` plans one), one thread each (greedy, ``gen`` tokens each), their
    passes batched by the model's scheduler; ``on_token(n)`` after the n-th token of all
    rows; ``disk``'s counters sampled over the steady window."""
    n = len(prompts)
    plans: list[EnginePlan] = []
    gc.collect()  # the last run's engine, freed before the peak is reset
    reset = _reset_peak_rss()
    eng = _open(request.model_copy(update={"slots": n}), max(map(len, prompts)) + gen,
                on_plan=plans.append)
    try:
        sched, counter = eng.model.scheduler, CallCounter(eng.kernels, count_macs=True)
        lock, stop, barrier = threading.Lock(), threading.Event(), threading.Barrier(n)
        steps: list[list[tuple[float, Step]]] = [[] for _ in prompts]
        out: list[RunResult | BaseException | None] = [None] * n
        marks: dict[str, tuple[dict[str, float], Any, device_counters.DeviceSample | None]] = {}

        def mark(name: str) -> None:
            marks[name] = (_counters(eng, counter), replace(sched.stats),
                           device_counters.sample(disk))

        def row(i: int) -> None:
            def on_step(st: Step) -> None:
                t = time.perf_counter()
                with lock:
                    steps[i].append((t, st))
                    if "steady" not in marks and all(steps):
                        mark("steady")
                    if on_token is not None:
                        on_token(sum(map(len, steps)))

            def before_step(g: int) -> None:
                if stop.is_set():
                    raise _Stopped

            try:
                with sched.running():  # every row counts as running before any asks
                    barrier.wait()
                    out[i] = generate(eng.model, prompts[i], gen, incremental=incremental,
                                      on_step=on_step, before_step=before_step)
            except BaseException as e:  # handed to the bench's thread
                out[i] = e
                barrier.abort()

        mark("start")
        threads = [threading.Thread(target=row, args=(i,), name=f"k3-bench-row-{i}",
                                    daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        try:
            for t in threads:
                while t.is_alive():
                    t.join(0.2)
        except BaseException:
            stop.set()  # Ctrl-C: every row ends at its next step, then the engine closes
            for t in threads:
                t.join()
            raise
        mark("end")
    finally:
        eng.close()
    peak = _hwm_bytes() if reset else 0
    errors = [r for r in out if isinstance(r, BaseException)]
    if errors:
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)),
                   errors[0])
    (c0, s0, d0), (c1, s1, d1) = marks.get("steady", marks["end"]), marks["end"]
    first = max(r[0][0] for r in steps)
    memory = plans[0].memory if plans else None
    return BatchRun(
        ids=[list(r.generated_ids) for r in out if isinstance(r, RunResult)],
        seconds=max(r[-1][0] for r in steps) - first,
        tokens=sum(len(r) - 1 for r in steps),
        step_seconds=[max(r[k][1].seconds for r in steps if len(r) > k)
                      for k in range(1, max(map(len, steps)))],
        trunk_bytes=int(c1["trunk_bytes"] - c0["trunk_bytes"]),
        expert_bytes=int(c1["expert_bytes"] - c0["expert_bytes"]),
        calls=int(c1["calls"] - c0["calls"]), passes=s1.passes - s0.passes,
        feeds=s1.feeds - s0.feeds, most=s1.most,
        disk_bytes=d1.bytes_read - d0.bytes_read if d0 and d1 else 0,
        disk_busy=d1.busy_seconds - d0.busy_seconds if d0 and d1 else 0.0,
        plan_bytes=memory.total if memory is not None else 0, peak_rss=peak,
        macs=int(c1["macs"] - c0["macs"]), decoded=int(c1["decoded"] - c0["decoded"]),
        trunk_wait=c1["trunk_wait"] - c0["trunk_wait"],  # wait_seconds: experts' and trunk's
        expert_wait=c1["wait_seconds"] - c0["wait_seconds"] - (c1["trunk_wait"] - c0["trunk_wait"]),
        kernel_seconds=c1["kernel_seconds"] - c0["kernel_seconds"])


def _batch_prompts(ids: list[int], batch: int, vocab: int, seed: int) -> list[list[int]]:
    """``batch`` distinct prompts of ``len(ids)`` ids: ``ids`` first, then seeded random ids."""
    if batch > 1 and vocab ** len(ids) < batch:
        raise UsageError(f"bench decode: --batch {batch} needs {batch} distinct prompts of "
                         f"{len(ids)} ids; the vocabulary has {vocab} ids")
    rng = np.random.default_rng([seed, 1])
    prompts = [list(ids)]
    while len(prompts) < batch:
        p = [int(i) for i in rng.integers(0, vocab, len(ids))]
        if p not in prompts:
            prompts.append(p)
    return prompts


def _reset_peak_rss() -> bool:
    """Reset this process's peak RSS (Linux ``clear_refs`` 5); ``False`` where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _hwm_bytes() > 0
    except OSError:
        return False


def _hwm_bytes() -> int:
    """``VmHWM`` (peak RSS since the last reset) in bytes, 0 when unknown."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else 0.0


@dataclass(frozen=True)
class BenchArgs:
    """What a decode bench measures beside its engine (the engine is the request's), checked
    once here (every refusal exit 2)."""

    ids: list[int] | None = None  # the decode prompt (default DEFAULT_IDS)
    gen: int = 32
    prefill: int = 128
    repeat: int = 3
    check: bool = True
    seed: int = 0
    bandwidth_bytes: int = 1 << 30
    spec: SpecOptions | None = None
    prompt_file: Path | None = None
    batch: int = 1  # sequences decoded together (1: the single-sequence runs only)
    contexts: tuple[int, ...] = ()  # --context: positions of the built contexts

    def __post_init__(self) -> None:
        check_contexts(list(self.contexts))
        if self.contexts and self.speculative is not None:
            raise UsageError("bench decode: --context decodes with --spec off")
        for flag, value, least in (("--gen", self.gen, 2), ("--repeat", self.repeat, 1),
                                   ("--prefill", self.prefill, 0), ("--batch", self.batch, 1)):
            if value < least:
                raise UsageError(f"bench decode: {flag} must be >= {least}, got {value}")
        if self.bandwidth_bytes < 1:
            raise UsageError(f"bench decode: --bandwidth-mb must be > 0, got "
                             f"{self.bandwidth_bytes / 1e6:g}")
        if self.ids is not None and not self.ids:
            raise UsageError("bench decode: --ids names no id")
        if self.batch > 1 and self.speculative is not None:
            raise UsageError("bench decode: --batch above 1 decodes with --spec off (a batched "
                             "step verifies no drafts)")

    @property
    def speculative(self) -> SpecOptions | None:
        return self.spec if self.spec is not None and self.spec.on else None

    @property
    def check_tokens(self) -> int:
        """Tokens the check runs generate (the progress of the ``check`` stage)."""
        if not self.check:
            return 0
        return (self.gen + (1 if self.prefill else 0) + (self.gen if self.speculative else 0)
                + (self.batch - 1) * self.gen)

    @property
    def context_tokens(self) -> int:
        """Tokens the ``--context`` runs generate, and their check (the ``context`` stage)."""
        return len(self.contexts) * self.gen * (self.repeat + (1 if self.check else 0))


@dataclass
class _Plan:
    """The bench's engines and what the probe engine told (it is closed before any run)."""

    timed: EngineRequest  # the timed decode runs (and the --spec off check)
    prefilled: EngineRequest  # the prefill runs (the request's prefill_chunk)
    checked: EngineRequest  # the --backend numpy checks
    cfg: ModelConfig
    kernel: str
    threads: int
    storage: str
    shards: list[Path]
    readers: int
    incremental: bool
    model_dir: Path
    trunk_dir: Path | None
    stat: Path | None  # the counters of the device the runs stream from (device_counters.py)
    ids: list[int]
    prompts: list[list[int]] = field(default_factory=list)  # the --batch rows' prompts


def run_decode_bench(
    request: EngineRequest,
    *,
    ids: list[int] | None = None,
    gen: int = 32,
    prefill: int = 128,
    repeat: int = 3,
    check: bool = True,
    seed: int = 0,
    bandwidth_bytes: int = 1 << 30,
    spec: SpecOptions | None = None,
    prompt_file: Path | None = None,
    batch: int = 1,
    contexts: list[int] | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> DecodeBench:
    """Measure decode and prefill ``repeat`` times each (fresh engines); see the module doc.

    Every engine opens from ``request`` (its ``prefill_chunk`` applies to the prefill runs
    only; the checks run ``--backend numpy``).

    ``progress(stage, done, total)`` hears each stage as it goes: ``timed`` (tokens of the
    timed decode runs), ``prefill`` (runs), ``yardsticks`` (the bandwidth and FMA loops) and
    ``check`` (tokens of the ``--backend numpy`` and ``--spec off`` runs). ``batch`` > 1 adds
    a batched run of that many sequences after each timed run (its tokens in ``timed``);
    ``contexts`` adds decode runs at built contexts of those many positions
    (k3core/tools/bench/context.py; their tokens and checks in ``context``)."""
    args = BenchArgs(ids, gen, prefill, repeat, check, seed, bandwidth_bytes, spec, prompt_file,
                     batch, tuple(contexts or ()))
    say = progress or (lambda stage, done, total: None)
    plan = _probe(request, args)
    if args.contexts:  # refused before any run
        check_contexts(list(args.contexts), plan.cfg)
        if not plan.incremental:
            raise UsageError("bench decode: --context needs incremental decoding (a built "
                             "context is a kept state)")
    runs, bruns, peak = _timed_runs(plan, args, say)
    steady = [r.steady() for r in runs]
    pids, pruns = _prefill_runs(plan, args, say)
    floors = _yardsticks(plan, args, RunFigures.pooled(steady), pruns, say)
    context = _context_figures(plan, args, floors, say)
    checked = _check_ids(plan, args, pids, runs, pruns, bruns, say)
    means = [s.mean("seconds") for s in steady]
    mid = sorted(range(len(steady)), key=lambda i: means[i])[len(steady) // 2]
    return DecodeBench(
        setup=BenchSetup(model=str(plan.model_dir), backend=plan.kernel, threads=plan.threads,
                         incremental=plan.incremental,
                         trunk=str(plan.trunk_dir) if plan.trunk_dir else None, ids=plan.ids,
                         gen=gen, repeat=repeat,
                         spec=args.speculative.mode if args.speculative else "off",
                         expert_readers=plan.readers),
        timing=_timing(steady, means, mid, peak, runs[mid].spec),
        bytes=_token_bytes(plan, steady, mid),
        floors=floors,
        prefill=_prefill_figures(plan, args, pruns),
        check=checked,
        batch=_batch_figures(plan, runs, steady, bruns, floors),
        context=context,
    )


def _probe(request: EngineRequest, args: BenchArgs) -> _Plan:
    """Open one engine to learn the model, the resolved plugins and the prompt, then close it
    (its buffers must not count in the timed runs' peak RSS)."""
    ids = list(args.ids or DEFAULT_IDS)
    timed = request.model_copy(update={"prefill_chunk": None, "needs_tokenizer":
                                       args.prompt_file is not None})
    probe = _open(timed, len(ids) + args.gen)
    try:
        if args.prompt_file is not None:
            ids = _prompt_ids(probe.tokenizer, args.prompt_file)
        plan = _Plan(timed=timed,
                     prefilled=timed.model_copy(update={"prefill_chunk": request.prefill_chunk}),
                     checked=timed.model_copy(update={"backend": "numpy"}),
                     cfg=probe.cfg, kernel=probe.names["kernel"],
                     threads=probe.kernels.threads, storage=probe.names["storage"],
                     shards=list(probe.index.shards),
                     readers=int(getattr(probe.experts, "readers", 0) or 0),
                     incremental=probe.incremental, model_dir=probe.plan.model_dir,
                     trunk_dir=request.trunk, ids=ids,
                     stat=device_counters.stat_file_of(
                         _streamed_file(request.trunk, list(probe.index.shards))))
    finally:
        probe.close()
    del probe
    gc.collect()
    if any(not 0 <= i < plan.cfg.vocab for i in plan.ids):
        raise UsageError(f"bench decode: prompt ids must be in 0..{plan.cfg.vocab - 1}")
    plan.prompts = _batch_prompts(plan.ids, args.batch, plan.cfg.vocab, args.seed)
    return plan


def _tokens_of(say: Progress, stage: str, before: int, total: int) -> Callable[[int], None]:
    return lambda n: say(stage, before + n, total)


def _timed_runs(plan: _Plan, args: BenchArgs, say: Progress
                ) -> tuple[list[RunFigures], list[BatchRun], int]:
    """The timed decode runs, each from a fresh engine, each followed by a batched run (with
    ``--batch`` above 1); and the peak RSS of each single-sequence run alone."""
    batched = args.batch > 1
    per = args.gen * (1 + (args.batch if batched else 0))
    runs, bruns, peak, total = [], [], 0, args.repeat * per
    say("timed", 0, total)
    for i in range(args.repeat):  # the peak of each timed run alone (the probe's is forgotten)
        gc.collect()  # the last run's engine, freed before the peak is reset
        reset = _reset_peak_rss()
        runs.append(_decode_run(plan.timed, plan.ids, args.gen, plan.incremental,
                                args.speculative, disk=plan.stat,
                                on_token=_tokens_of(say, "timed", i * per, total)))
        peak = max(peak, _hwm_bytes() if reset else peak_rss_bytes())
        if batched:
            bruns.append(_batch_run(plan.timed, plan.prompts, args.gen, plan.incremental,
                                    _tokens_of(say, "timed", i * per + args.gen, total),
                                    disk=plan.stat))
    return runs, bruns, peak


def _prefill_runs(plan: _Plan, args: BenchArgs, say: Progress
                  ) -> tuple[list[int], list[RunFigures]]:
    """``prefill`` random ids (seeded) and one token, ``repeat`` times; multiply-adds counted."""
    if not args.prefill:
        return [], []
    rng = np.random.default_rng(args.seed)
    pids = [int(i) for i in rng.integers(0, plan.cfg.vocab, args.prefill)]
    say("prefill", 0, args.repeat)
    return pids, [_decode_run(plan.prefilled, pids, 1, True, count_macs=True,
                              on_token=_tokens_of(say, "prefill", i, args.repeat))
                  for i in range(args.repeat)]


def _yardsticks(plan: _Plan, args: BenchArgs, pooled: RunFigures, pruns: list[RunFigures],
                say: Progress) -> Floors:
    """The memory bandwidth, the FMA peak (with a prefill) and the storage read rate, each
    measured now on this machine, and the floors they give."""
    from k3core.tools.bench.kernels import (
        measure_decode_peak,
        measure_fma_peak,
        measure_read_bandwidth,
    )

    say("yardsticks", 0, 2)
    bw, how = measure_read_bandwidth(plan.threads, max(1 << 20, args.bandwidth_bytes))
    say("yardsticks", 1, 2)
    batched = len(plan.prompts) > 1
    fma, fma_how = (measure_fma_peak(plan.threads) if args.prefill or batched or args.contexts
                    else (0.0, ""))
    dec, dec_how = measure_decode_peak(plan.threads) if batched else (0.0, "")
    say("yardsticks", 2, 2)
    touched = _touched_per_token(plan.cfg, pooled)
    pmacs = pruns[0].macs[0] if pruns else 0
    read_per_token = pooled.median("expert_bytes") + pooled.median("trunk_bytes")
    disk, disk_how = (_disk_rate(plan.storage, plan.trunk_dir, plan.shards, plan.readers)
                      if read_per_token > 0 else (0.0, ""))
    busy, dev_bytes = sum(pooled.disk_busy), sum(pooled.disk_bytes)
    while_busy = dev_bytes / busy / 1e9 if busy > 0 else 0.0
    return Floors(
        bandwidth_gb_s=bw, bandwidth_how=how,
        floor_seconds_per_token=touched / (bw * 1e9) if bw > 0 else 0.0,
        disk_read_gb_s=disk, disk_read_how=disk_how,
        io_floor_seconds_per_token=read_per_token / (disk * 1e9) if disk > 0 else 0.0,
        disk_device=device_counters.device_name(plan.stat) if busy > 0 else "",
        disk_busy_share=busy / sum(pooled.seconds) if busy > 0 and pooled.seconds else 0.0,
        disk_gb_s_while_busy=while_busy,
        device_floor_seconds_per_token=(read_per_token / (while_busy * 1e9)
                                        if while_busy > 0 else 0.0),
        fma_peak_gmacs=fma, fma_how=fma_how,
        prefill_compute_floor_seconds=pmacs / (fma * 1e9) if fma > 0 else 0.0,
        decode_peak_gweights=dec, decode_how=dec_how,
    )


def _context_figures(plan: _Plan, args: BenchArgs, floors: Floors,
                     say: Progress) -> ContextFigures:
    """The ``--context`` runs: ``--repeat`` rounds over the contexts, each run from a fresh
    engine planned for its positions; with the check, every context decoded once more on
    one ``--backend numpy`` engine from its own seed prefill."""
    if not args.contexts:
        return ContextFigures()
    ns = list(args.contexts)
    seed = ctx.seed_ids(plan.cfg, args.seed, min(ctx.SEED_IDS, min(ns) - 1))
    runs: dict[int, list[ctx.ContextRun]] = {n: [] for n in ns}
    total, done = args.context_tokens, 0
    for _ in range(args.repeat):
        for n in ns:
            gc.collect()
            eng = _open(plan.timed, n + args.gen)
            try:
                counter = CallCounter(eng.kernels)
                # every engine prefills the seed itself: the same bytes each time, and its
                # expert cache as warm as every other context's
                snap = ctx.seed_state(eng, seed)
                runs[n].append(ctx.context_run(eng, snap, seed, n, args.gen,
                                               counter.op_seconds.copy,
                                               _tokens_of(say, "context", done, total)))
            finally:
                eng.close()
            done += args.gen
    fig = ContextFigures(**ctx.summary(runs), context_seed_ids=len(seed),
                         context_generated_ids=[runs[n][0].ids for n in ns])
    fig.context_attention_seconds_per_position = ctx.slope(
        ns, fig.context_attention_seconds_per_token)
    fig.context_attention_floor_per_position = ctx.attention_floor_per_position(
        plan.cfg, floors.fma_peak_gmacs)
    if args.check:
        eng = _open(plan.checked, max(ns) + args.gen)
        try:
            own = ctx.seed_state(eng, seed)
            want = []
            for n in ns:
                want.append(ctx.context_run(eng, own, seed, n, args.gen, dict,
                                            _tokens_of(say, "context", done, total)).ids)
                done += args.gen
        finally:
            eng.close()
        fig.context_ids_match = all(r.ids == w for n, w in zip(ns, want, strict=True)
                                    for r in runs[n])
    return fig


def _check_ids(plan: _Plan, args: BenchArgs, pids: list[int], runs: list[RunFigures],
               pruns: list[RunFigures], bruns: list[BatchRun], say: Progress) -> IdsCheck:
    """The same ids decoded with ``--backend numpy`` (decode and prefill), and with
    ``--spec off`` when speculating: the ids must be the timed runs'. Every batched row's
    ids must be its prompt's decoded alone with ``--backend numpy``."""
    out = IdsCheck(generated_ids=runs[0].ids, checked_against="numpy" if args.check else None,
                   batch_generated_ids=bruns[0].ids if bruns else [])
    if not args.check:
        return out
    total = args.check_tokens
    say("check", 0, total)
    want = _decode_run(plan.checked, plan.ids, args.gen, plan.incremental,
                       on_token=_tokens_of(say, "check", 0, total)).ids
    match = all(r.ids == want for r in runs)
    if args.prefill:
        pwant = _decode_run(plan.checked, pids, 1, True,
                            on_token=_tokens_of(say, "check", args.gen, total)).ids
        match = match and all(r.ids == pwant for r in pruns)
    out.ids_match = match
    if not match:
        out.notes.append("generated ids differ from --backend numpy: the kernel contract is broken")
    if args.speculative is not None:
        out.spec_ids_match = runs[0].ids == _decode_run(
            plan.timed, plan.ids, args.gen, plan.incremental,
            on_token=_tokens_of(say, "check", total - args.gen, total)).ids
        if not out.spec_ids_match:
            out.notes.append("generated ids differ from --spec off: speculation is not exact")
    if bruns:
        done = total - (args.batch - 1) * args.gen
        alone = [want] + _alone_ids(plan, plan.prompts[1:], args.gen,
                                    _tokens_of(say, "check", done, total))
        out.batch_ids_match = all(r.ids == alone for r in bruns)
        if not out.batch_ids_match:
            bad = sorted({i for r in bruns for i, (a, b) in enumerate(zip(r.ids, alone,
                                                                          strict=True)) if a != b})
            out.notes.append(f"batched rows {','.join(map(str, bad))} differ from their prompts "
                             "decoded alone with --backend numpy: batching changed the ids")
    return out


def _alone_ids(plan: _Plan, prompts: list[list[int]], gen: int,
               on_token: Callable[[int], None]) -> list[list[int]]:
    """Each prompt decoded alone, one after the other, on one ``--backend numpy`` engine."""
    if not prompts:
        return []
    eng = _open(plan.checked, max(map(len, prompts)) + gen)
    try:
        out: list[list[int]] = []
        for p in prompts:
            before = len(out) * gen

            def on_step(st: Step, before: int = before) -> None:
                on_token(before + st.index + 1)

            out.append(list(generate(eng.model, p, gen, incremental=plan.incremental,
                                     on_step=on_step).generated_ids))
        return out
    finally:
        eng.close()


def _batch_floors(plan: _Plan, steady: list[RunFigures], bruns: list[BatchRun],
                  floors: Floors) -> dict[str, Any]:
    """The floors of a batched step and of a single sequence's, from the same run's
    yardsticks, and the speedup they allow (``BatchFigures``' ``batch_*floor*`` fields).

    A batched step's compute floor: every MXFP4 weight it decodes (once a call at best) at
    the decode ceiling, every other multiply-add at the FMA peak; its memory floor: the
    trunk a token touches plus the decoded experts' packed bytes over the read bandwidth.
    A single sequence's floor is the larger of its bandwidth floor and the same compute
    floor for one row (a row's multiply-adds are the step's over B; its experts, each with
    one token, are all decoded). A run that reads weights from storage as it decodes has a
    disk floor besides (the bytes the engine read in the window a step, or a token alone,
    over the storage read rate measured in the same run), and the larger floor counts."""
    fma, dec, bw = floors.fma_peak_gmacs * 1e9, floors.decode_peak_gweights * 1e9, \
        floors.bandwidth_gb_s * 1e9
    passes = [max(1, b.passes) for b in bruns]
    if not (fma > 0 and dec > 0 and bw > 0) or not all(b.macs for b in bruns):
        return {}
    B = len(plan.prompts)
    macs = _median([b.macs / n for b, n in zip(bruns, passes, strict=True)])
    decoded = _median([b.decoded / n for b, n in zip(bruns, passes, strict=True)])
    cfg = plan.cfg
    pooled = RunFigures.pooled(steady)
    requests = pooled.median("expert_requests")
    sizes = sizes_from_config(cfg)
    mx_bytes = sizes.expert_bytes / (3 * cfg.moe_inter * cfg.latent)  # per MXFP4 weight
    compute = (macs - decoded) / fma + decoded / dec
    others = _touched_per_token(cfg, pooled) - requests * sizes.expert_bytes
    memory = (others + decoded * mx_bytes) / bw
    one_decoded = requests * 3 * cfg.moe_inter * cfg.latent
    one = max(floors.floor_seconds_per_token, (macs / B - one_decoded) / fma + one_decoded / dec)
    disk_rate = floors.disk_read_gb_s * 1e9
    disk = 0.0
    if disk_rate > 0:
        disk = _median([(b.trunk_bytes + b.expert_bytes) / n
                        for b, n in zip(bruns, passes, strict=True)]) / disk_rate
        one = max(one, floors.io_floor_seconds_per_token)
    floor = max(compute, memory, disk)
    return {"batch_macs_per_step": macs, "batch_decoded_per_step": decoded,
            "batch_compute_floor_per_step": compute, "batch_memory_floor_per_step": memory,
            "batch_disk_floor_per_step": disk,
            "batch_floor_per_step": floor, "batch_single_floor_per_token": one,
            "batch_floor_speedup": B * one / floor if floor > 0 else None}


def _batch_figures(plan: _Plan, runs: list[RunFigures], steady: list[RunFigures],
                   bruns: list[BatchRun], floors: Floors) -> BatchFigures:
    """The ``--batch`` figures: of the batched runs beside the single-sequence ones, or (B = 1)
    of the single-sequence runs themselves."""
    single = [r.steady_tokens_per_s() for r in runs]
    if not bruns:
        pooled = RunFigures.pooled(steady)
        n = len(pooled.seconds)
        return BatchFigures(
            batch=1, aggregate_tokens_per_s=_median(single), aggregate_tokens_per_s_runs=single,
            s_per_step=_median([s.median("seconds") for s in steady]),
            s_per_step_runs=[s.median("seconds") for s in steady],
            trunk_bytes_per_token=sum(pooled.trunk_bytes) / n if n else 0.0,
            expert_bytes_per_token=sum(pooled.expert_bytes) / n if n else 0.0,
            batch_calls_per_token=sum(pooled.calls) / n if n else 0.0,
            batch_most=min(r.most for r in runs), rows_per_pass=1.0, batch_prompts=plan.prompts)
    agg = [b.tokens_per_s for b in bruns]
    steps = [_median(b.step_seconds) for b in bruns]
    per = [max(1, b.tokens) for b in bruns]
    nsteps = [max(1, len(b.step_seconds)) for b in bruns]
    return BatchFigures(
        batch=len(plan.prompts), aggregate_tokens_per_s=_median(agg),
        aggregate_tokens_per_s_runs=agg, s_per_step=_median(steps), s_per_step_runs=steps,
        trunk_bytes_per_token=_median([b.trunk_bytes / t for b, t in zip(bruns, per, strict=True)]),
        expert_bytes_per_token=_median([b.expert_bytes / t for b, t in zip(bruns, per,
                                                                             strict=True)]),
        batch_calls_per_token=_median([b.calls / t for b, t in zip(bruns, per, strict=True)]),
        batch_most=min(b.most for b in bruns),
        rows_per_pass=_median([b.feeds / b.passes if b.passes else 0.0 for b in bruns]),
        batch_device_busy_share=_median([b.disk_busy / b.seconds for b in bruns])
        if all(b.disk_busy > 0 and b.seconds > 0 for b in bruns) else None,
        batch_device_rate=_median([b.disk_bytes / b.disk_busy for b in bruns])
        if all(b.disk_busy > 0 for b in bruns) else None,
        batch_device_busy_per_step=_median([b.disk_busy / n for b, n in zip(bruns, nsteps, strict=True)])
        if all(b.disk_busy > 0 for b in bruns) else None,
        batch_trunk_wait_per_step=_median([b.trunk_wait / n for b, n in zip(bruns, nsteps, strict=True)]),
        batch_expert_wait_per_step=_median([b.expert_wait / n for b, n in zip(bruns, nsteps,
                                                                               strict=True)]),
        batch_kernel_per_step=_median([b.kernel_seconds / n for b, n in zip(bruns, nsteps,
                                                                             strict=True)]),
        batch_plan_bytes=max(b.plan_bytes for b in bruns),
        batch_peak_rss_bytes=max(b.peak_rss for b in bruns),
        batch_prompts=plan.prompts, baseline_tokens_per_s=_median(single),
        baseline_tokens_per_s_runs=single,
        batch_speedup=_median(agg) / _median(single) if _median(single) > 0 else None,
        **_batch_floors(plan, steady, bruns, floors))


def _touched_per_token(cfg: ModelConfig, pooled: RunFigures) -> int:
    """The weights one decode step multiplies: trunk layers, lm_head, one embedding row, and
    every routed expert it requests (the median count)."""
    sizes = sizes_from_config(cfg)
    return (sizes.trunk_bytes + cfg.vocab * cfg.hidden * 2 + sizes.embed_row_bytes
            + int(round(pooled.median("expert_requests"))) * sizes.expert_bytes)


def _timing(steady: list[RunFigures], means: list[float], mid: int, peak: int,
            spec: dict[str, Any] | None) -> DecodeTiming:
    pooled = RunFigures.pooled(steady)
    per_run = [s.median("seconds") for s in steady]
    return DecodeTiming(
        seconds_per_token=_median(per_run), seconds_per_token_runs=per_run,
        mean_seconds_per_token=means[mid], mean_seconds_per_token_runs=means,
        passes_per_token=_passes_per_token(steady[mid]), speculative=spec,
        calls_per_token=pooled.median("calls"),
        kernel_seconds_per_token=_median(pooled.kernel_seconds),
        host_seconds_per_token=_median([t - kt for t, kt in
                                        zip(pooled.seconds, pooled.kernel_seconds, strict=True)]),
        peak_rss_bytes=peak,
    )


def _token_bytes(plan: _Plan, steady: list[RunFigures], mid: int) -> TokenBytes:
    pooled = RunFigures.pooled(steady)
    sizes = sizes_from_config(plan.cfg)
    read = sum(pooled.trunk_read)
    return TokenBytes(
        expert_bytes_read_per_token=pooled.median("expert_bytes"),
        trunk_bytes_read_per_token=pooled.median("trunk_bytes"),
        bytes_touched_per_token=_touched_per_token(plan.cfg, pooled),
        exposed_wait_per_token=_median(pooled.wait_seconds),
        mean_expert_bytes_read_per_token=steady[mid].mean("expert_bytes"),
        mean_trunk_bytes_read_per_token=steady[mid].mean("trunk_bytes"),
        trunk_bytes_touched_per_token=sizes.trunk_bytes * _passes_per_token(steady[mid]),
        expert_bytes_touched_per_token=steady[mid].mean("expert_distinct") * sizes.expert_bytes,
        trunk_exposed_wait_per_token=_median(pooled.trunk_wait),
        trunk_read_seconds_per_token=_median(pooled.trunk_read),
        trunk_overlap=max(0.0, 1.0 - sum(pooled.trunk_wait) / read) if read > 0 else 0.0,
    )


def _prefill_figures(plan: _Plan, args: BenchArgs, pruns: list[RunFigures]) -> PrefillFigures:
    sizes = sizes_from_config(plan.cfg)
    per_token = args.prefill * plan.cfg.topk * sizes.n_moe_layers * sizes.expert_bytes
    chunk = plan.prefilled.prefill_chunk
    if not pruns:
        return PrefillFigures(prefill_ids=args.prefill, prefill_chunk=chunk,
                              prefill_expert_bytes_if_per_token=per_token)
    psec = [r.seconds[0] for r in pruns]
    first = pruns[0]
    return PrefillFigures(
        prefill_ids=args.prefill, prefill_seconds=_median(psec), prefill_seconds_runs=psec,
        prefill_tokens_per_s=args.prefill / _median(psec) if _median(psec) > 0 else 0.0,
        prefill_expert_requests=first.expert_requests[0],
        prefill_expert_bytes_read=first.expert_bytes[0],
        prefill_expert_bytes_if_per_token=per_token, prefill_chunk=chunk,
        prefill_chunks=first.chunks, prefill_calls=first.calls[0],
        prefill_generated_ids=first.ids, prefill_macs=first.macs[0],
    )


def _streamed_file(trunk_dir: Path | None, shards: list[Path]) -> Path | None:
    """The file a run streams from: the packed trunk, else the largest shard."""
    from k3core.trunk.manifest import DATA_NAME

    if trunk_dir is not None:
        return trunk_dir / DATA_NAME
    return max(shards, key=lambda p: p.stat().st_size) if shards else None


def _disk_rate(storage: str, trunk_dir: Path | None, shards: list[Path],
               readers: int) -> tuple[float, str]:
    """The read rate of the file a run streams: the packed trunk, else the largest shard."""
    from k3core.tools.bench.io import storage_read_rate

    path = _streamed_file(trunk_dir, shards)
    if path is None:
        return 0.0, ""
    return storage_read_rate(storage, path, (1, max(1, readers)))


def _mean(xs: list[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0


def _passes_per_token(fig: RunFigures) -> float:
    """Forward passes per steady token (1 without --spec)."""
    if fig.spec is None:
        return 1.0
    log = fig.spec["log"][1:]
    tokens = sum(int(e["emitted"]) for e in log)
    return len(log) / tokens if tokens else 1.0


def _prompt_ids(tokenizer: Any, path: Path) -> list[int]:
    if tokenizer is None:
        raise UsageError("bench decode: --prompt-file needs the model's tokenizer files")
    try:
        text = path.read_bytes().decode("utf-8", "surrogateescape")
    except OSError as exc:
        raise UsageError(f"bench decode: cannot read --prompt-file {path}: "
                         f"{exc.strerror or exc}") from None
    ids = [int(i) for i in tokenizer.encode(text)]
    if not ids:
        raise UsageError(f"bench decode: --prompt-file {path} holds no tokens")
    return ids


def _ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"bench decode: --ids must be comma-separated integers, got {text!r}") from None


def contexts_of(text: str) -> list[int]:
    """``--context``: comma-separated positions, ``K`` for 1,024 allowed (``1K,8K,32K``)."""
    out = []
    for part in (x.strip() for x in text.split(",")):
        if not part:
            continue
        scale = 1024 if part[-1] in "kK" else 1
        try:
            out.append(int(part[:-1] if scale > 1 else part) * scale)
        except ValueError:
            raise UsageError(f"bench decode: --context must be comma-separated positions "
                             f"(1024 or 1K), got {text!r}") from None
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3core.tools.bench.decode",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--backend", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--storage", default=None)
    ap.add_argument("--cache-gb", type=float, default=None)
    ap.add_argument("--trunk", type=Path, default=None)
    ap.add_argument("--trunk-gb", type=float, default=None)
    ap.add_argument("--ids", default=",".join(map(str, DEFAULT_IDS)))
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--prefill-chunk", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--full-recompute", action="store_true")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--spec", default="off")
    ap.add_argument("--spec-width", type=int, default=4)
    ap.add_argument("--spec-ngram", type=int, default=3)
    ap.add_argument("--prompt-file", type=Path, default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", default="")
    a = ap.parse_args(argv)
    try:
        given = {"model_dir": a.model, "backend": a.backend, "threads": a.threads,
                 "storage": a.storage, "cache_gb": a.cache_gb, "trunk": a.trunk,
                 "trunk_gb": a.trunk_gb, "prefill_chunk": a.prefill_chunk,
                 "incremental": False if a.full_recompute else None}
        request = build(EngineRequest, {**{k: v for k, v in given.items() if v is not None},
                                        "given_as": "flag"})
        res = run_decode_bench(request, ids=_ids(a.ids), gen=a.gen, prefill=a.prefill,
                               repeat=a.repeat, check=not a.no_check,
                               spec=SpecOptions(a.spec, a.spec_width, a.spec_ngram),
                               prompt_file=a.prompt_file, batch=a.batch,
                               contexts=contexts_of(a.context))
    except K3Error as exc:
        print(f"k3: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, UsageError) else 1
    print(res.to_json() if a.json else format_report(res))
    c = res.check
    return 0 if False not in (c.ids_match, c.spec_ids_match, c.batch_ids_match,
                              res.context.context_ids_match) else 1


if __name__ == "__main__":
    sys.exit(main())
