"""``k3 bench-ladder MODEL_DIR TRUNK_DIR``: the memory ladder (see ``k3core.tools.bench.ladder``)."""

from __future__ import annotations

from pathlib import Path

import typer

from k3core.api.errors import UsageError
from k3core.api.outputs import Output, check_outputs
from k3core.api.units import check_gb, human
from k3core.checkpoint.index import CheckpointIndex
from k3core.cli.guard import guarded
from k3core.experts.locator import ExpertLocator
from k3core.model.config import load_config
from k3core.model.sizes import slot_bytes
from k3core.plugins.registry import get_registry
from k3core.run.prompt import check_vocab, parse_ids
from k3core.tools.bench.ladder import (
    K3_CMD,
    MIN_RUNGS,
    bound_lines,
    check_same_ids,
    default_budgets,
    fixed_bytes,
    parse_budgets,
    run_rung,
    write_plot,
    write_tsv,
)
from k3core.trunk.manifest import open_trunk
from k3core.trunk.parts import stream_unit_sizes
from k3core.trunk.plan import trunk_floor


@guarded
def bench_ladder(
    model_dir: Path = typer.Argument(..., help="Directory with the safetensors shards."),
    trunk_dir: Path = typer.Argument(..., help="Packed trunk (k3 pack-trunk)."),
    budgets: str = typer.Option(None, "--budgets", help="Trunk budgets in GB, e.g. 0.2,0.4,1 (default: 8 from floor to all pinned)."),
    gen: int = typer.Option(6, "--gen", help="Tokens per rung (>= 2; step 0 is excluded from s/token)."),
    ids: str = typer.Option("3,7,11,5,9", "--ids", help="Prompt token ids."),
    out_dir: Path = typer.Option(Path("build/ladder"), "--out-dir", help="Where ladder.tsv, ladder.png and per-rung logs go."),
    storage: str = typer.Option("auto", "--storage", help="Storage backend for every rung."),
    backend: str = typer.Option("auto", "--backend", help="Kernel backend for every rung."),
    threads: int = typer.Option(None, "--threads", help="Kernel threads."),
    ring: int = typer.Option(None, "--trunk-ring", help="Ring slots wanted (1..8)."),
    no_limit: bool = typer.Option(False, "--no-limit", help="Do not cap each rung's memory."),
    headroom_gb: float = typer.Option(None, "--headroom-gb", help="Allowance over budget + tables + experts + state (default 2 GB cgroup / 4 GB RLIMIT_AS)."),
    timeout: float = typer.Option(None, "--timeout", help="Seconds allowed per rung."),
    codec_trunk: Path = typer.Option(None, "--codec-trunk", help="The same model packed with a codec (k3 pack-trunk --codec): every budget also runs from it, in the codec_* columns."),
    cache_gb: float = typer.Option(None, "--cache-gb", help="Expert cache per rung (default: the smallest legal one, top-k + 1 slots, so the ladder measures the trunk)."),
) -> None:
    """Run the same request at trunk budgets from nothing pinned to everything pinned."""
    check_gb(headroom_gb, "--headroom-gb")
    check_gb(cache_gb, "--cache-gb", positive=True)
    given_budgets = parse_budgets(budgets) if budgets else None
    if gen < 2:
        raise UsageError(f"--gen must be >= 2 (step 0 is excluded from s/token), got {gen}")
    prompt = parse_ids(ids)
    cfg = load_config(model_dir / "config.json")
    check_vocab(prompt, cfg.vocab)
    backend_obj, _, _ = get_registry().create("storage", storage)
    with CheckpointIndex.open(model_dir, backend_obj) as index:
        man = open_trunk(trunk_dir, index, cfg)
        coded_man = open_trunk(codec_trunk, index, cfg) if codec_trunk is not None else None
        if coded_man is not None and not coded_man.compressed:
            raise UsageError(f"--codec-trunk {codec_trunk} was packed without a codec; pack it "
                             "with `k3 pack-trunk MODEL_DIR DIR --codec NAME`")
        rest = fixed_bytes(cfg, index, len(prompt) + gen + 1)
        if cache_gb is None:
            stride = slot_bytes(ExpertLocator(cfg, index).max_bytes(range(cfg.n_layers)))
            cache_gb = (cfg.topk + 1) * stride / 1e9 * 1.001
    sizes = [lay.nbytes for lay in man.layers[: cfg.n_layers]]
    rung_budgets = given_budgets or default_budgets(sizes)
    if len(rung_budgets) < MIN_RUNGS:
        print(f"note: {len(rung_budgets)} budgets; a ladder wants at least {MIN_RUNGS}")
    check_outputs([Output(out_dir, "--out-dir", directory=True,
                          files=("ladder.tsv", "ladder.png"))],
                  inputs=[(model_dir, "MODEL_DIR"), (trunk_dir, "TRUNK_DIR"),
                          (codec_trunk, "--codec-trunk")])
    base = [*K3_CMD, "run", str(model_dir), "--ids", ids,
            "--gen", str(gen), "--incremental", "--trunk", str(trunk_dir),
            "--storage", storage, "--backend", backend, "--cache-gb", f"{cache_gb:.6f}"]
    if threads is not None:
        base += ["--threads", str(threads)]
    if ring is not None:
        base += ["--trunk-ring", str(ring)]
    positions = len(prompt) + gen + 1
    print(f"ladder: {len(rung_budgets)} rungs over {human(man.total_bytes)} packed "
          f"(floor {human(trunk_floor(stream_unit_sizes(man, cfg.n_layers)))}), {gen} tokens "
          "each, incremental")
    rungs = []
    for i, b in enumerate(rung_budgets):
        r = run_rung(i, b, cfg, base, out_dir, positions, int(b * 1e9) + rest, not no_limit,
                     timeout, None if headroom_gb is None else int(headroom_gb * 1e9))
        rungs.append(r)
        status = (f"{r.s_per_token:.3f} s/token, {r.pinned}/{r.n_layers} pinned, ring {r.ring}, "
                  f"{r.trunk_bytes_per_token / 1e9:.3f} GB trunk/token, peak RSS "
                  f"{r.peak_rss / 1e9:.2f} GB (plan {r.plan_total / 1e9:.2f}), "
                  f"limit {r.limit_kind}") if r.ok else f"FAILED: {r.error}"
        print(f"  rung {i}: --trunk-gb {b:g}: {status}", flush=True)
        if codec_trunk is not None:
            coded_base = [str(codec_trunk) if x == str(trunk_dir) else x for x in base]
            c = r.coded = run_rung(i, b, cfg, coded_base, out_dir, positions, int(b * 1e9) + rest,
                                   not no_limit, timeout,
                                   None if headroom_gb is None else int(headroom_gb * 1e9),
                                   tag="-codec")
            status = (f"{c.s_per_token:.3f} s/token, {c.trunk_bytes_per_token / 1e9:.3f} GB "
                      f"trunk/token read, {c.read_s_per_token:.3f} s/token reading and "
                      f"decoding, peak RSS {c.peak_rss / 1e9:.2f} GB") if c.ok else (
                          f"FAILED: {c.error}")
            print(f"  rung {i}: --trunk-gb {b:g}, {c.codec} trunk: {status}", flush=True)
    write_tsv(out_dir / "ladder.tsv", rungs)
    print(f"wrote {out_dir / 'ladder.tsv'}")
    ok = [r for r in rungs if r.ok]
    if ok:
        write_plot(out_dir / "ladder.png", rungs,
                   f"k3 memory ladder: {cfg.hidden} hidden x {cfg.n_layers} layers, "
                   f"{gen} tokens, ids {'same' if len({tuple(r.ids) for r in ok}) == 1 else 'DIFFER'}")
        print(f"wrote {out_dir / 'ladder.png'}")
    print("what bounds time per token (steady-state means, step 0 excluded):")
    for line in bound_lines(rungs):
        print(line)
    check_same_ids(rungs)
    print(f"every rung generated {','.join(map(str, rungs[0].ids))}")


def register(app: typer.Typer) -> None:
    app.command("bench-ladder")(bench_ladder)
