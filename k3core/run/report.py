"""The run report, the last stage of request -> plan -> engine -> session -> report.

The generated text goes to stdout as tokens arrive (never half a UTF-8 character), so
``k3 run ... > answer.txt`` captures the text alone. The banner, the memory plan, the live
per-step table and the summary go to stderr, printed with rich so they read well in a
terminal and stay plain text when piped. Every figure printed is also in the run record
(:func:`run_record`: ``--out`` JSON, and ``Generation.report`` in the Python API).

How much goes to stderr depends on where it lands (:class:`RunReport`):

* stderr is not a terminal (a file, a pipe, a script capturing it): everything, as always:
  the plan with its memory table, the per-step table, the whole summary;
* stderr is a terminal: a short plan (the memory plan in one line) and a short summary of a
  few lines, like llama.cpp's timings (tokens, s/token, tokens/s, prefill, expert-cache
  hits, peak RSS); ``-v`` prints everything;
* the per-step table is left out only when stdout and stderr are the same terminal (its rows
  would cut through the text), unless ``-v``: ``k3 run ... > answer.txt`` in a terminal
  still shows it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from k3core.api.experts import ExpertStats
from k3core.api.units import human
from k3core.experts.cache import ExpertCache
from k3core.model.sizes import sizes_from_config
from k3core.run.memory_plan import peak_rss_bytes
from k3core.run.request import MAX_GEN
from k3core.trunk.source import report_json, report_lines, ultra_lines

if TYPE_CHECKING:
    from k3core.run.binding import Bound
    from k3core.run.generation import Generation


def gb(n: float) -> str:
    """Decimal gigabytes, two decimals (the reference's units: 1 GB = 1e9 B)."""
    return f"{n / 1e9:.2f} GB"


@dataclass
class StepRow:
    step: int
    token: int
    seconds: float
    hit_rate: float | None
    gb_read: float
    text: str = ""


def _fd(stream: object) -> int | None:
    try:
        fd = stream.fileno()  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):  # a captured stream has no descriptor
        return None
    return fd if isinstance(fd, int) else None


def on_terminal(stream: object) -> bool:
    """``stream`` writes to a terminal."""
    fd = _fd(stream)
    return fd is not None and os.isatty(fd)


def same_terminal(a: object, b: object) -> bool:
    """``a`` and ``b`` write to one terminal (the same device: ``st_rdev`` and ``st_ino``)."""
    fa, fb = _fd(a), _fd(b)
    if fa is None or fb is None or not (os.isatty(fa) and os.isatty(fb)):
        return False
    try:
        sa, sb = os.fstat(fa), os.fstat(fb)
    except OSError:
        return False
    return (sa.st_rdev, sa.st_ino, sa.st_dev) == (sb.st_rdev, sb.st_ino, sb.st_dev)


@dataclass
class RunReport:
    """Where a run's output goes: the text on stdout, everything else on stderr.

    ``verbosity`` -1 (``-q``) prints nothing on stderr, 0 the plan, the per-step table and
    the summary, 1 (``-v``) adds every setting with its source and the generated text again.
    ``terminal`` (stderr is a terminal) shortens the plan and the summary, ``shared``
    (stdout and stderr are the same terminal) leaves out the per-step table; both are read
    from the process's streams unless given, and ``-v`` overrides both (see the module).
    """

    verbosity: int = 0
    err: Console = field(default_factory=lambda: Console(stderr=True, highlight=False,
                                                         soft_wrap=True))
    rows: list[StepRow] = field(default_factory=list)
    terminal: bool | None = None
    shared: bool | None = None
    _last: tuple[int, int, int] = (0, 0, 0)
    _tail: str = ""
    _stdout_gone: bool = False

    def __post_init__(self) -> None:
        if self.terminal is None:
            self.terminal = on_terminal(sys.stderr)
        if self.shared is None:
            self.shared = same_terminal(sys.stdout, sys.stderr)

    @property
    def verbose(self) -> bool:
        return self.verbosity > 0

    @property
    def detail(self) -> bool:
        """The whole plan and summary: ``-v``, or stderr is not a terminal."""
        return self.verbose or not self.terminal

    @property
    def show_steps(self) -> bool:
        """The live per-step table: ``-v``, or stdout is not the terminal stderr shows."""
        return self.verbose or (self.verbosity == 0 and not self.shared)

    def line(self, text: str = "", level: int = 0) -> None:
        if self.verbosity >= level:
            self.err.print(text, markup=False)

    def note(self, text: str) -> None:
        self.line(f"note: {text}")

    def table(self, title: str, rows: Iterable[tuple[str, str]]) -> None:
        if self.verbosity < 0:
            return
        t = Table(title=title, show_header=False, title_justify="left", box=None, pad_edge=False)
        t.add_column(style="bold")
        t.add_column()
        for a, b in rows:
            t.add_row(a, b)
        self.err.print(t)

    # ---- the generated text, on stdout ------------------------------------------------------
    def text(self, piece: str) -> None:
        """Write ``piece`` to stdout now (UTF-8 bytes, whatever the locale says)."""
        if not piece or self._stdout_gone:
            return
        try:
            sys.stdout.flush()
            buf = getattr(sys.stdout, "buffer", None)
            if buf is not None:
                buf.write(piece.encode("utf-8", "surrogateescape"))
                buf.flush()
            else:
                sys.stdout.write(piece)
                sys.stdout.flush()
        except BrokenPipeError:  # the reader went away (``k3 run ... | head``): stop writing
            self._stdout_gone = True
        self._tail = piece[-1:]

    def end_text(self) -> None:
        """A terminal gets a final newline after the text; a pipe or file gets the text alone."""
        if self._tail and self._tail != "\n" and sys.stdout.isatty():
            self.text("\n")

    # ---- the live per-step table, on stderr ---------------------------------------------------
    def step_header(self) -> None:
        if self.show_steps:
            self.line(f"{'STEP':>5} {'TOKEN':>8} {'SECONDS':>9} {'CACHE HIT':>9} {'READ GB':>8} "
                      f"{'TOK/S':>7}  TEXT")

    def step(self, step: int, token: int, seconds: float, stats: ExpertStats | None, text: str = "") -> None:
        hit, read = None, 0.0
        if stats is not None:
            req, hits, nbytes = stats.requests, stats.hits, stats.bytes_read
            dreq, dhit, dbytes = req - self._last[0], hits - self._last[1], nbytes - self._last[2]
            self._last = (req, hits, nbytes)
            hit = dhit / dreq if dreq else None
            read = dbytes / 1e9
        row = StepRow(step, token, seconds, hit, read, text)
        self.rows.append(row)
        if not self.show_steps:
            return
        hit_s = f"{100 * hit:8.1f}%" if hit is not None else f"{'-':>9}"
        shown = text.replace("\n", "\\n")
        self.line(
            f"{step:>5} {token:>8} {seconds:>9.3f} {hit_s} {read:>8.3f} {1 / max(seconds, 1e-9):>7.2f}  {shown}"
        )

    def reset_step_baseline(self, stats: ExpertStats | None) -> None:
        if stats is not None:
            self._last = (stats.requests, stats.hits, stats.bytes_read)

    # ---- before and after the loop ------------------------------------------------------------
    def engine_lines(self, engine: Bound) -> None:
        """What was opened: plugins, index and bind times, trunk, expert cache, RSS (in a
        terminal: the plugins, the notes that are not already said and the trunk plan)."""
        self.line(engine.settings_line)
        if not self.detail:
            for note in engine.notes:
                if not note.startswith("auto picked"):  # the settings line names the pick
                    self.note(note)
            for line in engine.trunk_lines:
                if line.startswith(("trunk plan", "WARNING")):
                    self.line(line)
            return
        for note in engine.notes:
            self.note(note)
        cache = engine.experts if isinstance(engine.experts, ExpertCache) else None
        arena = "" if cache is None else (
            f"; expert arena mapped in {cache.arena_seconds:.2f} s "
            f"({engine.timings.get('arena', 0.0):.2f} s after the binding)")
        self.line(f"indexed {len(engine.index)} tensors from {len(engine.index.shards)} shards in "
                  f"{engine.timings['index']:.2f} s; weights bound in {engine.timings['bind']:.2f} s"
                  + arena)
        for line in engine.trunk_lines + ultra_lines(engine.model.tables, engine.incremental,
                                                     engine.model.n_layers):
            self.line(line)
        if cache is not None:
            self.line(f"expert cache  : {cache.capacity} slots x {human(cache.stride)} = "
                      f"{human(cache.capacity * cache.stride)}, policy {engine.names['cache']}, "
                      f"{cache.readers} readers ({cache.readers_why})")
        self.line(f"peak RSS after loading weights: {gb(peak_rss_bytes())} (the plan is a "
                  "forecast; this is measured)")

    def summary(self, engine: Bound, gen: Generation, max_tokens: int) -> None:
        """The closing block: tokens and time, why it stopped, ids, cache, trunk, I/O, RSS
        (in a terminal without ``-v``: :meth:`short_summary`)."""
        if not self.detail:
            self.short_summary(engine, gen, max_tokens)
            return
        self.line("-" * 60)
        if gen.interrupted:
            self.line(f"interrupted after {len(gen.ids)} of {max_tokens} tokens")
        elif max_tokens == 0:
            self.line(f"prefill only: {len(gen.prompt_ids)} positions, 0 tokens generated in "
                      f"{gen.prefill_seconds:.2f} s")
        else:
            self.line(f"{len(gen.ids)} tokens in {gen.wall_seconds:.2f} s, "
                      f"{gen.seconds_per_token:.3f} s/token average, "
                      f"{_rate(len(gen.ids), gen.wall_seconds)} tokens/s")
        self._stop_line(gen, max_tokens)
        self._rest_of_summary(engine, gen)

    def short_summary(self, engine: Bound, gen: Generation, max_tokens: int) -> None:
        """A few lines after the text, like llama.cpp's timings: the prefill (the prompt's
        pass, which also makes the first token), the decode steps after it, the total, why
        it stopped when not at ``--gen``, the expert cache's hits, the peak RSS."""
        stats = engine.experts.stats
        self.line("-" * 60)
        n = len(gen.ids)
        if gen.interrupted:
            self.line(f"interrupted after {n} of {max_tokens} tokens")
        if not gen.steps:
            self.line(f"prefill : {gen.prefill_ids} ids in {gen.prefill_seconds:.3f} s "
                      f"({_rate(gen.prefill_ids, gen.prefill_seconds)} ids/s), nothing generated")
        else:
            first, rest = gen.steps[0].seconds, gen.steps[1:]
            self.line(f"prefill : {gen.prefill_ids} ids in {first:.3f} s "
                      f"({_rate(gen.prefill_ids, first)} ids/s), the first token with them")
            if rest:
                took = sum(st.seconds for st in rest)
                self.line(f"decode  : {len(rest)} tokens in {took:.3f} s, "
                          f"{took / len(rest):.3f} s/token, {_rate(len(rest), took)} tokens/s")
            self.line(f"total   : {n} tokens in {gen.wall_seconds:.2f} s, "
                      f"{gen.seconds_per_token:.3f} s/token, "
                      f"{_rate(n, gen.wall_seconds)} tokens/s")
        self._stop_line(gen, max_tokens)
        if gen.spec is not None:
            self.line(gen.spec.line())
        if stats.requests:
            self.line(f"experts : {100 * stats.hits / stats.requests:.1f}% resident hits "
                      f"({stats.hits} of {stats.requests}), {human(stats.bytes_read)} read")
        self.line(f"peak RSS: {gb(peak_rss_bytes())}   (-v: the full report)")

    def _stop_line(self, gen: Generation, max_tokens: int) -> None:
        """Why it stopped, when not after ``--gen`` tokens (or a Ctrl-C, said already)."""
        if gen.stop_reason == "stop_id":
            self.line(f"stop id {gen.stopped_at} reached after {len(gen.ids)} of {max_tokens} tokens")
        elif gen.stop_reason == "eos":
            self.line(f"end-of-sequence id {gen.stopped_at} reached after {len(gen.ids)} of "
                      f"{max_tokens} tokens (--ignore-eos runs on)")
        elif gen.stop_reason == "stop":
            self.line(f"stop text reached after {len(gen.ids)} of {max_tokens} tokens")
        elif gen.stop_reason == "context":
            self.line(f"the context is full after {len(gen.ids)} tokens (--context; without "
                      f"it, the prompt + {MAX_GEN})")

    def _rest_of_summary(self, engine: Bound, gen: Generation) -> None:
        model, stats = engine.model, engine.experts.stats
        self.line(f"generated ids: {','.join(map(str, gen.ids))}")
        if gen.spec is not None:
            self.line(gen.spec.line())
        if gen.ids:
            b = bytes_per_token(engine, gen)
            self.line(f"per token     : {b['trunk_read'] / 1e9:.4f} GB trunk + "
                      f"{b['expert_read'] / 1e9:.4f} GB experts read; "
                      f"{b['trunk_touched'] / 1e9:.4f} GB trunk + {b['expert_touched'] / 1e9:.4f} "
                      f"GB experts multiplied ({b['passes']} forward passes for {len(gen.ids)} "
                      "tokens)")
        if gen.prefill_ids:
            pf = prefill_json(engine, gen)
            self.line(f"prefill: {gen.prefill_ids} ids in {gen.prefill_chunks} pass(es) of at most "
                      f"{pf['prefill_chunk']} ids; routed experts read {gb(gen.prefill_expert_bytes)} "
                      f"(one id at a time would multiply {gb(pf['prefill_expert_bytes_if_per_token'])})")
        if gen.text is not None:
            self.line("--- generated text ---", level=1)
            self.line(gen.text, level=1)
            self.line("-" * 22, level=1)
        cache = engine.experts if isinstance(engine.experts, ExpertCache) else None
        if cache is not None:
            self.table("expert cache (whole run)", cache_summary(
                stats, cache.capacity, cache.stride, engine.names["cache"], cache.policy.describe()))
            if model.lookahead != "off":
                self.table("router lookahead", lookahead_summary(stats, model.lookahead,
                                                                 model.lookahead_unready))
        for line in report_lines(model.trunk, model.tables):
            self.line(line)
        trunk_read = report_json(model.trunk, model.tables).get("trunk_read_seconds", 0.0)
        io = stats.read_seconds + (float(trunk_read) if isinstance(trunk_read, (int, float)) else 0.0)
        if gen.wall_seconds > 0:
            self.line(f"I/O share of wall clock: {100 * io / gen.wall_seconds:.1f}% (device time "
                      "summed over reader threads; above 100% means reads overlapped compute)")
            tw = report_json(model.trunk, model.tables).get("trunk_exposed_wait_seconds")
            if isinstance(tw, (int, float)):
                self.line(f"exposed waits : trunk {tw:.2f} s ({100 * tw / gen.wall_seconds:.1f}% "
                          f"of wall), experts {stats.exposed_wait_seconds:.2f} s "
                          f"({100 * stats.exposed_wait_seconds / gen.wall_seconds:.1f}%)")
        self.line(f"PEAK RSS for the whole run: {gb(peak_rss_bytes())}   <- quote this, not the plan")
        self.line(f"layers completed: {model.layers_completed}/{model.n_layers}; routed expert "
                  f"drops: {stats.drops}")


def _rate(n: int, seconds: float) -> str:
    return f"{n / seconds:.2f}" if seconds > 0 else "-"


def run_record(engine: Bound, gen: Generation) -> dict[str, Any]:
    """The run's figures as JSON (``--out``, and ``Generation.report`` in the Python API)."""
    model, stats = engine.model, engine.experts.stats
    s = gen.sampler
    step_log = engine.step_log.to_json() if engine.step_log is not None else {}
    return {
        "prompt_ids": gen.prompt_ids,
        "generated_ids": gen.ids,
        "full_ids": gen.full_ids,
        "generated_text": gen.text,
        "stop_reason": gen.stop_reason,
        "interrupted": gen.interrupted,
        "layers": model.n_layers,
        "layers_requested": model.n_layers,
        "layers_completed": model.layers_completed,
        "seconds_per_token": gen.seconds_per_token,
        "step_seconds": [st.seconds for st in gen.steps],
        "wall_seconds": gen.wall_seconds,
        "peak_rss_bytes": peak_rss_bytes(),
        "expert_drops": stats.drops,
        "backend": engine.names["kernel"],
        "storage": engine.names["storage"],
        "cache_policy": engine.names["cache"],
        "threads": engine.kernels.threads,
        "incremental": engine.incremental,
        "sampling": None if s is None else {"temperature": s.temperature, "top_p": s.top_p,
                                             "top_k": s.top_k, "seed": s.seed},
        "stopped_at": gen.stopped_at,
        "speculative": gen.spec.to_json() if gen.spec is not None else None,
        "bytes_per_token": bytes_per_token(engine, gen) if gen.ids else None,
        **cache_json(stats),
        **lookahead_json(stats, model.lookahead, model.lookahead_unready),
        **prefill_json(engine, gen),
        **report_json(model.trunk, model.tables),
        **step_log,
    }


def bytes_per_token(engine: Bound, gen: Generation) -> dict[str, Any]:
    """Bytes per generated token over the run: read from storage (trunk, experts) and
    multiplied (trunk layers acquired per forward pass, distinct routed experts per layer
    visit). Fewer passes per token (``--spec``) shrink both."""
    from k3core.model.sizes import sizes_from_config

    model, stats = engine.model, engine.experts.stats
    n = max(len(gen.ids), 1)
    passes = gen.spec.passes if gen.spec is not None else len(gen.steps)
    tstats = getattr(model.trunk, "stats", None)
    trunk_read = int(getattr(tstats, "bytes_read", 0) or 0)
    sizes = sizes_from_config(engine.cfg)
    layer_share = model.n_layers / max(engine.cfg.n_layers, 1)
    distinct = stats.requests - int(stats.extra.get("reuse", 0))
    return {"passes": passes, "tokens": len(gen.ids),
            "trunk_read": trunk_read / n, "expert_read": stats.bytes_read / n,
            "trunk_touched": passes * sizes.trunk_bytes * layer_share / n,
            "expert_touched": distinct * sizes.expert_bytes / n}


def prefill_json(engine: Bound, gen: Generation) -> dict[str, Any]:
    """The first forward pass: ids, chunk size and passes, routed-expert bytes read against
    what ``prefill_ids`` single-id passes would multiply (top-k experts per id and layer)."""
    model, cfg = engine.model, engine.cfg
    sz = sizes_from_config(cfg).first(model.n_layers)
    return {
        "prefill_ids": gen.prefill_ids,
        "prefill_chunk": model.prefill_chunk or gen.prefill_ids,
        "prefill_chunks": gen.prefill_chunks,
        "prefill_expert_bytes_read": gen.prefill_expert_bytes,
        "prefill_expert_bytes_if_per_token": gen.prefill_ids * cfg.topk * sz.n_moe_layers * sz.expert_bytes,
    }


def cache_summary(stats: ExpertStats, slots: int, slot_bytes: int, policy: str, describe: str) -> list[tuple[str, str]]:
    req = stats.requests
    ret = (req - stats.evictions) / req if req else 0.0
    mbs = stats.bytes_read / stats.read_seconds / 1e6 if stats.read_seconds > 0 else 0.0
    return [
        ("policy", describe if describe.startswith(policy) else f"{policy}: {describe}" if describe else policy),
        ("slots", f"{slots} x {human(slot_bytes)} = {human(slots * slot_bytes)}"),
        ("requests", f"{req}"),
        ("resident hits", f"{stats.hits} ({100 * stats.hits / req if req else 0:.1f}%; resident before the step began)"),
        ("misses", f"{stats.misses}  reused this step: {int(stats.extra.get('reuse', 0))}"),
        ("evictions", f"{stats.evictions}  retention {100 * ret:.1f}%"),
        ("read", f"{human(stats.bytes_read)} in {stats.read_seconds:.2f} s device time ({mbs:.0f} MB/s)"),
        ("waiting on reads", f"{stats.exposed_wait_seconds:.2f} s exposed (the rest overlapped compute)"),
        ("drops", f"{stats.drops}"),
    ]


def cache_json(stats: ExpertStats) -> dict[str, Any]:
    return {
        "expert_requests": stats.requests,
        "expert_resident_hits": stats.hits,
        "expert_misses": stats.misses,
        "expert_reuse_in_step": int(stats.extra.get("reuse", 0)),
        "expert_evictions": stats.evictions,
        "expert_bytes_read": stats.bytes_read,
        "expert_read_seconds": stats.read_seconds,
        "expert_exposed_wait_seconds": stats.exposed_wait_seconds,
        "expert_drops": stats.drops,
    }


def lookahead_json(stats: ExpertStats, mode: str, unready: int) -> dict[str, Any]:
    """The router lookahead's figures (docs/expert-cache.md, "Router lookahead")."""
    x = stats.extra
    real = int(x.get("lookahead_real", 0))
    recalled = int(x.get("lookahead_recalled", 0))
    return {
        "lookahead": mode,
        "lookahead_recall": recalled / real if real else None,
        "lookahead_guessed_layers": int(x.get("lookahead_layers", 0)),
        "lookahead_unready_layers": unready,
        "lookahead_reads": int(x.get("lookahead_reads", 0)),
        "lookahead_used_reads": int(x.get("lookahead_used", 0)),
        "lookahead_cancelled_reads": int(x.get("lookahead_cancelled", 0)),
        "lookahead_skipped": int(x.get("lookahead_skipped", 0)),
        "lookahead_bytes_read": int(x.get("lookahead_bytes", 0)),
        "lookahead_wasted_bytes": int(x.get("lookahead_wasted_bytes", 0)),
    }


def lookahead_summary(stats: ExpertStats, mode: str, unready: int) -> list[tuple[str, str]]:
    j = lookahead_json(stats, mode, unready)
    recall = j["lookahead_recall"]
    return [
        ("mode", f"{mode} (guesses only start reads; the real router decides)"),
        ("recall", "n/a" if recall is None else
         f"{100 * recall:.1f}% of the real experts of {j['lookahead_guessed_layers']} guessed "
         f"layer visits were guessed ({unready} not guessed: trunk not read yet)"),
        ("guessed reads", f"{j['lookahead_reads']}: {j['lookahead_used_reads']} used, "
         f"{j['lookahead_cancelled_reads']} cancelled unstarted, {j['lookahead_skipped']} "
         "skipped (no slot a guess may take)"),
        ("read", f"{human(j['lookahead_bytes_read'])}; wasted {human(j['lookahead_wasted_bytes'])} "
         "(read for a guess the real router did not make)"),
        ("exposed wait", f"{stats.exposed_wait_seconds:.2f} s (the expert cache's, whole run)"),
    ]

