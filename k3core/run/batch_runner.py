"""One ``k3 run MODEL --batch-file FILE``: every prompt of a batch file, their passes batched.

:func:`execute_batch` is what the command line calls with ``--batch-file``. It takes the
run's flags as ``k3 run`` does (:meth:`~k3core.run.request.RunRequest.from_flags`: the same
checks, the same engine), reads and checks the whole file
(:mod:`k3core.run.batch_file`: the file's own refusals before the model is opened, the
tokenizer's and the vocabulary's from the plan, before any weight is bound), then runs the
prompts through :func:`~k3core.run.batch.run_batch`: at most ``max_batch`` at once, each in
a fresh session, each result the bytes of that prompt run alone with ``k3 run``. The memory
plan holds ``max_batch`` sequences (its ``slots``), each as long as the file's longest;
without ``max_batch``, :data:`~k3core.run.batch.DEFAULT_BATCH` or as many as the plan fits
if fewer.

Output. stdout gets one JSON object per prompt, a line each, written and flushed as that
prompt finishes (so not in the file's order): ``index``, ``line``, ``id``, ``text``
(``null`` without a tokenizer), ``ids`` (the generated ids), ``stop_reason``,
``prompt_tokens``, ``completion_tokens``, ``seconds`` and ``seed`` (the sampler's, ``null``
when greedy: a sampled line given no seed gets one from the clock, ``seed`` given here
reproduces it). A prompt that fails while running gets ``{"index", "line", "id",
"error"}`` instead; the others go on, and the command then fails (exit 1) naming how many
failed and the first. ``--out FILE`` also writes every line's object, in the file's order,
atomically once all have ended (nothing on a Ctrl-C, which stops the run: exit 130). The
plan, a line per prompt (``-v``) and a summary go to stderr (``-q`` silences them).

A batch run takes no other prompt (``--prompt``, ``--prompt-file``, ``--ids``), nor the
options of one sequence (``--save-state``, ``--load-state``, ``--dump-logits``,
``--dump-cache-trace``, ``--json-schema``, ``--grammar``) or the cluster's: each is refused
(exit 2) before anything is read.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from k3core.api.errors import K3Error, UsageError
from k3core.api.outputs import write_bytes_atomic
from k3core.model.scheduler import BatchStats
from k3core.run.batch import DEFAULT_BATCH, BatchItem, check_max_batch, run_batch
from k3core.run.batch_file import BatchLine, prompt_ids, read_batch_file
from k3core.run.engine import open_engine
from k3core.run.generation import Generation
from k3core.run.memory_plan import most_slots
from k3core.run.plan import EnginePlan
from k3core.run.preset import Preset
from k3core.run.report import RunReport
from k3core.run.request import PromptInput, RunRequest, spec_from_preset

__all__ = ["execute_batch", "result_record"]


#: the run options a batch run refuses (each is about one sequence), by their flag names
ONE_SEQUENCE = {"prompt": "--prompt", "prompt_file": "--prompt-file", "ids": "--ids",
                "save_state": "--save-state", "load_state": "--load-state",
                "dump_logits": "--dump-logits", "dump_cache_trace": "--dump-cache-trace",
                "json_schema": "--json-schema", "grammar": "--grammar"}


def batch_request(flags: Mapping[str, Any], batch_file: Path | None, max_batch: int | None,
                  also: Mapping[str, object] | None = None) -> tuple[RunRequest, Path]:
    """The run's request from ``k3 run``'s flags (as :meth:`RunRequest.from_flags` takes
    them) and the batch file, each refusal a ``UsageError`` (exit 2). ``also``: other
    options the caller was given, by flag, that a batch run refuses when not ``None`` (the
    cluster's)."""
    if batch_file is None:
        raise UsageError("--max-batch needs --batch-file FILE")
    check_max_batch(max_batch)
    for name, flag in ONE_SEQUENCE.items():
        if flags.get(name) is not None:
            if name in ("prompt", "prompt_file", "ids"):
                raise UsageError(f"--batch-file and {flag} are mutually exclusive: the prompts "
                                 "are the file's lines")
            raise UsageError(f"--batch-file does not take {flag} (it is about one sequence)")
    for flag, value in (also or {}).items():
        if value is not None:
            raise UsageError(f"--batch-file does not take {flag}")
    # from_flags checks every flag as one run's, and wants exactly one prompt source: the
    # file is this run's, so a stand-in is given and dropped (each line brings its own)
    r = RunRequest.from_flags({**flags, "ids": "0"})
    return r.model_copy(update={"prompt": PromptInput(bos=r.prompt.bos)}), batch_file


def execute_batch(flags: Mapping[str, Any], batch_file: Path | None, max_batch: int | None,
                  also: Mapping[str, object] | None = None,
                  rep: RunReport | None = None) -> list[dict[str, Any]]:
    """Run every prompt of ``batch_file`` (see the module); returns the result objects in
    the file's order. Raises a ``K3Error`` (exit 1) after the run when a prompt failed.
    ``max_batch`` ``None``: :data:`~k3core.run.batch.DEFAULT_BATCH`, or fewer where the
    memory plan fits fewer."""
    r, path = batch_request(flags, batch_file, max_batch, also)
    lines = read_batch_file(path, r.generation, bos=r.prompt.bos)
    rep = rep or RunReport(r.verbosity)
    ids: list[list[int]] = []
    at_once = min(max_batch or DEFAULT_BATCH, len(lines))

    def prepare(plan: EnginePlan) -> None:  # the plan is made, no weight is bound yet
        nonlocal at_once
        tok = plan.tokenizer
        bos = tok.special_tokens.get("[BOS]") if tok is not None else None
        ids.extend(prompt_ids(lines, path, tok, plan.cfg.vocab,
                              bos if bos is not None else plan.cfg.bos_token_id))
        r.outputs.check(inputs=(*plan.inputs(), (path, "--batch-file")))
        at_once = _plan_slots(plan, lines, ids, at_once, fit=max_batch is None)
        for line in plan.lines(rep.verbose, short=not rep.detail):
            rep.line(line)
        rep.line(f"batch  : {len(lines)} prompts from {path}, at most {at_once} at once")

    engine = open_engine(r.engine.model_copy(update={"given_as": "flag"}), on_plan=prepare)
    items = _items(engine.plan.preset, lines, ids)
    records: list[dict[str, Any]] = [{} for _ in lines]
    failed: list[int] = []
    stopped = threading.Event()  # Ctrl-C: the prompts still running say nothing more

    def emit(i: int, out: Generation | BaseException) -> None:
        if stopped.is_set():
            return
        rec = result_record(lines[i], out)
        records[i] = rec
        rep.text(json.dumps(rec) + "\n")
        if "error" in rec:
            failed.append(i)
            rep.line(f"line {lines[i].line}: failed: {rec['error']}")
        else:
            rep.line(f"line {lines[i].line}: {rec['completion_tokens']} tokens in "
                     f"{rec['seconds']:.2f} s ({rec['stop_reason']})", level=1)

    t0 = time.perf_counter()
    try:
        rep.engine_lines(engine)
        run_batch(engine, items, max_batch=at_once, on_result=emit)
    except KeyboardInterrupt:
        stopped.set()
        raise
    finally:
        engine.close()
    _summary(rep, engine.model.scheduler.stats, records, time.perf_counter() - t0)
    if r.outputs.out is not None:
        data = "".join(json.dumps(rec) + "\n" for rec in records).encode()
        write_bytes_atomic(r.outputs.out, data, "--out")
        rep.line(f"wrote {r.outputs.out} ({len(records)} lines)")
    if failed:
        first = lines[min(failed)]
        raise K3Error(f"{len(failed)} of {len(lines)} prompts failed (the first: "
                      f"{first.where(path)}: {records[first.index]['error']})")
    return records


def _plan_slots(plan: EnginePlan, lines: list[BatchLine], ids: list[list[int]],
                at_once: int, fit: bool) -> int:
    """Plan the memory of ``at_once`` sequences at once, each as long as the longest line's
    (its prompt and its tokens); with ``fit``, ``at_once`` is first lowered to what the plan
    fits (``most_slots``: at least one). Returns the sequences planned. A plan that does not
    fit is refused after this (exit 1), before any weight is bound."""
    size = [len(p) + b.params.budget(len(p))[0] for p, b in zip(ids, lines, strict=True)]
    longest = max(range(len(lines)), key=size.__getitem__)
    prompt_len, gen = len(ids[longest]), size[longest] - len(ids[longest])
    if fit:
        one = plan.plan_memory(prompt_len, gen)  # the request's slots: one
        at_once = most_slots(one, at_once)
    plan.request = plan.request.model_copy(update={"slots": at_once})
    plan.plan_memory(prompt_len, gen)
    return at_once


def _items(preset: Preset | None, lines: list[BatchLine], ids: list[list[int]]) -> list[BatchItem]:
    """Each line's ids and parameters as one run would take them: the preset's ``spec``
    where neither the flags nor the line gave one, and a sampled line without a seed given
    one now (printed in its result)."""
    base = time.time_ns()
    out: list[BatchItem] = []
    for b, p in zip(lines, ids, strict=True):
        params = b.params
        if not params.greedy and params.seed is None:
            params = params.model_copy(update={"seed": (base + b.index) % (1 << 63)})
        out.append((p, spec_from_preset(b.params, params, preset)))
    return out


def result_record(b: BatchLine, out: Generation | BaseException) -> dict[str, Any]:
    """The JSON object of one prompt's result (see the module)."""
    head: dict[str, Any] = {"index": b.index, "line": b.line, "id": b.id}
    if isinstance(out, BaseException):
        msg = out.message if isinstance(out, K3Error) else f"{type(out).__name__}: {out}"
        return {**head, "error": msg}
    return {**head, "text": out.text, "ids": out.ids, "stop_reason": out.stop_reason,
            "prompt_tokens": len(out.prompt_ids), "completion_tokens": len(out.ids),
            "seconds": out.wall_seconds,
            "seed": out.sampler.seed if out.sampler is not None else None}


def _summary(rep: RunReport, stats: BatchStats, records: list[dict[str, Any]], wall: float) -> None:
    done = [rec for rec in records if "ids" in rec]
    tokens = sum(rec["completion_tokens"] for rec in done)
    failed = len(records) - len(done)
    rate = f" ({tokens / wall:.1f} tokens/s)" if wall > 0 else ""
    rep.line(f"batch: {len(records)} prompts, {len(done)} done"
             + (f", {failed} failed" if failed else "")
             + f"; {tokens} tokens in {wall:.2f} s{rate}; {stats.passes} passes, at most "
             f"{stats.most} sequences in one")
