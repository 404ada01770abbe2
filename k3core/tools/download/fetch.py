"""``k3 download REPO_ID DIR``: fetch a model at one pinned commit and prove it arrived whole.

1. Resolve ``--revision`` (default ``main``) to a 40-hex commit once; every file is fetched
   at that commit, so a branch moving mid-download cannot mix two versions.
2. Select files (``--allow-pattern``, fnmatch, repeatable; default everything).
3. Check free space first: the bytes still to fetch (files already complete are not
   counted) against ``shutil.disk_usage``; refuse with the shortfall before downloading.
4. Fetch each file into ``DIR`` (resumable: re-running skips finished files, resumes a
   partial one and fetches again a file left with the wrong size by an earlier run).
5. Verify (:mod:`k3core.tools.download.verify`), list every bad file, and record the commit in
   ``DIR/.k3-download.json``.

Exit codes: 2 for bad arguments (malformed repo id or revision, no file matching, an unknown
repository or revision), 1 for network/download failures, a lack of space or a failed
verification. Downloaded code (``tokenization_kimi.py``) is data: never imported, never run.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3core.api.errors import UsageError
from k3core.api.outputs import existing_parent
from k3core.api.units import human
from k3core.tools.download.hub import (
    DownloadError,
    HfHubClient,
    HubClient,
    RemoteFile,
    RepoManifest,
)
from k3core.tools.download.verify import VerifyReport, verify_download

REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$")
RECORD = ".k3-download.json"
DiskUsage = Callable[[str], Any]  # shutil.disk_usage's shape: .free


@dataclass
class DownloadResult:
    manifest: RepoManifest
    files: list[RemoteFile]
    fetched: int
    skipped: int
    report: VerifyReport


def check_args(repo_id: str, revision: str | None, patterns: list[str] | None) -> None:
    if not REPO_RE.match(repo_id) or ".." in repo_id or "--" in repo_id:
        raise UsageError(f"{repo_id!r} is not a Hugging Face repo id (like org/name)")
    if revision is not None and (not revision or len(revision) > 256
                                 or any(ch.isspace() or ord(ch) < 32 for ch in revision)):
        raise UsageError(f"--revision {revision!r} is not a branch, tag or commit")
    for p in patterns or []:
        if not p.strip():
            raise UsageError("--allow-pattern must not be empty")


def select(files: tuple[RemoteFile, ...], patterns: list[str] | None) -> list[RemoteFile]:
    if not patterns:
        return list(files)
    return [f for f in files if any(fnmatch.fnmatchcase(f.name, p) for p in patterns)]


def _complete(local_dir: Path, f: RemoteFile) -> bool:
    path = local_dir / f.name
    return f.size is not None and path.is_file() and path.stat().st_size == f.size


def check_free_space(local_dir: Path, files: list[RemoteFile],
                     disk_usage: DiskUsage = shutil.disk_usage) -> int:
    """Bytes still to fetch; ``DownloadError`` (exit 1) with the shortfall if they cannot fit."""
    need = sum(f.size or 0 for f in files if not _complete(local_dir, f))
    where = existing_parent(local_dir)
    free = int(disk_usage(str(where)).free)
    if need > free:
        raise DownloadError(
            f"not enough free space at {where}: {human(need)} still to download and {human(free)} "
            f"free, a shortfall of {human(need - free)} ({(need - free) / 1e12:.3f} TB); nothing "
            "was downloaded",
            hint="free some space or choose another DIR (packing the trunk later needs about "
                 "7 % more)")
    return need


def download(repo_id: str, local_dir: str | Path, *, revision: str | None = None,
             allow_patterns: list[str] | None = None, skip_checksum: bool = False,
             client: HubClient | None = None, disk_usage: DiskUsage = shutil.disk_usage,
             log: Callable[[str], None] = print,
             progress: Callable[[str, int, int], None] | None = None) -> DownloadResult:
    """Download and verify; raise ``DownloadError``/``UsageError`` on any problem.

    ``progress(stage, done, total)`` hears the bytes as they come: ``fetch`` (bytes fetched of
    those still to fetch), then ``verify`` (bytes hashed of those to hash)."""
    say = progress or (lambda stage, done, total: None)
    check_args(repo_id, revision, allow_patterns)
    root = Path(local_dir)
    if root.exists() and not root.is_dir():
        raise UsageError(f"{root} exists and is not a directory")
    hub = client or HfHubClient()
    rev = revision or "main"
    manifest = hub.manifest(repo_id, rev)
    log(f"{repo_id}@{rev} -> commit {manifest.commit} ({len(manifest.files)} files)")
    files = select(manifest.files, allow_patterns)
    if not manifest.files:
        raise DownloadError(f"{repo_id}@{manifest.commit} lists no files")
    if not files:
        raise UsageError(f"no file of {repo_id}@{manifest.commit[:12]} matches "
                         f"{', '.join(allow_patterns or [])}")
    unknown = [f.name for f in files if f.size is None]
    if unknown:
        log(f"note: the Hub published no size for {len(unknown)} file(s); they are not in "
            "the free-space check")
    need = check_free_space(root, files, disk_usage)
    total = sum(f.size or 0 for f in files)
    log(f"{len(files)} files, {human(total)}; {human(need)} still to download into {root}")
    root.mkdir(parents=True, exist_ok=True)
    fetched = skipped = 0
    got = [0]  # bytes fetched (or found resumed) so far

    def on_bytes(n: int) -> None:
        got[0] += n
        say("fetch", got[0], max(need, got[0]))

    if need:
        say("fetch", 0, need)
    for i, f in enumerate(files, 1):
        if _complete(root, f) and _recorded(root, manifest.commit):
            skipped += 1
            continue
        log(f"[{i}/{len(files)}] {f.name} ({human(f.size or 0)})")
        _discard_wrong_size(root, f, log)
        before = got[0]
        hub.fetch(repo_id, manifest.commit, f.name, root, on_bytes=on_bytes)
        if f.size is not None and got[0] != before + f.size:  # a file fetched whole at once
            got[0] = before + f.size
            say("fetch", got[0], max(need, got[0]))
        fetched += 1
    to_hash = 0 if skip_checksum else sum(f.size or 0 for f in files
                                          if f.sha256 is not None or f.blob_id is not None)
    hashed = [0]

    def on_hashed(n: int) -> None:
        hashed[0] += n
        say("verify", hashed[0], max(to_hash, hashed[0]))

    if to_hash:
        say("verify", 0, to_hash)
    log("verifying" + (" sizes (checksums skipped)" if skip_checksum else
                       " sizes and checksums (re-reads every file)"))
    report = verify_download(root, files, skip_checksum=skip_checksum,
                             all_files=list(manifest.files), on_bytes=on_hashed)
    for line in report.lines():
        log(line)
    if not report.ok:
        raise DownloadError(f"verification FAILED for {len(report.problems)} problem(s): "
                            + "; ".join(report.problems[:20])
                            + (" ..." if len(report.problems) > 20 else ""),
                            hint="delete the bad files and re-run the same command")
    _write_record(root, manifest, files, skip_checksum)
    return DownloadResult(manifest, files, fetched, skipped, report)


def _discard_wrong_size(root: Path, f: RemoteFile, log: Callable[[str], None]) -> None:
    """A finished file of the wrong size (a failed earlier run) is fetched again."""
    path = root / f.name
    if f.size is not None and path.is_file() and path.stat().st_size != f.size:
        log(f"  {f.name}: {path.stat().st_size} bytes on disk, {f.size} expected; fetching again")
        path.unlink()


def _recorded(root: Path, commit: str) -> bool:
    try:
        doc = json.loads((root / RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and doc.get("commit") == commit


def _write_record(root: Path, m: RepoManifest, files: list[RemoteFile], skipped: bool) -> None:
    doc = {"repo_id": m.repo_id, "commit": m.commit, "files": [f.name for f in files],
           "checksums_verified": not skipped}
    tmp = root / f"{RECORD}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(doc, indent=1), encoding="utf-8")
    os.replace(tmp, root / RECORD)
