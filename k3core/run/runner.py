"""One ``k3 run``: settings, prompt, memory plan, engine, decode loop, report, outputs.

The order matters: everything that can be refused cheaply (flags, config, prompt, KV size,
the whole memory plan, output paths) is checked before anything large is allocated, and
output files are written atomically after the run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3core import __version__
from k3core.api.errors import UsageError
from k3core.api.units import ALIGN, gb_bytes, human
from k3core.experts.cache import ExpertCache
from k3core.experts.setup import CacheOptions
from k3core.model.generate import RunResult, Step, generate
from k3core.model.sampling import Sampler, argmax
from k3core.model.sizes import sizes_from_config
from k3core.plugins.registry import get_registry
from k3core.run.engine import Engine, EngineOptions, open_engine, read_model_config
from k3core.run.idparse import check_vocab
from k3core.run.memory_plan import check_kv, plan_memory
from k3core.run.outputs import check_outputs, write_json_atomic, write_logits
from k3core.run.presets import check_plugins, load_preset
from k3core.run.prompt import PromptSpec, load_tokenizer, prompt_ids
from k3core.run.report import RunReport, cache_json, cache_summary, gb
from k3core.run.resources import peak_rss_bytes
from k3core.run.settings import MergedSettings, merge_settings
from k3core.trunk.source import (
    StepTrunkLog,
    check_trunk_options,
    report_json,
    report_lines,
    ultra_lines,
)

MAX_GEN = 4096
MAX_STOP_IDS = 8


@dataclass
class RunRequest:
    """Everything ``k3 run`` was given; ``None`` means "not given on the command line"."""

    model_dir: Path | None
    prompt: PromptSpec
    gen: int = 8
    incremental: bool | None = None
    tok: Path | None = None
    preset: str | None = None
    trunk: Path | None = None
    trunk_gb: float | None = None
    trunk_ring: int | None = None
    cache_gb: float | None = None
    ultra_low_memory: bool | None = None
    stop_ids: list[int] = field(default_factory=list)
    config: Path | None = None
    layers: int | None = None
    out: Path | None = None
    dump_logits: Path | None = None
    dump_cache_trace: Path | None = None
    cache_trace: Path | None = None
    backend: str | None = None
    storage: str | None = None
    cache_policy: str | None = None
    threads: int | None = None
    verify_trunk: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None


def check_request(r: RunRequest) -> None:
    """Refusals that need no file (exit 2), in the reference's order."""
    r.prompt.check_sources()
    if not 0 <= r.gen <= MAX_GEN:
        raise UsageError(f"--gen must be in 0..{MAX_GEN}, got {r.gen} (refusing rather than clamping)")
    if len(r.stop_ids) > MAX_STOP_IDS:
        raise UsageError(f"--stop-id may be given at most {MAX_STOP_IDS} times")
    if any(s < 0 for s in r.stop_ids):
        raise UsageError("--stop-id must be a non-negative integer")
    if r.threads is not None and r.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {r.threads}")
    if r.cache_gb is not None and not r.cache_gb >= 0:
        raise UsageError(f"--cache-gb must be a non-negative number, got {r.cache_gb}")
    check_trunk_options(r.trunk, r.trunk_gb, r.trunk_ring, bool(r.ultra_low_memory))


def merged(r: RunRequest, preset: Any) -> MergedSettings:
    flags = {
        "model_dir": r.model_dir, "tok": r.tok, "trunk_gb": r.trunk_gb, "cache_gb": r.cache_gb,
        "ultra_low_memory": r.ultra_low_memory, "backend": r.backend, "storage": r.storage,
        "cache_policy": r.cache_policy, "threads": r.threads, "incremental": r.incremental,
    }
    return merge_settings(None, preset, None, flags)


def sampler_for(r: RunRequest) -> Sampler | None:
    if all(v is None for v in (r.temperature, r.top_p, r.top_k, r.seed)):
        return None
    seed = r.seed if r.seed is not None else time.time_ns() % (1 << 63)
    return Sampler(
        temperature=1.0 if r.temperature is None else r.temperature,
        top_p=1.0 if r.top_p is None else r.top_p,
        top_k=r.top_k,
        seed=seed,
    )


def execute(r: RunRequest, rep: RunReport | None = None) -> dict[str, Any]:
    """Run the request; returns the ``--out`` record (also written when ``--out`` is given)."""
    rep = rep or RunReport()
    check_request(r)
    sampler = sampler_for(r)
    model_dir_flag = r.model_dir
    pre_cfg_settings = merged(r, None).settings
    model_dir = model_dir_flag or pre_cfg_settings.model_dir
    if model_dir is None:
        raise UsageError("MODEL_DIR is required (or set K3_MODEL_DIR)")
    r.model_dir = Path(model_dir)
    check_outputs(r.out, r.dump_logits, r.dump_cache_trace, inputs=(r.model_dir, r.trunk))
    opts = EngineOptions(r.model_dir, r.config, r.layers)
    cfg = read_model_config(opts)
    preset = load_preset(r.preset, cfg=cfg) if r.preset else None
    ms = merged(r, preset)
    s = ms.settings
    if preset is not None:
        for problem in check_plugins(preset):
            raise UsageError(f"preset {preset.name}: {problem}")
    reg = get_registry()
    kspec, _ = reg.resolve("kernel", s.backend)
    kspec.load()  # import it now, so the plan's baseline (this process's RSS) includes it
    if s.storage != "auto":
        reg.resolve("storage", s.storage)
    reg.resolve("cache", s.cache_policy or "auto")
    streamed = r.trunk is not None
    if s.ultra_low_memory and not streamed:
        raise UsageError("--ultra-low-memory needs --trunk DIR (pack one with `k3 pack-trunk MODEL_DIR TRUNK_DIR`)")
    for sid in r.stop_ids:
        check_vocab([sid], cfg.vocab, "--stop-id")
    tok = load_tokenizer(s.tok, cfg.vocab, required=r.prompt.needs_tokenizer)
    bos = tok.special_token_id("[BOS]") if tok is not None else None
    bos = bos if bos is not None else cfg.bos_token_id
    ids, how = prompt_ids(r.prompt, tok, cfg.vocab, bos)
    incremental = bool(s.incremental)
    n_layers = r.layers or cfg.n_layers
    positions = len(ids) + r.gen + 1
    if incremental:
        check_kv(cfg, positions, n_layers=n_layers)
    trunk_gb = s.trunk_gb if streamed and (r.trunk_gb is not None or preset is not None) else None
    plan = plan_memory(
        cfg, streamed=streamed, cache_bytes=gb_bytes(s.cache_gb), prompt_len=len(ids), gen=r.gen,
        incremental=incremental, n_layers=n_layers,
        trunk_budget=_trunk_budget(cfg, n_layers, trunk_gb) if streamed else None,
        ultra=bool(s.ultra_low_memory),
    )

    rep.line(f"k3 {__version__}: Kimi K3, released checkpoint layout")
    rep.line(cfg.describe())
    rep.line(f"model  : {r.model_dir}")
    rep.line(f"prompt : {how}; generating {r.gen}" + (" (incremental)" if incremental else " (full recompute)"))
    if preset is not None:
        rep.line(f"preset : {preset.name} (trunk {preset.trunk_gb:.2f} GB / expert cache {preset.cache_gb:.2f} GB)"
                 + ("" if streamed else "; without --trunk the trunk is resident, so only the cache budget applies"))
    for line in ms.describe():
        rep.line(f"setting: {line}")
    if r.layers is not None:
        rep.line(f"NOTE: only the first {r.layers} of {cfg.n_layers} layers run; this is not the full model")
    for line in plan.lines():
        rep.line(line)
    plan.check()
    storage = s.storage
    if storage == "auto":
        storage = _auto_storage(r.model_dir, rep)
    cache_opts = CacheOptions(
        cache_gb=s.cache_gb,
        policy_options={"trace": str(r.cache_trace)} if r.cache_trace is not None else {},
        trace_dir=r.dump_cache_trace,
    )
    eopts = EngineOptions(
        r.model_dir, r.config, r.layers, s.backend, storage, s.cache_policy or "auto", s.threads,
        trunk_dir=r.trunk, trunk_gb=trunk_gb, ring=r.trunk_ring,
        ultra_low_memory=bool(s.ultra_low_memory), verify_trunk=r.verify_trunk, cache=cache_opts,
    )
    t0 = time.perf_counter()
    engine = open_engine(eopts, cfg)
    try:
        res = _decode(engine, rep, ids, r, incremental, sampler, tok, t0)
        record = _summary(engine, rep, res, r, tok, incremental, sampler)
        record["memory_plan"] = {"rows": dict(plan.rows()), "total": plan.total, "available": plan.available}
    finally:
        engine.close()
    if r.dump_logits is not None and res.first_logits is not None:
        write_logits(r.dump_logits, res.first_logits)
        rep.line(f"wrote {r.dump_logits} ({res.first_logits.size} float32 logits)")
    if r.dump_cache_trace is not None:
        recorder = getattr(engine.experts, "recorder", None)
        if recorder is not None:
            recorder.write(r.dump_cache_trace)
            rep.line(f"wrote {r.dump_cache_trace}/expert_trace.bin: {len(recorder)} requests")
    if r.out is not None:
        write_json_atomic(r.out, record, "--out")
        rep.line(f"wrote {r.out}")
    return record


def _trunk_budget(cfg: Any, n_layers: int, trunk_gb: float | None) -> int:
    """Bytes the streamed trunk may hold: ``--trunk-gb``, or (without it) every layer pinned."""
    if trunk_gb is not None:
        return int(trunk_gb * 1e9)
    return sizes_from_config(cfg).first(n_layers).trunk_bytes + ALIGN * n_layers


def _auto_storage(model_dir: Path, rep: RunReport) -> str:
    from k3_storage.direct import supports_direct

    avail = supports_direct(model_dir)
    if avail.ok:
        return "auto"
    rep.note(f"O_DIRECT is not usable for {model_dir} ({avail.reason}); auto picked storage 'mmap'")
    return "mmap"


def _decode(engine: Engine, rep: RunReport, ids: list[int], r: RunRequest, incremental: bool,
            sampler: Sampler | None, tok: Any, t0: float) -> RunResult:
    rep.line(engine.settings_line)
    for note in engine.notes:
        rep.note(note)
    rep.line(f"indexed {len(engine.index)} tensors from {len(engine.index.shards)} shards in "
             f"{engine.timings['index']:.2f} s; weights bound in {engine.timings['bind']:.2f} s")
    for line in engine.trunk_lines + ultra_lines(engine.model.tables, incremental, engine.model.n_layers):
        rep.line(line)
    cache = engine.experts if isinstance(engine.experts, ExpertCache) else None
    if cache is not None:
        rep.line(f"expert cache  : {cache.capacity} slots x {human(cache.stride)} = "
                 f"{human(cache.capacity * cache.stride)}, policy {engine.names['cache']}")
    rep.line(f"peak RSS after loading weights: {gb(peak_rss_bytes())} (the plan is a forecast; this is measured)")
    if sampler is not None:
        rep.line(f"sampling: temperature {sampler.temperature}, top-p {sampler.top_p}, "
                 f"top-k {sampler.top_k or 'off'}, seed {sampler.seed}")
    rep.step_header()
    rep.reset_step_baseline(engine.experts.stats)
    dec = tok.incremental_decoder() if tok is not None else None
    engine.step_log = StepTrunkLog(engine.model.trunk)

    def on_step(st: Step) -> None:
        engine.step_log.record()
        text = dec.push(st.token) if dec is not None else ""
        rep.step(st.index, st.token, st.seconds, engine.experts.stats, text)

    return generate(engine.model, ids, r.gen, incremental=incremental, stop_ids=r.stop_ids,
                    pick=sampler or argmax, on_step=on_step)


def _summary(engine: Engine, rep: RunReport, res: RunResult, r: RunRequest, tok: Any,
             incremental: bool, sampler: Sampler | None) -> dict[str, Any]:
    model = engine.model
    rss = peak_rss_bytes()
    stats = engine.experts.stats
    text = tok.decode(res.generated_ids) if tok is not None else None
    rep.line("-" * 60)
    if r.gen == 0:
        rep.line(f"prefill only: {len(res.prompt_ids)} positions, 0 tokens generated in {res.prefill_seconds:.2f} s")
    else:
        rep.line(f"{len(res.generated_ids)} tokens in {res.wall_seconds:.2f} s, {res.seconds_per_token:.3f} s/token average")
    if res.stopped_at >= 0:
        rep.line(f"stop id {res.stopped_at} reached after {len(res.generated_ids)} of {r.gen} tokens")
    rep.line(f"generated ids: {','.join(map(str, res.generated_ids))}")
    if text is not None:
        rep.line("--- generated text ---")
        rep.line(text)
        rep.line("-" * 22)
    cache = engine.experts if isinstance(engine.experts, ExpertCache) else None
    if cache is not None:
        rep.table("expert cache (whole run)", cache_summary(stats, cache.capacity, cache.stride,
                                                            engine.names["cache"], cache.policy.describe()))
    for line in report_lines(model.trunk, model.tables):
        rep.line(line)
    trunk_json = report_json(model.trunk, model.tables)
    trunk_read = trunk_json.get("trunk_read_seconds", 0.0)
    io = stats.read_seconds + (float(trunk_read) if isinstance(trunk_read, (int, float)) else 0.0)
    if res.wall_seconds > 0:
        rep.line(f"I/O share of wall clock: {100 * io / res.wall_seconds:.1f}% (device time summed over "
                 f"reader threads; above 100% means reads overlapped compute)")
    rep.line(f"PEAK RSS for the whole run: {gb(rss)}   <- quote this, not the plan")
    rep.line(f"layers completed: {model.layers_completed}/{model.n_layers}; routed expert drops: {stats.drops}")
    return {
        "prompt_ids": res.prompt_ids,
        "generated_ids": res.generated_ids,
        "full_ids": res.full_ids,
        "generated_text": text,
        "layers": model.n_layers,
        "layers_requested": model.n_layers,
        "layers_completed": model.layers_completed,
        "seconds_per_token": res.seconds_per_token,
        "step_seconds": [s.seconds for s in res.steps],
        "wall_seconds": res.wall_seconds,
        "peak_rss_bytes": rss,
        "expert_drops": stats.drops,
        "backend": engine.names["kernel"],
        "storage": engine.names["storage"],
        "cache_policy": engine.names["cache"],
        "threads": engine.kernels.threads,
        "incremental": incremental,
        "sampling": None if sampler is None else {"temperature": sampler.temperature, "top_p": sampler.top_p,
                                                   "top_k": sampler.top_k, "seed": sampler.seed},
        "stopped_at": res.stopped_at,
        **cache_json(stats),
        **trunk_json,
        **engine.step_log.to_json(),
    }
