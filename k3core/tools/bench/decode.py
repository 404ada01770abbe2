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

``python -m k3core.tools.bench.decode MODEL [--trunk DIR] [--backend avx2] [--json]`` (the CLI
wires the same code as ``k3 bench decode``).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from k3core.api.errors import K3Error, UsageError
from k3core.api.kernels import KernelBackend
from k3core.model.generate import RunResult, Step, generate
from k3core.model.sizes import sizes_from_config
from k3core.model.speculative import SpecOptions
from k3core.run.engine import Engine, open_engine
from k3core.run.memory_plan import peak_rss_bytes
from k3core.run.request import EngineRequest, build
from k3core.tools.bench import device_counters

DEFAULT_IDS = (3, 7, 11, 5, 9)
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
    return 0


class CallCounter:
    """Counts calls of every kernel op of one backend instance (wrapping its methods), and
    the wall seconds spent inside them: an op that calls another op (a fused op's fallback)
    is timed once, at the outermost call. Everything else of a token is the engine's own
    work between kernel calls (the *host* time: Python, NumPy glue, waits). With
    ``count_macs``, ``macs`` adds up the weight products' multiply-adds (``product_macs``,
    outermost calls only); off, the timed decode steps pay nothing for it."""

    def __init__(self, backend: KernelBackend, count_macs: bool = False):
        self.calls = 0
        self._count_macs = count_macs
        self.seconds = 0.0
        self.macs = 0
        self._depth = 0
        for name in kernel_ops(backend):
            setattr(backend, name, self._wrap(name, getattr(backend, name)))

    def _wrap(self, name: str, fn: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self._depth:
                return fn(*args, **kwargs)
            if self._count_macs:
                self.macs += product_macs(name, args)
            self._depth = 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self._depth = 0

        return counted


@dataclass
class RunFigures:
    """One decode run (steps after the first) or one prefill run."""

    seconds: list[float] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)
    expert_bytes: list[int] = field(default_factory=list)
    expert_requests: list[int] = field(default_factory=list)
    trunk_bytes: list[int] = field(default_factory=list)
    wait_seconds: list[float] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    first_pass: int = 1  # tokens the first forward pass emitted (the prefill pass)
    spec: dict[str, Any] | None = None
    expert_distinct: list[int] = field(default_factory=list)  # distinct experts per layer visit
    chunks: int = 0  # forward passes of a one-step (prefill) run
    trunk_wait: list[float] = field(default_factory=list)
    trunk_read: list[float] = field(default_factory=list)
    kernel_seconds: list[float] = field(default_factory=list)  # inside the kernel ops
    macs: list[int] = field(default_factory=list)  # the weight products' multiply-adds
    #: the streamed-from device's bytes read and seconds busy per step (device_counters.py)
    disk_bytes: list[int] = field(default_factory=list)
    disk_busy: list[float] = field(default_factory=list)


def _counters(eng: Engine, counter: CallCounter) -> tuple[int, int, int, int, float, int, float, float]:
    st = eng.experts.stats
    tstats = getattr(eng.model.trunk, "stats", None)
    tb = int(getattr(tstats, "bytes_read", 0) or 0)
    tw = float(getattr(tstats, "exposed_wait_seconds", 0.0) or 0.0)
    distinct = int(st.requests) - int(st.extra.get("reuse", 0))
    tr = float(getattr(tstats, "read_seconds", 0.0) or 0.0)
    return (counter.calls, int(st.bytes_read), int(st.requests), tb,
            float(st.exposed_wait_seconds) + tw, distinct, tw, tr)


def _decode_run(request: EngineRequest, ids: list[int], gen: int, incremental: bool,
                spec: SpecOptions | None = None, count_macs: bool = False,
                disk: Path | None = None,
                on_token: Callable[[int], None] | None = None) -> RunFigures:
    """One decode from a fresh engine; ``on_token(n)`` after its n-th token."""
    eng = open_engine(request.model_copy(update={"positions": len(ids) + gen}))
    fig = RunFigures()
    try:
        counter = CallCounter(eng.kernels, count_macs)
        last = [_counters(eng, counter)]
        kernel_at = [counter.seconds]
        macs_at = [counter.macs]
        dev_at = [device_counters.sample(disk)]

        def on_step(st: Step) -> None:
            dev = device_counters.sample(disk)
            was, dev_at[0] = dev_at[0], dev
            fig.disk_bytes.append(dev.bytes_read - was.bytes_read if dev and was else 0)
            fig.disk_busy.append(dev.busy_seconds - was.busy_seconds if dev and was else 0.0)
            now = _counters(eng, counter)
            prev = last[0]
            last[0] = now
            fig.seconds.append(st.seconds)
            fig.calls.append(now[0] - prev[0])
            fig.expert_bytes.append(now[1] - prev[1])
            fig.expert_requests.append(now[2] - prev[2])
            fig.trunk_bytes.append(now[3] - prev[3])
            fig.wait_seconds.append(now[4] - prev[4])
            fig.expert_distinct.append(now[5] - prev[5])
            fig.trunk_wait.append(now[6] - prev[6])
            fig.trunk_read.append(now[7] - prev[7])
            fig.kernel_seconds.append(counter.seconds - kernel_at[0])
            kernel_at[0] = counter.seconds
            fig.macs.append(counter.macs - macs_at[0])
            macs_at[0] = counter.macs
            if on_token is not None:
                on_token(st.index + 1)

        res: RunResult = generate(eng.model, ids, gen, incremental=incremental, on_step=on_step,
                                  spec=spec)
        fig.ids = list(res.generated_ids)
        if res.spec is not None:
            fig.spec = res.spec.to_json()
            fig.first_pass = int(res.spec.log[0]["emitted"]) if res.spec.log else 1
        fig.chunks = eng.model.chunks_last if gen == 1 else 0
    finally:
        eng.close()
    return fig


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


@dataclass
class DecodeBench:
    """What ``k3 bench decode`` reports (``to_json`` for ``--json``)."""

    model: str
    backend: str
    threads: int
    incremental: bool
    trunk: str | None
    ids: list[int]
    gen: int
    repeat: int
    seconds_per_token: float
    seconds_per_token_runs: list[float]
    calls_per_token: float
    expert_bytes_read_per_token: float
    trunk_bytes_read_per_token: float
    exposed_wait_per_token: float
    bytes_touched_per_token: int
    bandwidth_gb_s: float
    bandwidth_how: str
    floor_seconds_per_token: float
    prefill_ids: int
    prefill_seconds: float
    prefill_seconds_runs: list[float]
    prefill_tokens_per_s: float
    prefill_expert_requests: int
    prefill_expert_bytes_read: int
    prefill_expert_bytes_if_per_token: int
    prefill_chunk: int | None
    prefill_chunks: int
    prefill_calls: int
    generated_ids: list[int]
    prefill_generated_ids: list[int]
    checked_against: str | None
    ids_match: bool | None
    notes: list[str] = field(default_factory=list)
    spec: str = "off"
    #: means over the steady tokens (after the first pass) of the median run
    mean_seconds_per_token: float = 0.0
    mean_expert_bytes_read_per_token: float = 0.0
    mean_trunk_bytes_read_per_token: float = 0.0
    passes_per_token: float = 1.0
    mean_seconds_per_token_runs: list[float] = field(default_factory=list)
    #: weights multiplied per steady token: trunk layers per pass, distinct experts per visit
    trunk_bytes_touched_per_token: float = 0.0
    expert_bytes_touched_per_token: float = 0.0
    speculative: dict[str, Any] | None = None
    spec_ids_match: bool | None = None
    #: the trunk's share of the exposed wait, and its reader's device seconds per token
    trunk_exposed_wait_per_token: float = 0.0
    trunk_read_seconds_per_token: float = 0.0
    #: share of the trunk's read time that overlapped compute (1 - exposed / read)
    trunk_overlap: float = 0.0
    #: the peak resident set of the timed decode runs (each reset first where Linux allows)
    peak_rss_bytes: int = 0
    expert_readers: int = 0
    #: wall seconds per steady token inside the kernel ops, and the rest of the token: the
    #: engine's own work between kernel calls (Python, NumPy glue, exposed waits)
    kernel_seconds_per_token: float = 0.0
    host_seconds_per_token: float = 0.0
    #: the prefill's weight-product multiply-adds, the float64 FMA peak of the same threads
    #: (G multiply-adds/s, and how it was measured) and their quotient: the prefill's floor
    prefill_macs: int = 0
    fma_peak_gmacs: float = 0.0
    fma_how: str = ""
    prefill_compute_floor_seconds: float = 0.0
    #: the storage read rate (GB/s, and how it was measured) and bytes read per token over
    #: it: the disk floor of a run that reads as it decodes (0 when nothing is read)
    disk_read_gb_s: float = 0.0
    disk_read_how: str = ""
    io_floor_seconds_per_token: float = 0.0
    #: the device the run streams from, by its own counters over the steady tokens of the
    #: timed runs (k3core/tools/bench/device_counters.py; empty and 0 where there are none):
    #: the share of the wall time it had reads in flight, the rate it read at while busy,
    #: and the bytes it read per token over that rate (the floor at the rate this run got)
    disk_device: str = ""
    disk_busy_share: float = 0.0
    disk_gb_s_while_busy: float = 0.0
    device_floor_seconds_per_token: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self))


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
    progress: Callable[[str, int, int], None] | None = None,
) -> DecodeBench:
    """Measure decode and prefill ``repeat`` times each (fresh engines); see the module doc.

    Every engine opens from ``request`` (its ``prefill_chunk`` applies to the prefill runs
    only; the checks run ``--backend numpy``).

    ``progress(stage, done, total)`` hears each stage as it goes: ``timed`` (tokens of the
    timed decode runs), ``prefill`` (runs), ``yardsticks`` (the bandwidth and FMA loops) and
    ``check`` (tokens of the ``--backend numpy`` and ``--spec off`` runs)."""
    say = progress or (lambda stage, done, total: None)
    if gen < 2 or repeat < 1 or prefill < 0 or bandwidth_bytes < 1:
        raise UsageError("bench decode: --gen must be >= 2, --repeat >= 1, --prefill >= 0 and "
                         "--bandwidth-mb > 0")
    if ids is not None and not ids:
        raise UsageError("bench decode: --ids names no id")
    ids = list(ids or DEFAULT_IDS)

    prefill_chunk, trunk_dir = request.prefill_chunk, request.trunk
    timed = request.model_copy(update={"prefill_chunk": None, "needs_tokenizer":
                                       prompt_file is not None})
    checked = timed.model_copy(update={"backend": "numpy"})
    prefilled = timed.model_copy(update={"prefill_chunk": prefill_chunk})
    probe = open_engine(timed.model_copy(update={"positions": len(ids) + gen}))
    cfg, kname, nthreads = probe.cfg, probe.names["kernel"], probe.kernels.threads
    sname, shards = probe.names["storage"], list(probe.index.shards)
    readers_used = int(getattr(probe.experts, "readers", 0) or 0)
    incremental, model_dir = probe.incremental, probe.plan.model_dir
    try:
        if prompt_file is not None:
            ids = _prompt_ids(probe.tokenizer, prompt_file)
    finally:
        probe.close()
    del probe  # its buffers must not count in the timed runs' peak RSS
    gc.collect()
    spec = spec if spec is not None and spec.on else None
    if any(not 0 <= i < cfg.vocab for i in ids):
        raise UsageError(f"bench decode: prompt ids must be in 0..{cfg.vocab - 1}")
    stat = device_counters.stat_file_of(_streamed_file(trunk_dir, shards))
    runs, peak = [], 0
    def tokens_of(stage: str, before: int, total: int) -> Callable[[int], None]:
        return lambda n: say(stage, before + n, total)

    say("timed", 0, repeat * gen)
    for i in range(repeat):  # the peak of each timed run alone (the probe's is forgotten)
        gc.collect()  # the last run's engine, freed before the peak is reset
        reset = _reset_peak_rss()
        runs.append(_decode_run(timed, ids, gen, incremental, spec, disk=stat,
                                on_token=tokens_of("timed", i * gen, repeat * gen)))
        peak = max(peak, _hwm_bytes() if reset else peak_rss_bytes())
    k = [r.first_pass for r in runs]
    steady = [RunFigures(r.seconds[f:], r.calls[f:], r.expert_bytes[f:], r.expert_requests[f:],
                         r.trunk_bytes[f:], r.wait_seconds[f:], r.ids, f, r.spec,
                         r.expert_distinct[f:], 0, r.trunk_wait[f:], r.trunk_read[f:],
                         r.kernel_seconds[f:])
              for r, f in zip(runs, k, strict=True)]
    for s, r, f in zip(steady, runs, k, strict=True):
        s.disk_bytes, s.disk_busy = r.disk_bytes[f:], r.disk_busy[f:]
    means = [_mean(s.seconds) for s in steady]
    mid = sorted(range(len(steady)), key=lambda i: means[i])[len(steady) // 2]
    per_run = [_median(s.seconds) for s in steady]
    pooled = RunFigures()
    for s in steady:
        pooled.calls += s.calls
        pooled.expert_bytes += s.expert_bytes
        pooled.expert_requests += s.expert_requests
        pooled.trunk_bytes += s.trunk_bytes
        pooled.wait_seconds += s.wait_seconds
        pooled.trunk_wait += s.trunk_wait
        pooled.trunk_read += s.trunk_read
        pooled.kernel_seconds += s.kernel_seconds
        pooled.seconds += s.seconds
        pooled.disk_bytes += s.disk_bytes
        pooled.disk_busy += s.disk_busy
    rng = np.random.default_rng(seed)
    pids = [int(i) for i in rng.integers(0, cfg.vocab, prefill)] if prefill else []
    if prefill:
        say("prefill", 0, repeat)
    pruns = ([_decode_run(prefilled, pids, 1, True, count_macs=True,
                          on_token=tokens_of("prefill", i, repeat))
              for i in range(repeat)]
             if prefill else [])
    sizes = sizes_from_config(cfg)
    requests_per_token = _median([float(x) for x in pooled.expert_requests])
    touched = (sizes.trunk_bytes + cfg.vocab * cfg.hidden * 2 + sizes.embed_row_bytes
               + int(round(requests_per_token)) * sizes.expert_bytes)
    from k3core.tools.bench.kernels import measure_fma_peak, measure_read_bandwidth

    say("yardsticks", 0, 2)
    bw, how = measure_read_bandwidth(nthreads, max(1 << 20, bandwidth_bytes))
    say("yardsticks", 1, 2)
    fma, fma_how = measure_fma_peak(nthreads) if prefill else (0.0, "")
    say("yardsticks", 2, 2)
    pmacs = pruns[0].macs[0] if pruns else 0
    read_per_token = (_median([float(b) for b in pooled.expert_bytes])
                      + _median([float(b) for b in pooled.trunk_bytes]))
    disk, disk_how = (_disk_rate(sname, trunk_dir, shards, readers_used)
                      if read_per_token > 0 else (0.0, ""))
    busy, dev_bytes = sum(pooled.disk_busy), sum(pooled.disk_bytes)
    while_busy = dev_bytes / busy / 1e9 if busy > 0 else 0.0
    notes: list[str] = []
    match: bool | None = None
    checks = (gen + (1 if prefill else 0) if check else 0) + (gen if spec is not None and check
                                                              else 0)
    if check:
        say("check", 0, checks)
        want = _decode_run(checked, ids, gen, incremental,
                           on_token=tokens_of("check", 0, checks)).ids
        match = all(r.ids == want for r in runs)
        if prefill:
            pwant = _decode_run(checked, pids, 1, True,
                                on_token=tokens_of("check", gen, checks)).ids
            match = match and all(r.ids == pwant for r in pruns)
        if not match:
            notes.append("generated ids differ from --backend numpy: the kernel contract is broken")
    spec_match: bool | None = None
    if spec is not None and check:
        spec_match = runs[0].ids == _decode_run(timed, ids, gen, incremental,
                                                on_token=tokens_of("check", checks - gen,
                                                                   checks)).ids
        if not spec_match:
            notes.append("generated ids differ from --spec off: speculation is not exact")
    psec = [r.seconds[0] for r in pruns]
    return DecodeBench(
        model=str(model_dir), backend=kname, threads=nthreads, incremental=incremental,
        trunk=str(trunk_dir) if trunk_dir else None, ids=ids, gen=gen, repeat=repeat,
        seconds_per_token=_median(per_run), seconds_per_token_runs=per_run,
        calls_per_token=_median([float(c) for c in pooled.calls]),
        expert_bytes_read_per_token=_median([float(b) for b in pooled.expert_bytes]),
        trunk_bytes_read_per_token=_median([float(b) for b in pooled.trunk_bytes]),
        exposed_wait_per_token=_median(pooled.wait_seconds),
        bytes_touched_per_token=touched, bandwidth_gb_s=bw, bandwidth_how=how,
        floor_seconds_per_token=touched / (bw * 1e9) if bw > 0 else 0.0,
        prefill_ids=prefill, prefill_seconds=_median(psec), prefill_seconds_runs=psec,
        prefill_tokens_per_s=prefill / _median(psec) if psec and _median(psec) > 0 else 0.0,
        prefill_expert_requests=pruns[0].expert_requests[0] if pruns else 0,
        prefill_expert_bytes_read=pruns[0].expert_bytes[0] if pruns else 0,
        prefill_expert_bytes_if_per_token=prefill * cfg.topk * sizes.n_moe_layers * sizes.expert_bytes,
        prefill_chunk=prefill_chunk, prefill_chunks=pruns[0].chunks if pruns else 0,
        prefill_calls=pruns[0].calls[0] if pruns else 0,
        generated_ids=runs[0].ids, prefill_generated_ids=pruns[0].ids if pruns else [],
        checked_against="numpy" if check else None, ids_match=match, notes=notes,
        spec=spec.mode if spec is not None else "off",
        mean_seconds_per_token=means[mid],
        mean_expert_bytes_read_per_token=_mean([float(b) for b in steady[mid].expert_bytes]),
        mean_trunk_bytes_read_per_token=_mean([float(b) for b in steady[mid].trunk_bytes]),
        passes_per_token=_passes_per_token(steady[mid]), speculative=runs[mid].spec,
        mean_seconds_per_token_runs=means,
        trunk_bytes_touched_per_token=sizes.trunk_bytes * _passes_per_token(steady[mid]),
        expert_bytes_touched_per_token=_mean([float(x) for x in steady[mid].expert_distinct])
        * sizes.expert_bytes,
        spec_ids_match=spec_match,
        trunk_exposed_wait_per_token=_median(pooled.trunk_wait),
        trunk_read_seconds_per_token=_median(pooled.trunk_read),
        trunk_overlap=(max(0.0, 1.0 - sum(pooled.trunk_wait) / sum(pooled.trunk_read))
                       if sum(pooled.trunk_read) > 0 else 0.0),
        peak_rss_bytes=peak, expert_readers=readers_used,
        prefill_macs=pmacs, fma_peak_gmacs=fma, fma_how=fma_how,
        prefill_compute_floor_seconds=pmacs / (fma * 1e9) if fma > 0 else 0.0,
        disk_read_gb_s=disk, disk_read_how=disk_how,
        io_floor_seconds_per_token=read_per_token / (disk * 1e9) if disk > 0 else 0.0,
        disk_device=device_counters.device_name(stat) if busy > 0 else "",
        disk_busy_share=busy / sum(pooled.seconds) if busy > 0 and pooled.seconds else 0.0,
        disk_gb_s_while_busy=while_busy,
        device_floor_seconds_per_token=(read_per_token / (while_busy * 1e9)
                                        if while_busy > 0 else 0.0),
        kernel_seconds_per_token=_median(pooled.kernel_seconds),
        host_seconds_per_token=_median([t - kt for t, kt in
                                        zip(pooled.seconds, pooled.kernel_seconds, strict=True)]),
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


def format_report(b: DecodeBench) -> str:
    mode = "incremental" if b.incremental else "full recompute"
    gb = 1e9
    lines = [
        f"k3 bench decode: {b.model} ({b.backend}, {b.threads} threads, {mode}"
        + (f", trunk {b.trunk}" if b.trunk else ", resident trunk") + ")",
        f"decode      : {b.seconds_per_token:.4f} s/token (median of {b.repeat} runs: "
        + ", ".join(f"{s:.4f}" for s in b.seconds_per_token_runs) + f"; {b.gen} tokens after ids "
        + ",".join(map(str, b.ids)) + ")",
        f"floor       : {b.floor_seconds_per_token:.4f} s/token = {b.bytes_touched_per_token / gb:.3f} GB "
        f"touched per token / {b.bandwidth_gb_s:.1f} GB/s read bandwidth ({b.bandwidth_how}); "
        f"decode is {b.seconds_per_token / b.floor_seconds_per_token:.2f}x the floor"
        if b.floor_seconds_per_token > 0 else "floor       : (no bandwidth measured)",
        f"read        : {b.expert_bytes_read_per_token / gb:.4f} GB experts + "
        f"{b.trunk_bytes_read_per_token / gb:.4f} GB trunk per token; exposed I/O wait "
        f"{b.exposed_wait_per_token:.4f} s/token",
        f"calls       : {b.calls_per_token:.0f} Python->kernel calls per token; "
        f"{b.kernel_seconds_per_token:.4f} s/token inside kernel ops, "
        f"{b.host_seconds_per_token:.4f} s/token between them (the engine's own work)",
    ]
    if b.io_floor_seconds_per_token > 0:
        lines.append(
            f"disk floor  : {b.io_floor_seconds_per_token:.4f} s/token = "
            f"{(b.expert_bytes_read_per_token + b.trunk_bytes_read_per_token) / gb:.3f} GB read "
            f"per token / {b.disk_read_gb_s:.2f} GB/s ({b.disk_read_how}); decode is "
            f"{b.seconds_per_token / b.io_floor_seconds_per_token:.2f}x that floor")
    if b.disk_busy_share > 0 and b.device_floor_seconds_per_token > 0:
        lines.append(
            f"device      : {b.disk_device} had reads in flight {100 * b.disk_busy_share:.0f} % "
            f"of the steady tokens' time and read {b.disk_gb_s_while_busy:.2f} GB/s while busy "
            f"(its own counters); at that rate the bytes read take "
            f"{b.device_floor_seconds_per_token:.4f} s/token, decode is "
            f"{b.seconds_per_token / b.device_floor_seconds_per_token:.2f}x that")
    if b.trunk:
        lines.append(
            f"trunk I/O   : {b.trunk_read_seconds_per_token:.4f} s/token of reads, "
            f"{b.trunk_exposed_wait_per_token:.4f} s/token exposed, {100 * b.trunk_overlap:.0f} % "
            f"overlapped compute; expert reads by {b.expert_readers} readers")
    if b.peak_rss_bytes:
        lines.append(f"memory      : peak RSS {b.peak_rss_bytes / 1e6:.0f} MB (after the timed runs)")
    if b.prefill_ids:
        lines.append(
            f"prefill     : {b.prefill_ids} ids + 1 token in {b.prefill_seconds:.3f} s (median of "
            f"{b.repeat}: " + ", ".join(f"{s:.3f}" for s in b.prefill_seconds_runs)
            + f") = {b.prefill_tokens_per_s:.1f} tokens/s; routed experts requested "
            f"{b.prefill_expert_requests}, read {b.prefill_expert_bytes_read / gb:.3f} GB "
            f"(one token at a time would multiply {b.prefill_expert_bytes_if_per_token / gb:.3f} GB); "
            f"{b.prefill_chunks} pass(es)" + (f" of at most {b.prefill_chunk} ids" if b.prefill_chunk else "")
            + f", {b.prefill_calls} Python->kernel calls")
        if b.prefill_compute_floor_seconds > 0:
            lines.append(
                f"compute     : the prefill's weight products are {b.prefill_macs / 1e9:.1f} G "
                f"multiply-adds; at the float64 FMA peak of {b.fma_peak_gmacs:.1f} G/s "
                f"({b.fma_how}, {b.threads} threads) no prefill takes less than "
                f"{b.prefill_compute_floor_seconds:.3f} s; this one is "
                f"{b.prefill_seconds / b.prefill_compute_floor_seconds:.2f}x that floor")
    if b.checked_against:
        lines.append(f"ids         : {'identical to' if b.ids_match else 'DIFFERENT from'} "
                     f"--backend {b.checked_against} (decode: {','.join(map(str, b.generated_ids))})")
    if b.speculative is not None:
        sp = b.speculative
        lines.append(
            f"spec        : --spec {b.spec} (width {sp['width']}, ngram {sp['ngram']}): "
            f"{b.passes_per_token:.3f} passes per token; drafts accepted "
            f"{sp['drafts_accepted']}/{sp['drafts_proposed']}, mean accepted width "
            f"{sp['mean_accepted_width']:.2f}; decisions "
            + ", ".join(f"{k} {v}" for k, v in sorted(sp["decisions"].items()))
            + ("; ids identical to --spec off" if b.spec_ids_match else
               "; ids DIFFERENT from --spec off" if b.spec_ids_match is False else ""))
    lines.append(f"mean        : {b.mean_seconds_per_token:.4f} s/token (runs: "
                 + ", ".join(f"{s:.4f}" for s in b.mean_seconds_per_token_runs) + "), "
                 f"{b.mean_trunk_bytes_read_per_token / gb:.4f} GB trunk + "
                 f"{b.mean_expert_bytes_read_per_token / gb:.4f} GB experts read, "
                 f"{b.trunk_bytes_touched_per_token / gb:.4f} GB trunk + "
                 f"{b.expert_bytes_touched_per_token / gb:.4f} GB experts multiplied per token "
                 "(steady tokens of the median run)")
    lines += [f"NOTE: {n}" for n in b.notes]
    return "\n".join(lines)


def _ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"bench decode: --ids must be comma-separated integers, got {text!r}") from None


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
                               prompt_file=a.prompt_file)
    except K3Error as exc:
        print(f"k3: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, UsageError) else 1
    print(res.to_json() if a.json else format_report(res))
    return 0 if res.ids_match is not False and res.spec_ids_match is not False else 1


if __name__ == "__main__":
    sys.exit(main())
