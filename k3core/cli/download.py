"""``k3 download REPO_ID DIR``: fetch a model at a pinned commit, check space, verify."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from k3core.cli.guard import guarded
from k3core.cli.progress import Stages
from k3core.tools.download.fetch import download as run_download


@guarded
def download(
    repo_id: str = typer.Argument(..., help="Hugging Face repo id, e.g. org/name."),
    local_dir: Path = typer.Argument(..., help="Directory to download into (resumable)."),
    revision: str = typer.Option(None, "--revision", help="Branch, tag or 40-hex commit "
                                 "(default: $K3_REVISION, else main, resolved to a commit once)."),
    allow_pattern: list[str] = typer.Option(None, "--allow-pattern",
                                            help="Only files matching (fnmatch; repeatable)."),
    skip_checksum: bool = typer.Option(False, "--skip-checksum",
                                       help="Verify sizes only (also K3_SKIP_CHECKSUM=1)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only the result line (nothing on "
                               "stderr but errors): no progress, no file list."),
) -> None:
    """Download a model, refusing early if it cannot fit, and verify every file."""
    rev = revision or os.environ.get("K3_REVISION") or None
    skip = skip_checksum or os.environ.get("K3_SKIP_CHECKSUM", "") not in ("", "0")
    with Stages("download", quiet=quiet, units={"fetch": "B", "verify": "B"}) as stages:
        res = run_download(repo_id, local_dir, revision=rev, allow_patterns=allow_pattern or None,
                           skip_checksum=skip, log=stages.note, progress=stages)
    print(f"OK: {len(res.files)} files of {repo_id} at commit {res.manifest.commit} verified "
          f"in {local_dir} ({res.fetched} fetched, {res.skipped} already complete)")


def register(app: typer.Typer) -> None:
    app.command("download")(download)
