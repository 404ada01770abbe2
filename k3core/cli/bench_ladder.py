"""``k3 bench-ladder MODEL_DIR TRUNK_DIR``: the memory ladder (see ``k3core.tools.bench.ladder``)."""

from __future__ import annotations

from pathlib import Path

import typer

from k3core.cli.guard import guarded


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
    from k3core.tools.bench.ladder import LadderOptions, run_ladder

    run_ladder(LadderOptions(
        model_dir=model_dir, trunk_dir=trunk_dir, budgets=budgets, gen=gen, ids=ids,
        out_dir=out_dir, storage=storage, backend=backend, threads=threads, ring=ring,
        limit=not no_limit, headroom_gb=headroom_gb, timeout=timeout, codec_trunk=codec_trunk,
        cache_gb=cache_gb), say=lambda line: print(line, flush=True))


def register(app: typer.Typer) -> None:
    app.command("bench-ladder")(bench_ladder)
