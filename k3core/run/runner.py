"""One ``k3 run``, as the pipeline request -> plan -> engine -> session -> report.

:func:`execute` is all the command line calls: it plans (every cheap refusal and the whole
memory plan before anything large is allocated), opens the engine, runs one session with
the report attached (the text to stdout as it arrives, the table and summary to stderr) and
writes the output files atomically after the run. A Ctrl-C after some tokens keeps what was
made: the text and ids so far are printed, ``--out`` is written with ``"interrupted":
true`` and ``"stop_reason": "interrupted"``, and the interrupt propagates (exit 130).
"""

from __future__ import annotations

import json
import time
from functools import partial
from typing import Any

from k3core.api.errors import ExpertDropError, UsageError, param
from k3core.api.experts import ExpertExecutor
from k3core.api.outputs import write_json_atomic, write_logits
from k3core.run.engine import Engine, open_engine
from k3core.run.generation import Generation
from k3core.run.plan import EnginePlan, RunPlan
from k3core.run.report import RunReport, run_record
from k3core.run.request import GenerationParams, RunRequest, spec_from_preset
from k3core.run.session import Session, make_sampler


def execute(r: RunRequest, rep: RunReport | None = None,
            remote: ExpertExecutor | None = None) -> dict[str, Any]:
    """Run the request; returns the ``--out`` record (also written when ``--out`` is given).
    ``remote`` computes the routed experts elsewhere (``k3core.cluster``): the head then
    plans and opens no expert cache, and a remote failure (exit 4) after some tokens still
    writes ``--out`` with what was made (``stop_reason`` ``worker_lost``)."""
    rep = rep or RunReport(r.verbosity)
    if remote is not None:
        r = r.model_copy(update={"engine": r.engine.model_copy(update={"remote_experts": True})})
    engine = open_engine(r, on_plan=partial(_show_plan, rep, r))
    plan = engine.plan
    assert isinstance(plan, RunPlan)
    session = engine.session()
    interrupted = False
    lost: ExpertDropError | None = None
    try:
        if remote is not None:  # plan, bind and check the workers: before the first token
            remote.start(engine, rep.line)
        rep.engine_lines(engine)
        try:
            gen = _decode(engine, session, plan, rep)
        except KeyboardInterrupt:
            if session.last is None or not (session.last.ids or
                                            session.last.first_logits is not None):
                raise
            gen, interrupted = session.last, True
            gen.mark_interrupted()  # also when it came between steps, outside the loop
        except ExpertDropError as exc:  # a worker lost past its retries: keep what was made
            if remote is None or session.last is None or not session.last.ids:
                raise
            gen, lost = session.last, exc
            gen.stop_reason = "worker_lost"
        if engine.tokenizer is None:  # no text to stream: stdout gets the ids instead
            rep.text(",".join(map(str, gen.ids)) + "\n" if gen.ids else "")
        rep.end_text()
        rep.summary(engine, gen, gen.limit)
        record = run_record(engine, gen)
        record["request"] = r.to_json()
        record["plan"] = plan.to_json()
        record["memory_plan"] = record["plan"].get("memory")
        if remote is not None:
            record["cluster"] = remote.report(rep.line)
        if lost is not None:
            record["error"] = {"exit_code": int(lost.exit_code), "message": lost.message}
        if not interrupted and lost is None:
            _save_state(session, r, rep)
    finally:
        if remote is not None:
            remote.close()
        engine.close()
    _write_outputs(engine, gen, record, r, rep)
    if interrupted:
        raise KeyboardInterrupt
    if lost is not None:
        raise lost
    return record


def _show_plan(rep: RunReport, r: RunRequest, plan: EnginePlan) -> None:
    """The plan on stderr, before anything large is allocated."""
    for line in plan.lines(rep.verbose, short=not rep.detail):
        rep.line(line)
    rep.line(f"request: {json.dumps(r.given())}", level=1)


def _decode(engine: Engine, session: Session, plan: RunPlan, rep: RunReport) -> Generation:
    r = plan.run
    if r.outputs.load_state is not None:
        t0 = time.perf_counter()
        session.load(r.outputs.load_state)
        rep.line(f"loaded {r.outputs.load_state}: {len(session.ids)} ids, {session.positions} "
                 f"positions in {time.perf_counter() - t0:.2f} s; the prompt continues it")
    preset = plan.preset
    params = spec_from_preset(r.generation, _seeded(r.generation), preset)
    if params.spec != "off" and "spec" not in r.generation.model_fields_set and preset:
        rep.line(f"speculative decoding: {params.spec}, width {params.spec_width} "
                 f"(preset {preset.name})")
    sampler = make_sampler(params)
    if sampler is not None:
        rep.line(f"sampling: temperature {sampler.temperature}, top-p {sampler.top_p}, "
                 f"top-k {sampler.top_k or 'off'}, seed {sampler.seed}")
    rep.step_header()
    stats = engine.experts.stats
    rep.reset_step_baseline(stats)
    from k3core.trunk.source import StepTrunkLog

    engine.step_log = StepTrunkLog(engine.model.trunk)
    lark = r.constraint.text()
    constraint = None
    if lark is not None:
        from k3core.constrain.files import make_constraint

        if engine.tokenizer is None:
            raise UsageError(f"{param('json_schema')} and {param('grammar')} need a tokenizer: "
                             "pass --tok, or use a model directory that has one")
        constraint = make_constraint(lark, engine.tokenizer)
    steps = session.steps(plan.prompt_ids, params, None, constraint)
    try:
        for step, piece in steps:
            rep.text(piece)
            if step is not None:
                engine.step_log.record()
                rep.step(step.index, step.token, step.seconds, stats, piece)
    finally:
        steps.close()  # a Ctrl-C between steps: the loop's own bookkeeping still runs
    assert session.last is not None
    return session.last


def _seeded(p: GenerationParams) -> GenerationParams:
    """Fix a time-based seed now, so the report can print the seed the run used."""
    if p.greedy or p.seed is not None:
        return p
    return p.model_copy(update={"seed": time.time_ns() % (1 << 63)})


def _save_state(session: Session, r: RunRequest, rep: RunReport) -> None:
    path = r.outputs.save_state
    if path is None:
        return
    if not session.incremental:
        rep.note("--save-state needs incremental decoding (drop --full-recompute); nothing written")
        return
    t0 = time.perf_counter()
    size = session.save(path)
    rep.line(f"wrote {path} ({size} bytes, {session.positions} positions) in "
             f"{time.perf_counter() - t0:.2f} s")


def _write_outputs(engine: Engine, gen: Generation, record: dict[str, Any], r: RunRequest,
                   rep: RunReport) -> None:
    o = r.outputs
    if o.dump_logits is not None and gen.first_logits is not None:
        write_logits(o.dump_logits, gen.first_logits)
        rep.line(f"wrote {o.dump_logits} ({gen.first_logits.size} float32 logits)")
    if o.dump_cache_trace is not None:
        recorder = getattr(engine.experts, "recorder", None)
        if recorder is not None:
            recorder.write(o.dump_cache_trace)
            rep.line(f"wrote {o.dump_cache_trace}/expert_trace.bin: {len(recorder)} requests")
    if o.out is not None:
        write_json_atomic(o.out, record, "--out")
        rep.line(f"wrote {o.out}" + (" (marked interrupted)" if gen.interrupted else ""))
