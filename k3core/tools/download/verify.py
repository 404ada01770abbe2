"""Verify a downloaded model directory against the Hub's manifest for one commit.

A partial download does not fail loudly: it produces wrong tokens. So every check that can
be made is made, and every bad file is listed (re-fetching one shard beats 1.56 TB):
each file's size; the SHA-256 the Hub publishes for LFS files and the git blob id for the
others (hashed in 8 MiB chunks; ``skip_checksum`` skips both); the shard count from
``model.safetensors.index.json``'s ``weight_map``; the total byte count.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from k3core.api.safejson import JSONRejected, parse_json
from k3core.api.units import human
from k3core.checkpoint.index import INDEX_NAME
from k3core.tools.download.hub import RemoteFile

CHUNK = 8 << 20


@dataclass
class VerifyReport:
    files: int = 0
    hashed: int = 0
    expected_bytes: int = 0
    found_bytes: int = 0
    shards_expected: int | None = None
    shards_found: int | None = None
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def lines(self) -> list[str]:
        delta = self.found_bytes - self.expected_bytes
        out = [f"files: {self.files} checked, {self.hashed} hashed",
               f"bytes: {self.found_bytes} of {self.expected_bytes} expected ({human(self.found_bytes)}"
               f"; delta {delta:+d})"]
        if self.shards_expected is not None:
            out.append(f"shards: {self.shards_found} of {self.shards_expected} named in {INDEX_NAME}")
        out += [f"note: {n}" for n in self.notes]
        out += [f"BAD: {p}" for p in self.problems]
        return out


def file_digest(path: Path, algo: str, prefix: bytes = b"",
                on_bytes: Callable[[int], None] | None = None) -> str:
    h = hashlib.new(algo)
    h.update(prefix)
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            h.update(chunk)
            if on_bytes is not None:
                on_bytes(len(chunk))
    return h.hexdigest()


def git_blob_id(path: Path, on_bytes: Callable[[int], None] | None = None) -> str:
    """The git blob SHA-1 of a file (how the Hub identifies non-LFS files)."""
    return file_digest(path, "sha1", f"blob {path.stat().st_size}\0".encode(), on_bytes)


def verify_download(local_dir: Path, files: list[RemoteFile], *, skip_checksum: bool = False,
                    all_files: list[RemoteFile] | None = None,
                    progress: Callable[[str], None] | None = None,
                    on_bytes: Callable[[int], None] | None = None) -> VerifyReport:
    """Check ``files`` under ``local_dir``; ``all_files`` is the whole manifest (shard check).
    ``progress(name)`` hears each file as its hash starts, ``on_bytes(n)`` the bytes hashed."""
    rep = VerifyReport()
    for f in files:
        rep.files += 1
        path = local_dir / f.name
        if f.size is not None:
            rep.expected_bytes += f.size
        if not path.is_file():
            rep.problems.append(f"{f.name}: missing")
            continue
        size = path.stat().st_size
        rep.found_bytes += size
        if f.size is not None and size != f.size:
            rep.problems.append(f"{f.name}: {size} bytes, the Hub says {f.size} "
                                f"({size - f.size:+d})")
            continue
        if skip_checksum or (f.sha256 is None and f.blob_id is None):
            continue
        if progress:
            progress(f.name)
        rep.hashed += 1
        if f.sha256 is not None:
            got = file_digest(path, "sha256", on_bytes=on_bytes)
            if got != f.sha256:
                rep.problems.append(f"{f.name}: sha256 {got} does not match the published "
                                    f"{f.sha256}")
        elif f.blob_id is not None and (got := git_blob_id(path, on_bytes)) != f.blob_id:
            rep.problems.append(f"{f.name}: git blob id {got} does not match the published "
                                f"{f.blob_id}")
    if skip_checksum:
        rep.notes.append("checksums skipped (--skip-checksum): sizes only")
    _check_shards(local_dir, files, all_files or files, rep)
    return rep


def _check_shards(local_dir: Path, files: list[RemoteFile], all_files: list[RemoteFile],
                  rep: VerifyReport) -> None:
    index = local_dir / INDEX_NAME
    if not any(f.name == INDEX_NAME for f in files) or not index.is_file():
        return
    try:
        doc = parse_json(index.read_bytes())
    except (OSError, JSONRejected) as exc:
        rep.problems.append(f"{INDEX_NAME}: cannot be read: {exc}")
        return
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        rep.problems.append(f"{INDEX_NAME}: has no usable weight_map")
        return
    named = set(wm.values())
    in_repo = {f.name for f in all_files}
    selected = {f.name for f in files}
    for shard in sorted(named - in_repo):
        rep.problems.append(f"{INDEX_NAME} names shard {shard}, which the repository does not have")
    if not named <= selected:
        rep.notes.append(f"shard count not checked: the selection leaves out "
                         f"{len(named - selected)} of the {len(named)} shards")
        return
    rep.shards_expected = len(named)
    rep.shards_found = sum(1 for s in named if (local_dir / s).is_file())
    if rep.shards_found != rep.shards_expected:
        rep.problems.append(f"{rep.shards_found} of {rep.shards_expected} shards present")
