"""``k3 run MODEL_DIR``: generate tokens and report what it cost."""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

import typer

from k3core.cli import guarded
from k3core.engine import EngineOptions, open_engine, read_model_config
from k3core.errors import UsageError
from k3core.generate import Step, generate
from k3core.idparse import check_vocab, parse_ids
from k3core.outputs import check_writable, write_json_atomic, write_logits
from k3core.trunk_setup import (
    StepTrunkLog,
    check_trunk_options,
    report_json,
    report_lines,
    ultra_lines,
)

MAX_GEN = 4096


def peak_rss_bytes() -> int:
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(kb) * (1 if sys.platform == "darwin" else 1024)


@guarded
def run(
    model_dir: Path = typer.Argument(..., help="Directory with the safetensors shards."),
    ids: str = typer.Option(None, "--ids", help="Prompt token ids, e.g. 3,7,11."),
    gen: int = typer.Option(8, "--gen", help="Tokens to generate (0..4096)."),
    incremental: bool = typer.Option(False, "--incremental", help="Carry KV cache and KDA state."),
    out: Path = typer.Option(None, "--out", help="Write the result as JSON."),
    dump_logits: Path = typer.Option(None, "--dump-logits", help="Write step 0 logits (raw f32)."),
    config: Path = typer.Option(None, "--config", help="Model config (default MODEL_DIR/config.json)."),
    layers: int = typer.Option(None, "--layers", help="Run only the first N layers."),
    backend: str = typer.Option("auto", "--backend", help="Kernel backend (see k3 backends)."),
    storage: str = typer.Option("auto", "--storage", help="Storage backend."),
    threads: int = typer.Option(None, "--threads", help="Kernel threads."),
    trunk: Path = typer.Option(None, "--trunk", help="Stream the trunk from this packed dir (k3 pack-trunk)."),
    trunk_gb: float = typer.Option(None, "--trunk-gb", help="Trunk budget in GB (1e9 B); default: pin all."),
    trunk_ring: int = typer.Option(None, "--trunk-ring", help="Ring slots wanted (1..8, default 2)."),
    ultra_low_memory: bool = typer.Option(False, "--ultra-low-memory", help="Stream embedding and lm_head too (needs --trunk)."),
    verify_trunk: bool = typer.Option(False, "--verify-trunk", help="Re-checksum every packed layer at open."),
) -> None:
    """Generate tokens greedily from MODEL_DIR."""
    if ids is None:
        raise UsageError("one of --ids is required")
    prompt = parse_ids(ids)
    if not 0 <= gen <= MAX_GEN:
        raise UsageError(f"--gen must be in 0..{MAX_GEN}, got {gen} (refusing rather than clamping)")
    if threads is not None and threads < 1:
        raise UsageError(f"--threads must be >= 1, got {threads}")
    for path, what in ((out, "--out"), (dump_logits, "--dump-logits")):
        if path is not None:
            check_writable(path, what)
    check_trunk_options(trunk, trunk_gb, trunk_ring, ultra_low_memory)
    opts = EngineOptions(model_dir, config, layers, backend, storage, threads=threads, trunk_dir=trunk,
                         trunk_gb=trunk_gb, ring=trunk_ring, ultra_low_memory=ultra_low_memory,
                         verify_trunk=verify_trunk)
    cfg = read_model_config(opts)
    check_vocab(prompt, cfg.vocab)
    print(cfg.describe())
    t0 = time.perf_counter()
    engine = open_engine(opts, cfg)
    try:
        print(engine.settings_line)
        for note in engine.notes:
            print(f"note: {note}")
        if layers is not None:
            print(f"NOTE: only the first {layers} of {cfg.n_layers} layers run; this is not the full model")
        print(
            f"indexed {len(engine.index)} tensors from {len(engine.index.shards)} shards in "
            f"{engine.timings['index']:.2f} s; trunk bound in {engine.timings['bind']:.2f} s"
        )
        for line in engine.trunk_lines + ultra_lines(engine.model.tables, incremental, engine.model.n_layers):
            print(line)
        print(f"prompt : {len(prompt)} tokens, generating {gen}" + (" (incremental)" if incremental else ""))
        print(f"{'STEP':>5} {'TOKEN':>8} {'SECONDS':>9} {'TOK/S':>8}")

        trunk_steps = StepTrunkLog(engine.model.trunk)

        def on_step(s: Step) -> None:
            trunk_steps.record()
            print(f"{s.index:>5} {s.token:>8} {s.seconds:>9.3f} {1 / max(s.seconds, 1e-9):>8.2f}", flush=True)

        res = generate(engine.model, prompt, gen, incremental=incremental, on_step=on_step)
    finally:
        engine.close()
    trunk_report = report_lines(engine.model.trunk, engine.model.tables)
    trunk_json = report_json(engine.model.trunk, engine.model.tables) | trunk_steps.to_json()
    wall = time.perf_counter() - t0
    rss = peak_rss_bytes()
    print(f"generated ids: {','.join(map(str, res.generated_ids))}")
    print(f"{len(res.generated_ids)} tokens in {res.wall_seconds:.2f} s, {res.seconds_per_token:.3f} s/token")
    print(f"PEAK RSS for the whole run: {rss / 1e9:.2f} GB")
    for line in trunk_report:
        print(line)
    if dump_logits is not None and res.first_logits is not None:
        write_logits(dump_logits, res.first_logits)
        print(f"wrote {dump_logits} ({res.first_logits.size} float32 logits)")
    if out is not None:
        write_json_atomic(
            out,
            {
                "prompt_ids": res.prompt_ids,
                "generated_ids": res.generated_ids,
                "full_ids": res.full_ids,
                "layers": engine.model.n_layers,
                "layers_requested": engine.model.n_layers,
                "layers_completed": engine.model.layers_completed,
                "seconds_per_token": res.seconds_per_token,
                "wall_seconds": res.wall_seconds,
                "run_seconds": wall,
                "peak_rss_bytes": rss,
                "expert_drops": engine.experts.stats.drops,
                "backend": engine.names["kernel"],
                "storage": engine.names["storage"],
                "cache_policy": engine.names["cache"],
                "incremental": incremental,
                "stopped_at": res.stopped_at,
                "step_seconds": [s.seconds for s in res.steps],
                **trunk_json,
            },
            "--out",
        )
        print(f"wrote {out}")


def register(app: typer.Typer) -> None:
    app.command("run")(run)
