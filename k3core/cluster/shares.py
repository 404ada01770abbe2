"""Expert shares on disk: what ``k3 shard-experts`` writes, and the check a worker makes.

``k3 shard-experts MODEL_DIR OUT_DIR --workers N`` (:mod:`k3core.cluster.share_writer`)
writes ``OUT_DIR/head/`` (every tensor but the routed experts) and ``OUT_DIR/worker-i/``
(worker i's routed experts under the plan of :mod:`k3core.cluster.plan`), each in the
released layout. Two manifests tie them together:

* ``head/expert-shares.json`` (:data:`HEAD_MANIFEST`): the model's identity (its headers'
  fingerprint and the checksum of every file written, so two models of one shape differ:
  :func:`k3core.cluster.share_writer.model_identity`), the plan and its fingerprint
  (:meth:`SharePlan.fingerprint`), and every share's files with their sizes and checksums;
* ``worker-i/share.json`` (:data:`SHARE_MANIFEST`): the same model and plan fingerprints,
  the worker's number and the worker count, and its own files.

Before the first token every worker checks its share against the head's record
(:func:`verify_share`): the manifest must name the same model, the same plan, this worker
of this many, the same files; every file must be there with its size and its checksum (the
whole file's SHA-256 while the share is at most ``FULL_HASH_LIMIT`` bytes; above it the
header and the first and last 4 KiB of every tensor, as the share check of a whole
checkpoint does). Any difference is refused with exit 1, naming the file; a share directory
that is not there at all is a missing input (exit 2). A worker reads
``$K3_EXPERT_SHARES/worker-i`` when its node sets :data:`SHARES_ENV`, else the head's
``--expert-shares DIR/worker-i``.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3core.api.errors import CheckpointError, UsageError
from k3core.api.files import FileRejected, read_capped
from k3core.api.safejson import JSONRejected, parse_json
from k3core.checkpoint.safetensors_header import header_length, parse_header
from k3core.cluster.plan import SharePlan
from k3core.cluster.share import FULL_HASH_LIMIT, SAMPLE

HEAD_MANIFEST = "expert-shares.json"
SHARE_MANIFEST = "share.json"
HEAD_NAME = "head"
#: a node's own directory of shares (``worker-i`` below it), read by the workers it runs
SHARES_ENV = "K3_EXPERT_SHARES"
FORMAT = "k3-expert-shares"
VERSION = 1
MAX_MANIFEST_BYTES = 64_000_000
CHUNK = 1 << 24


def worker_name(worker: int) -> str:
    return f"worker-{worker}"


@dataclass(frozen=True)
class FileSum:
    """One file of a share: its size, its SHA-256, and the sampled digest (:func:`sampled`)."""

    nbytes: int
    sha256: str
    sampled: str

    def to_json(self) -> dict[str, Any]:
        return {"bytes": self.nbytes, "sha256": self.sha256, "sampled": self.sampled}

    @classmethod
    def from_json(cls, d: Any) -> FileSum:
        return cls(int(d["bytes"]), str(d["sha256"]), str(d["sampled"]))


@dataclass(frozen=True)
class ShareRecord:
    """What one share holds (both manifests carry it)."""

    worker: int
    experts: int
    nbytes: int  # the routed experts' bytes
    files: dict[str, FileSum]

    @property
    def file_bytes(self) -> int:
        return sum(f.nbytes for f in self.files.values())

    def to_json(self) -> dict[str, Any]:
        return {"worker": self.worker, "experts": self.experts, "expert_bytes": self.nbytes,
                "files": {n: f.to_json() for n, f in sorted(self.files.items())}}

    @classmethod
    def from_json(cls, d: Any) -> ShareRecord:
        return cls(int(d["worker"]), int(d["experts"]), int(d["expert_bytes"]),
                   {str(n): FileSum.from_json(f) for n, f in d["files"].items()})


@dataclass(frozen=True)
class ShareExpectation:
    """What the head expects of worker ``worker``'s share (sent to the worker to check)."""

    model: str
    plan: str
    workers: int
    record: ShareRecord

    @property
    def worker(self) -> int:
        return self.record.worker


@dataclass(frozen=True)
class HeadManifest:
    """``head/expert-shares.json``: the model, the plan and every share (see the module)."""

    model: str
    plan_fingerprint: str
    plan: SharePlan
    shares: list[ShareRecord]
    head: ShareRecord  # the head's own files (worker -1, no experts)

    @property
    def workers(self) -> int:
        return self.plan.n_workers

    def expect(self, worker: int) -> ShareExpectation:
        return ShareExpectation(self.model, self.plan_fingerprint, self.workers,
                                self.shares[worker])

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "model": self.model,
                "plan_fingerprint": self.plan_fingerprint, "workers": self.workers,
                "plan": self.plan.to_json(), "head": self.head.to_json(),
                "shares": [s.to_json() for s in self.shares]}


def share_manifest(expect: ShareExpectation) -> dict[str, Any]:
    """The body of ``worker-i/share.json``."""
    return {"format": FORMAT, "version": VERSION, "model": expect.model,
            "plan_fingerprint": expect.plan, "workers": expect.workers,
            **expect.record.to_json()}


def _load(path: Path, what: str) -> dict[str, Any]:
    try:
        d = parse_json(read_capped(path, MAX_MANIFEST_BYTES))
    except FileRejected as exc:
        raise CheckpointError(f"{path}: cannot read {what}: {exc}") from None
    except JSONRejected as exc:
        raise CheckpointError(f"{path}: {what} is not valid JSON: {exc}") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not {what} written by k3 shard-experts")
    if d.get("version") != VERSION:
        raise CheckpointError(f"{path}: {what} of format version {d.get('version')!r}; this k3 "
                              f"reads version {VERSION} (run k3 shard-experts again)")
    return d


def is_head(model_dir: Path) -> bool:
    """Whether ``model_dir`` is a head written by ``k3 shard-experts``."""
    return (Path(model_dir) / HEAD_MANIFEST).is_file()


def read_head_manifest(model_dir: Path) -> HeadManifest:
    """The head's manifest; ``CheckpointError`` (exit 1) naming the file when it is damaged."""
    path = Path(model_dir) / HEAD_MANIFEST
    d = _load(path, "the head's expert-share manifest")
    try:
        plan = SharePlan.from_json(d["plan"], str(path))
        shares = [ShareRecord.from_json(s) for s in d["shares"]]
        head = ShareRecord.from_json(d["head"])
        man = HeadManifest(str(d["model"]), str(d["plan_fingerprint"]), plan, shares, head)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{path}: the head's expert-share manifest is malformed "
                              f"({exc!r})") from None
    if len(shares) != plan.n_workers or [s.worker for s in shares] != list(range(plan.n_workers)):
        raise CheckpointError(f"{path}: lists {len(shares)} shares for {plan.n_workers} workers")
    if plan.fingerprint(man.model) != man.plan_fingerprint:
        raise CheckpointError(f"{path}: the plan does not match its fingerprint; the manifest "
                              "was edited or damaged")
    return man


def share_root(given: str | None) -> str | None:
    """The directory of shares on this node: ``$K3_EXPERT_SHARES`` when set, else ``given``."""
    return os.environ.get(SHARES_ENV) or given


# ---- checksums -------------------------------------------------------------------------------
def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sampled(path: Path) -> str:
    """SHA-256 of the file's size, its header and the first and last ``SAMPLE`` bytes of
    every tensor (the whole tensor when it is at most twice that): what a share above
    ``FULL_HASH_LIMIT`` is checked by. A file that is not a safetensors shard is hashed
    whole."""
    size = path.stat().st_size
    h = hashlib.sha256(size.to_bytes(8, "little"))
    if path.suffix != ".safetensors":
        h.update(bytes.fromhex(sha256_file(path)))
        return h.hexdigest()
    with open(path, "rb") as f:
        prefix = f.read(8)
        n = header_length(prefix, size, path)
        raw = f.read(n)
        h.update(prefix + raw)
        for e in parse_header(raw, size - 8 - n, path):
            begin, nbytes = 8 + n + e.begin, e.end - e.begin
            spans = ([(begin, nbytes)] if nbytes <= 2 * SAMPLE else
                     [(begin, SAMPLE), (begin + nbytes - SAMPLE, SAMPLE)])
            for off, k in spans:
                h.update(os.pread(f.fileno(), k, off))
    return h.hexdigest()


def file_sum(path: Path, sha: str | None = None) -> FileSum:
    """``path``'s :class:`FileSum` (``sha``: its SHA-256 when the writer already has it)."""
    return FileSum(path.stat().st_size, sha or sha256_file(path), sampled(path))


# ---- a worker's check ------------------------------------------------------------------------
@dataclass(frozen=True)
class VerifiedShare:
    directory: str
    mode: str  # "full" or "sampled"
    nbytes: int  # the bytes checked


def verify_share(directory: Path, expect: ShareExpectation) -> VerifiedShare:
    """Check ``directory`` (a ``worker-i`` share) against the head's ``expect`` (module doc)."""
    d = Path(directory)
    if not d.is_dir():
        raise UsageError(f"share {d} does not exist on this node",
                         hint=f"copy OUT_DIR/{worker_name(expect.worker)} of k3 shard-experts "
                              f"there, or set {SHARES_ENV} on the node to the directory that "
                              "holds it")
    path = d / SHARE_MANIFEST
    if not path.is_file():
        raise CheckpointError(f"share {d}: {path.name} is missing; not a share written by "
                              "k3 shard-experts")
    m = _load(path, "a share manifest")
    where = f"share {d}: {path.name}"
    if m.get("workers") != expect.workers or m.get("worker") != expect.worker:
        raise CheckpointError(f"{where} is the share of worker {m.get('worker')!r} of "
                              f"{m.get('workers')!r}; this run needs worker {expect.worker} of "
                              f"{expect.workers}",
                              hint="shard the model again for this many workers, or run with "
                                   "the worker count the shares were written for")
    if m.get("model") != expect.model:
        raise CheckpointError(f"{where} is of another model than the head's (model "
                              f"{str(m.get('model'))[:12]}, the head's {expect.model[:12]})",
                              hint="give every worker the share written with this head")
    if m.get("plan_fingerprint") != expect.plan:
        raise CheckpointError(f"{where} was written under another expert plan than the head's")
    try:
        record = ShareRecord.from_json(m)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{where} is malformed ({exc!r})") from None
    want = expect.record.files
    for name in sorted(set(want) | set(record.files)):
        if record.files.get(name) != want.get(name):
            raise CheckpointError(f"{where} lists file {name} other than the head's record does")
    full = expect.record.file_bytes <= FULL_HASH_LIMIT
    for name, s in sorted(want.items()):
        f = d / name
        if not f.is_file():
            raise CheckpointError(f"share {d}: file {name} is missing")
        size = f.stat().st_size
        if size != s.nbytes:
            raise CheckpointError(f"share {d}: file {name} is {size} bytes, the manifest says "
                                  f"{s.nbytes}; the file is damaged")
        try:
            got = sha256_file(f) if full else sampled(f)
        except (OSError, CheckpointError) as exc:
            raise CheckpointError(f"share {d}: file {name} cannot be checked: {exc}") from None
        if got != (s.sha256 if full else s.sampled):
            raise CheckpointError(f"share {d}: file {name} is damaged (its "
                                  f"{'SHA-256' if full else 'sampled checksum'} differs from "
                                  "the manifest's)",
                                  hint="copy the share again from the output of k3 shard-experts")
    return VerifiedShare(str(d), "full" if full else "sampled", expect.record.file_bytes)


def write_manifest(path: Path, body: dict[str, Any]) -> None:
    """A manifest into a directory being written (renamed into place with it)."""
    path.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")


def refuse_head_alone(model_dir: Path) -> None:
    """A head written by ``k3 shard-experts`` run without workers: refused (exit 2)."""
    if is_head(Path(model_dir)):
        raise UsageError(f"{model_dir} is the head of a sharded checkpoint (k3 shard-experts): "
                         "it holds no routed expert",
                         hint="run it with --expert-workers N --expert-shares DIR (docs/cluster.md)")
