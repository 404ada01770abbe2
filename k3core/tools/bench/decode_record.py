"""What ``k3 bench decode`` reports: :class:`DecodeBench`, in seven typed parts, and its two
forms (one flat JSON object for ``--json``, whose keys ``make bench`` and the tests read;
the report a person reads, :func:`format_report`). The measuring is
``k3core/tools/bench/decode.py``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class BenchSetup:
    """What was measured: the model, the resolved engine, the prompt and the counts."""

    model: str
    backend: str
    threads: int
    incremental: bool
    trunk: str | None
    ids: list[int]
    gen: int
    repeat: int
    spec: str = "off"
    expert_readers: int = 0


@dataclass
class DecodeTiming:
    """Seconds of a steady token (every token after the first pass): medians over the timed
    runs, and means over the median run's steady tokens."""

    seconds_per_token: float
    seconds_per_token_runs: list[float]
    mean_seconds_per_token: float = 0.0
    mean_seconds_per_token_runs: list[float] = field(default_factory=list)
    passes_per_token: float = 1.0
    #: the median run's speculation record (docs/speculative.md; None without --spec)
    speculative: dict[str, Any] | None = None
    calls_per_token: float = 0.0
    #: inside the kernel ops, and the rest of the token: the engine's own work between kernel
    #: calls (Python, NumPy glue, exposed waits)
    kernel_seconds_per_token: float = 0.0
    host_seconds_per_token: float = 0.0
    #: the peak resident set of the timed decode runs (each reset first where Linux allows)
    peak_rss_bytes: int = 0


@dataclass
class TokenBytes:
    """Bytes a steady token reads and multiplies, and the reads it waits for."""

    expert_bytes_read_per_token: float
    trunk_bytes_read_per_token: float
    #: the weights one decode step multiplies: trunk layers, lm_head, one embedding row, and
    #: every routed expert it requests
    bytes_touched_per_token: int
    exposed_wait_per_token: float
    mean_expert_bytes_read_per_token: float = 0.0
    mean_trunk_bytes_read_per_token: float = 0.0
    #: weights multiplied per steady token: trunk layers per pass, distinct experts per visit
    trunk_bytes_touched_per_token: float = 0.0
    expert_bytes_touched_per_token: float = 0.0
    #: the trunk's share of the exposed wait, and its reader's device seconds per token
    trunk_exposed_wait_per_token: float = 0.0
    trunk_read_seconds_per_token: float = 0.0
    #: share of the trunk's read time that overlapped compute (1 - exposed / read)
    trunk_overlap: float = 0.0


@dataclass
class Floors:
    """The yardsticks measured in the same run and the floors they give (0 where none)."""

    #: memory read bandwidth (GB/s, how) and bytes touched per token over it
    bandwidth_gb_s: float
    bandwidth_how: str
    floor_seconds_per_token: float
    #: the storage read rate (GB/s, how) and bytes read per token over it: the disk floor of
    #: a run that reads as it decodes
    disk_read_gb_s: float = 0.0
    disk_read_how: str = ""
    io_floor_seconds_per_token: float = 0.0
    #: the device the run streams from, by its own counters over the steady tokens
    #: (k3core/tools/bench/device_counters.py): the share of the wall time it had reads in
    #: flight, the rate it read at while busy, and the bytes read per token over that rate
    disk_device: str = ""
    disk_busy_share: float = 0.0
    disk_gb_s_while_busy: float = 0.0
    device_floor_seconds_per_token: float = 0.0
    #: the float64 FMA peak of the same threads (G multiply-adds/s, how) and the prefill's
    #: multiply-adds over it: the prefill's floor
    fma_peak_gmacs: float = 0.0
    fma_how: str = ""
    prefill_compute_floor_seconds: float = 0.0
    #: ``--batch B > 1``: MXFP4 weights multiplied by one token per second on the same threads
    #: (G/s, how; k3core/tools/bench/kernels.py ``measure_decode_peak``)
    decode_peak_gweights: float = 0.0
    decode_how: str = ""


@dataclass
class PrefillFigures:
    """The prefill runs: ``prefill_ids`` random ids and one token (all 0 without them)."""

    prefill_ids: int = 0
    prefill_seconds: float = 0.0
    prefill_seconds_runs: list[float] = field(default_factory=list)
    prefill_tokens_per_s: float = 0.0
    prefill_expert_requests: int = 0
    prefill_expert_bytes_read: int = 0
    prefill_expert_bytes_if_per_token: int = 0
    prefill_chunk: int | None = None
    prefill_chunks: int = 0
    prefill_calls: int = 0
    prefill_generated_ids: list[int] = field(default_factory=list)
    #: the weight products' multiply-adds (counted at the kernel interface)
    prefill_macs: int = 0


@dataclass
class BatchFigures:
    """``--batch B``: B sequences decoded together per timed run, their passes batched by the
    model's scheduler. Every figure covers the steady window (from the moment every row has
    its first token, the prefill's, to the last row's last token): rows x (gen - 1) tokens.
    With B = 1 they are the timed runs' own (no baseline)."""

    batch: int = 1
    #: every row's steady tokens over the window's wall seconds (median of the runs)
    aggregate_tokens_per_s: float = 0.0
    aggregate_tokens_per_s_runs: list[float] = field(default_factory=list)
    #: wall seconds of one batched step (the longest row's step: a row's step is the pass
    #: that held it), median over the steady steps, median of the runs
    s_per_step: float = 0.0
    s_per_step_runs: list[float] = field(default_factory=list)
    #: bytes the engine read from storage in the window over every generated token in it
    trunk_bytes_per_token: float = 0.0
    expert_bytes_per_token: float = 0.0
    #: Python -> kernel calls in the window over every generated token in it
    batch_calls_per_token: float = 0.0
    #: the largest batch the scheduler ran (smallest over the runs), and the sequences per
    #: pass over the window's passes (median of the runs)
    batch_most: int = 0
    rows_per_pass: float = 0.0
    #: the streamed-from device over the window (Linux counters; None: unknown or no disk
    #: read): the share of the window it had reads in flight, the rate it read at while
    #: busy, and its busy seconds per batched step (the device floor at the rate it gave)
    batch_device_busy_share: float | None = None
    batch_device_rate: float | None = None
    batch_device_busy_per_step: float | None = None
    #: a batched step's seconds (window totals over its steps, median of the runs) the
    #: compute waited for trunk parts, waited for routed experts, and spent inside kernel ops
    batch_trunk_wait_per_step: float = 0.0
    batch_expert_wait_per_step: float = 0.0
    batch_kernel_per_step: float = 0.0
    #: the batched engine's memory plan (B slots) and the peak RSS of the batched runs
    #: (0: unknown)
    batch_plan_bytes: int = 0
    batch_peak_rss_bytes: int = 0
    #: the B prompts (the first is the bench's; the others seeded, of its length)
    batch_prompts: list[list[int]] = field(default_factory=list)
    #: B > 1: the timed single-sequence runs (alternating with the batched ones) as tokens/s
    #: over their steady window, and aggregate_tokens_per_s over it
    baseline_tokens_per_s: float | None = None
    baseline_tokens_per_s_runs: list[float] = field(default_factory=list)
    batch_speedup: float | None = None
    #: B > 1, with the FMA peak and the decode ceiling measured: a batched step's
    #: multiply-adds and the MXFP4 weights it decodes (medians of the runs' window means);
    #: its compute floor (decoded weights at the decode ceiling, the other multiply-adds at
    #: the FMA peak) and memory floor (bytes touched over the read bandwidth), the larger of
    #: the two; a single sequence's floor (seconds a token) and the speedup the two floors
    #: allow (B x the single floor over the batched one)
    batch_macs_per_step: float = 0.0
    batch_decoded_per_step: float = 0.0
    batch_compute_floor_per_step: float = 0.0
    batch_memory_floor_per_step: float = 0.0
    #: streamed: the bytes read from storage a step over the storage read rate (0: resident)
    batch_disk_floor_per_step: float = 0.0
    batch_floor_per_step: float = 0.0
    batch_single_floor_per_token: float = 0.0
    batch_floor_speedup: float | None = None


@dataclass
class ContextFigures:
    """``--context N,...``: decode at built contexts of N positions (k3core/tools/bench/
    context.py); empty lists without it."""

    #: the contexts, in the order given; per context the median over the runs of each run's
    #: median steady s/token, the runs' own, and the MLA layers' seconds per token (``mla_mix``)
    context_positions: list[int] = field(default_factory=list)
    context_seconds_per_token: list[float] = field(default_factory=list)
    context_seconds_per_token_runs: list[list[float]] = field(default_factory=list)
    context_attention_seconds_per_token: list[float] = field(default_factory=list)
    #: the attention's seconds per position of context (the slope between the smallest and
    #: the largest context), its FLOP floor at the FMA peak, and the seed prompt's length
    context_attention_seconds_per_position: float = 0.0
    context_attention_floor_per_position: float = 0.0
    context_seed_ids: int = 0
    #: every context's ids equal to the same context's on the checked backend
    context_ids_match: bool | None = None
    context_generated_ids: list[list[int]] = field(default_factory=list)


@dataclass
class IdsCheck:
    """The ids generated and what they were checked against."""

    generated_ids: list[int]
    checked_against: str | None = None
    ids_match: bool | None = None
    spec_ids_match: bool | None = None
    #: ``--batch B > 1``: every row of every batched run equal to its prompt run alone on
    #: the checked backend (one engine, one prompt at a time); the first run's rows
    batch_ids_match: bool | None = None
    batch_generated_ids: list[list[int]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass
class DecodeBench:
    """What ``k3 bench decode`` reports (``to_json`` for ``--json``: one flat object)."""

    setup: BenchSetup
    timing: DecodeTiming
    bytes: TokenBytes
    floors: Floors
    prefill: PrefillFigures
    check: IdsCheck
    batch: BatchFigures = field(default_factory=BatchFigures)
    context: ContextFigures = field(default_factory=ContextFigures)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for part in (self.setup, self.timing, self.bytes, self.floors, self.prefill, self.batch,
                     self.context, self.check):
            fields = asdict(part)
            both = out.keys() & fields.keys()
            if both:  # one flat object: a figure of one part must not hide another's
                raise ValueError(f"bench decode report: {sorted(both)} named by two parts")
            out.update(fields)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict())


def format_report(b: DecodeBench) -> str:
    """The report a person reads."""
    s, t, by, f, p, c = b.setup, b.timing, b.bytes, b.floors, b.prefill, b.check
    mode = "incremental" if s.incremental else "full recompute"
    gb = 1e9
    lines = [
        f"k3 bench decode: {s.model} ({s.backend}, {s.threads} threads, {mode}"
        + (f", trunk {s.trunk}" if s.trunk else ", resident trunk") + ")",
        f"decode      : {t.seconds_per_token:.4f} s/token (median of {s.repeat} runs: "
        + ", ".join(f"{x:.4f}" for x in t.seconds_per_token_runs) + f"; {s.gen} tokens after ids "
        + ",".join(map(str, s.ids)) + ")",
        f"floor       : {f.floor_seconds_per_token:.4f} s/token = {by.bytes_touched_per_token / gb:.3f} GB "
        f"touched per token / {f.bandwidth_gb_s:.1f} GB/s read bandwidth ({f.bandwidth_how}); "
        f"decode is {t.seconds_per_token / f.floor_seconds_per_token:.2f}x the floor"
        if f.floor_seconds_per_token > 0 else "floor       : (no bandwidth measured)",
        f"read        : {by.expert_bytes_read_per_token / gb:.4f} GB experts + "
        f"{by.trunk_bytes_read_per_token / gb:.4f} GB trunk per token; exposed I/O wait "
        f"{by.exposed_wait_per_token:.4f} s/token",
        f"calls       : {t.calls_per_token:.0f} Python->kernel calls per token; "
        f"{t.kernel_seconds_per_token:.4f} s/token inside kernel ops, "
        f"{t.host_seconds_per_token:.4f} s/token between them (the engine's own work)",
    ]
    if f.io_floor_seconds_per_token > 0:
        lines.append(
            f"disk floor  : {f.io_floor_seconds_per_token:.4f} s/token = "
            f"{(by.expert_bytes_read_per_token + by.trunk_bytes_read_per_token) / gb:.3f} GB read "
            f"per token / {f.disk_read_gb_s:.2f} GB/s ({f.disk_read_how}); decode is "
            f"{t.seconds_per_token / f.io_floor_seconds_per_token:.2f}x that floor")
    if f.disk_busy_share > 0 and f.device_floor_seconds_per_token > 0:
        lines.append(
            f"device      : {f.disk_device} had reads in flight {100 * f.disk_busy_share:.0f} % "
            f"of the steady tokens' time and read {f.disk_gb_s_while_busy:.2f} GB/s while busy "
            f"(its own counters); at that rate the bytes read take "
            f"{f.device_floor_seconds_per_token:.4f} s/token, decode is "
            f"{t.seconds_per_token / f.device_floor_seconds_per_token:.2f}x that")
    if s.trunk:
        lines.append(
            f"trunk I/O   : {by.trunk_read_seconds_per_token:.4f} s/token of reads, "
            f"{by.trunk_exposed_wait_per_token:.4f} s/token exposed, {100 * by.trunk_overlap:.0f} % "
            f"overlapped compute; expert reads by {s.expert_readers} readers")
    if t.peak_rss_bytes:
        lines.append(f"memory      : peak RSS {t.peak_rss_bytes / 1e6:.0f} MB (after the timed runs)")
    if p.prefill_ids:
        lines.append(
            f"prefill     : {p.prefill_ids} ids + 1 token in {p.prefill_seconds:.3f} s (median of "
            f"{s.repeat}: " + ", ".join(f"{x:.3f}" for x in p.prefill_seconds_runs)
            + f") = {p.prefill_tokens_per_s:.1f} tokens/s; routed experts requested "
            f"{p.prefill_expert_requests}, read {p.prefill_expert_bytes_read / gb:.3f} GB "
            f"(one token at a time would multiply {p.prefill_expert_bytes_if_per_token / gb:.3f} GB); "
            f"{p.prefill_chunks} pass(es)" + (f" of at most {p.prefill_chunk} ids" if p.prefill_chunk else "")
            + f", {p.prefill_calls} Python->kernel calls")
        if f.prefill_compute_floor_seconds > 0:
            lines.append(
                f"compute     : the prefill's weight products are {p.prefill_macs / 1e9:.1f} G "
                f"multiply-adds; at the float64 FMA peak of {f.fma_peak_gmacs:.1f} G/s "
                f"({f.fma_how}, {s.threads} threads) no prefill takes less than "
                f"{f.prefill_compute_floor_seconds:.3f} s; this one is "
                f"{p.prefill_seconds / f.prefill_compute_floor_seconds:.2f}x that floor")
    if c.checked_against:
        lines.append(f"ids         : {'identical to' if c.ids_match else 'DIFFERENT from'} "
                     f"--backend {c.checked_against} (decode: {','.join(map(str, c.generated_ids))})")
    if t.speculative is not None:
        sp = t.speculative
        lines.append(
            f"spec        : --spec {s.spec} (width {sp['width']}, ngram {sp['ngram']}): "
            f"{t.passes_per_token:.3f} passes per token; drafts accepted "
            f"{sp['drafts_accepted']}/{sp['drafts_proposed']}, mean accepted width "
            f"{sp['mean_accepted_width']:.2f}; decisions "
            + ", ".join(f"{k} {v}" for k, v in sorted(sp["decisions"].items()))
            + ("; ids identical to --spec off" if c.spec_ids_match else
               "; ids DIFFERENT from --spec off" if c.spec_ids_match is False else ""))
    lines.append(f"mean        : {t.mean_seconds_per_token:.4f} s/token (runs: "
                 + ", ".join(f"{x:.4f}" for x in t.mean_seconds_per_token_runs) + "), "
                 f"{by.mean_trunk_bytes_read_per_token / gb:.4f} GB trunk + "
                 f"{by.mean_expert_bytes_read_per_token / gb:.4f} GB experts read, "
                 f"{by.trunk_bytes_touched_per_token / gb:.4f} GB trunk + "
                 f"{by.expert_bytes_touched_per_token / gb:.4f} GB experts multiplied per token "
                 "(steady tokens of the median run)")
    if b.batch.batch > 1:
        lines += _batch_lines(b)
    if b.context.context_positions:
        lines += _context_lines(b)
    lines += [f"NOTE: {n}" for n in c.notes]
    return "\n".join(lines)


#: the least share of the batched window the device read in for its line to be shown (a
#: resident run's few expert misses say nothing of a floor)
DEVICE_LINE_SHARE = 0.05


def _batch_lines(b: DecodeBench) -> list[str]:
    """The ``--batch B`` lines (B > 1)."""
    s, x, c = b.setup, b.batch, b.check
    lines = [
        f"batch       : {x.batch} sequences together: {x.aggregate_tokens_per_s:.2f} tokens/s "
        f"aggregate (median of {s.repeat}: "
        + ", ".join(f"{v:.2f}" for v in x.aggregate_tokens_per_s_runs)
        + f"; every row's tokens after its first, prefill excluded), "
        f"{x.s_per_step:.4f} s/step",
        f"batch of 1  : {x.baseline_tokens_per_s or 0.0:.2f} tokens/s (the timed runs above, "
        f"alternating with the batched ones: " + ", ".join(
            f"{v:.2f}" for v in x.baseline_tokens_per_s_runs)
        + f"); batch {x.batch} is {x.batch_speedup or 0.0:.2f}x that",
        f"scheduler   : largest batch {x.batch_most}, {x.rows_per_pass:.2f} sequences per "
        f"steady pass; read {x.trunk_bytes_per_token / 1e9:.4f} GB trunk + "
        f"{x.expert_bytes_per_token / 1e9:.4f} GB experts, "
        f"{x.batch_calls_per_token:.0f} Python->kernel calls per generated token",
    ]
    if (x.batch_device_busy_per_step is not None and x.batch_device_rate is not None
            and (x.batch_device_busy_share or 0.0) >= DEVICE_LINE_SHARE):
        lines.append(
            f"batch disk  : {b.floors.disk_device or 'the device'} had reads in flight "
            f"{100 * (x.batch_device_busy_share or 0.0):.0f} % of the batched window and read "
            f"{x.batch_device_rate / 1e9:.2f} GB/s while busy: {x.batch_device_busy_per_step:.4f} s of "
            f"reads a step, the step is {x.s_per_step / x.batch_device_busy_per_step:.2f}x that")
    if x.batch_kernel_per_step > 0:
        rest = max(0.0, x.s_per_step - x.batch_trunk_wait_per_step - x.batch_expert_wait_per_step
                   - x.batch_kernel_per_step)
        lines.append(
            f"batch waits : a step {x.s_per_step:.4f} s: waiting for trunk parts "
            f"{x.batch_trunk_wait_per_step:.4f} s, for routed experts "
            f"{x.batch_expert_wait_per_step:.4f} s; inside kernel ops "
            f"{x.batch_kernel_per_step:.4f} s; the rest {rest:.4f} s (the engine's own work)")
    if x.batch_floor_per_step > 0:
        f = b.floors
        lines.append(
            f"batch floor : {x.batch_floor_per_step:.4f} s/step = the larger of compute "
            f"{x.batch_compute_floor_per_step:.4f} s ({x.batch_macs_per_step / 1e9:.2f} G "
            f"multiply-adds, {x.batch_decoded_per_step / 1e9:.2f} G of them on MXFP4 weights "
            f"decoded at {f.decode_peak_gweights:.1f} G/s, the rest at the FMA peak of "
            f"{f.fma_peak_gmacs:.1f} G/s), memory {x.batch_memory_floor_per_step:.4f} s"
            + (f" and disk {x.batch_disk_floor_per_step:.4f} s (storage reads at "
               f"{f.disk_read_gb_s:.2f} GB/s)" if x.batch_disk_floor_per_step > 0 else "")
            + "; "
            f"the step is {x.s_per_step / x.batch_floor_per_step:.2f}x it")
        lines.append(
            f"floors allow: batch {x.batch} at most {x.batch_floor_speedup or 0.0:.2f}x batch 1 "
            f"(one sequence's floor {x.batch_single_floor_per_token:.4f} s/token, "
            f"{x.batch} x that over the step's floor)")
    if x.batch_peak_rss_bytes:
        lines.append(f"batch memory: peak RSS {x.batch_peak_rss_bytes / 1e6:.0f} MB against a plan of "
                     f"{x.batch_plan_bytes / 1e6:.0f} MB for {x.batch} slots")
    if c.batch_ids_match is not None:
        same = "identical to" if c.batch_ids_match else "NOT all identical to"
        lines.append(f"batch ids   : every row {same} its prompt alone on --backend "
                     f"{c.checked_against} ({x.batch} prompts of "
                     f"{len(x.batch_prompts[0]) if x.batch_prompts else 0} ids)")
    return lines


def _context_lines(b: DecodeBench) -> list[str]:
    """The ``--context`` lines."""
    x, f, c = b.context, b.floors, b.check
    lines = ["context     : " + "; ".join(
        f"{n} positions {t:.4f} s/token (MLA layers {a:.4f}, the rest {t - a:.4f})"
        for n, t, a in zip(x.context_positions, x.context_seconds_per_token,
                           x.context_attention_seconds_per_token, strict=True))
        + f" (medians of {b.setup.repeat} runs; each context built from a {x.context_seed_ids}-id"
        " seeded prefill, its latent rows repeated)"]
    if len(x.context_positions) > 1:
        per, floor = x.context_attention_seconds_per_position, x.context_attention_floor_per_position
        lines.append(
            f"attention   : {per * 1e9:.1f} ns a position of context "
            f"({min(x.context_positions)} -> {max(x.context_positions)})"
            + (f"; its FLOP floor {floor * 1e9:.1f} ns (every MLA layer's multiply-adds a position "
               f"at the FMA peak of {f.fma_peak_gmacs:.1f} G/s): {per / floor:.2f}x it"
               if floor > 0 else ""))
    if x.context_ids_match is not None:
        same = "identical to" if x.context_ids_match else "NOT all identical to"
        lines.append(f"context ids : every context's ids {same} the same context's on "
                     f"--backend {c.checked_against or 'numpy'}")
    return lines
