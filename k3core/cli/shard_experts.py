"""``k3 shard-experts MODEL_DIR OUT_DIR --workers N``: a head and one expert share per worker.

See :mod:`k3core.cluster.share_writer` and docs/cluster.md ("Each node only its share").
The plan and each directory's bytes go to stdout; progress to stderr.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import typer

from k3core.api.errors import UsageError
from k3core.api.units import human
from k3core.cli.guard import guarded
from k3core.cli.progress import Progress


@guarded
def shard_experts(
    model_dir: Path = typer.Argument(..., help="Directory with the safetensors shards."),
    out_dir: Path = typer.Argument(..., help="New or empty directory for head/ and worker-0/ ... worker-(N-1)/."),
    workers: int = typer.Option(..., "--workers", help="Expert workers to shard for (k3 run --expert-workers N)."),
    storage: str = typer.Option("auto", "--storage", help="Storage backend to read the shards with."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress on stderr."),
) -> None:
    """Write OUT_DIR/head (every tensor but the routed experts) and one share of routed
    experts per worker, each in the released layout with a manifest of checksums."""
    from k3core.cluster.share_writer import write_shares
    from k3core.cluster.shares import HEAD_NAME, worker_name
    from k3core.plugins.registry import get_registry

    if workers < 1:
        raise UsageError(f"--workers must be >= 1, got {workers}")
    backend, _, note = get_registry().create("storage", storage, for_path=model_dir)
    if note:
        print(f"note: {note}", file=sys.stderr)
    t0 = time.perf_counter()
    with Progress("shard-experts", byte_units=True, quiet=quiet) as bar:
        done = write_shares(model_dir, out_dir, workers, backend,
                            progress=lambda n, total: bar.update(n, total, "copied"))
    secs = time.perf_counter() - t0
    for line in done.plan.lines():
        print(line)
    head = done.head
    print(f"{out_dir / HEAD_NAME}: {human(head.file_bytes)} in {len(head.files)} files "
          "(every tensor but the routed experts)")
    for s in done.shares:
        print(f"{out_dir / worker_name(s.worker)}: {human(s.file_bytes)} in {len(s.files)} files "
              f"({s.experts} routed experts, {human(s.nbytes)})")
    total = head.file_bytes + sum(s.file_bytes for s in done.shares)
    print(f"wrote {human(total)} in {secs:.2f} s; run: k3 run {out_dir / HEAD_NAME} "
          f"--expert-workers {workers} --expert-shares {out_dir}")


def register(app: typer.Typer) -> None:
    app.command("shard-experts")(shard_experts)
