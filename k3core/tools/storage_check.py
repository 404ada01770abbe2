"""``k3 backends --check-storage NAME MODEL_DIR [--trunk DIR]``: a storage backend's reads of a
real checkpoint, compared byte for byte with ``plain``'s.

So a user can trust a storage plugin on their own model and disk before a long run. The
shard headers are indexed through both backends (the same tensors at the same places must
come out); then every tensor of every shard, and with ``--trunk`` every layer's run of
``trunk.bin``, is read through the named backend the way the engine reads (into buffers at
the file offset's remainder modulo 4096, several reads in flight at once through
``read_many``, a large tensor in pieces of at most :data:`PIECE` bytes) and through
``plain``, one read at a time, and the two compared.

Each difference is named: what was read (the tensor, or the trunk layer), the file, the
offset, the length and the first differing byte; so is a read or an open the backend fails
(or answers with anything but a ``StorageError``) where ``plain`` succeeds. A read ``plain``
itself fails is the file's problem, not the backend's: a ``StorageError`` as in any run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from k3core.api.errors import CheckpointError, K3Error, StorageError, UsageError
from k3core.api.storage import StorageBackend, StorageFile, aligned_empty
from k3core.api.units import ALIGN, human
from k3core.checkpoint.index import CheckpointIndex
from k3core.model.config import load_config
from k3core.plugins.registry import get_registry
from k3core.run.model_dir import config_path
from k3core.trunk.manifest import open_trunk

REFERENCE = "plain"
#: the most bytes one read asks for (a larger tensor is read in pieces)
PIECE = 64 << 20
#: the most bytes read through the backend in one batch of concurrent reads
BATCH_BYTES = 64 << 20
#: reads in flight at once through the backend (``read_many``'s depth)
DEPTH = 4
#: differences described one by one (every one is counted)
MAX_SHOWN = 10


@dataclass(frozen=True)
class Piece:
    """One read: ``nbytes`` at ``offset`` of ``path``, part of ``what``."""

    what: str
    path: Path
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Problem:
    """Where the backend and ``plain`` part: the read, and what went wrong."""

    what: str
    path: Path
    offset: int
    nbytes: int
    detail: str

    def line(self) -> str:
        where = f"{self.path.name} [{self.offset}, {self.offset + self.nbytes})" if self.nbytes \
            else self.path.name
        return f"{self.what} ({where}): {self.detail}"

    def to_json(self) -> dict[str, Any]:
        return {"what": self.what, "path": str(self.path), "offset": self.offset,
                "nbytes": self.nbytes, "detail": self.detail}


@dataclass
class StorageCheck:
    """What :func:`check_storage` read and found."""

    storage: str
    model_dir: Path
    trunk_dir: Path | None
    files: int = 0
    tensors: int = 0
    layers: int = 0
    reads: int = 0
    nbytes: int = 0
    seconds: float = 0.0  # inside the backend's reads, by its own stats (summed over threads)
    reference_seconds: float = 0.0
    problems: list[Problem] = field(default_factory=list)
    differing: int = 0

    @property
    def ok(self) -> bool:
        return self.differing == 0

    def add(self, problem: Problem) -> None:
        self.differing += 1
        if len(self.problems) < MAX_SHOWN:
            self.problems.append(problem)

    def lines(self) -> list[str]:
        def rate(seconds: float) -> str:
            return f"{self.nbytes / seconds / 1e9:.2f} GB/s" if seconds > 0 else "-"

        out = [f"storage '{self.storage}' against '{REFERENCE}' on {self.model_dir}",
               f"  read      : {self.tensors} tensors in {self.files} files"
               + (f", {self.layers} trunk layers of {self.trunk_dir}" if self.trunk_dir else "")
               + f": {human(self.nbytes)} in {self.reads} reads",
               f"  speed     : {self.storage} {rate(self.seconds)}, {REFERENCE} "
               f"{rate(self.reference_seconds)} (per second inside its reads, by its "
               "stats; page cache included)"]
        out += [f"  DIFFERS   : {p.line()}" for p in self.problems]
        if self.differing > len(self.problems):
            out.append(f"  ... and {self.differing - len(self.problems)} more")
        out.append(f"result      : identical: every byte read through '{self.storage}' is what "
                   f"'{REFERENCE}' read" if self.ok else
                   f"result      : DIFFERENT: {self.differing} of {self.reads} reads")
        return out

    def to_json(self) -> dict[str, Any]:
        return {"storage": self.storage, "reference": REFERENCE, "model_dir": str(self.model_dir),
                "trunk_dir": None if self.trunk_dir is None else str(self.trunk_dir),
                "files": self.files, "tensors": self.tensors, "trunk_layers": self.layers,
                "reads": self.reads, "bytes": self.nbytes, "seconds": self.seconds,
                "reference_seconds": self.reference_seconds, "identical": self.ok,
                "differing": self.differing, "problems": [p.to_json() for p in self.problems]}

    def refusal(self) -> K3Error:
        first = self.problems[0].line() if self.problems else "?"
        return K3Error(f"storage backend '{self.storage}' differs from '{REFERENCE}' in "
                       f"{self.differing} of {self.reads} reads; first: {first}",
                       hint="do not run with it; report it to the plugin's authors")


def _backend(name: str) -> StorageBackend:
    backend, _, _ = get_registry().create("storage", name)
    return backend  # an unknown or unavailable name is a PluginError (exit 2), never a fallback


def _pieces(what: str, path: Path, offset: int, nbytes: int) -> Iterator[Piece]:
    if nbytes <= PIECE:
        yield Piece(what, path, offset, nbytes)
        return
    for start in range(0, nbytes, PIECE):
        n = min(PIECE, nbytes - start)
        yield Piece(f"{what} bytes [{start}, {start + n})", path, offset + start, n)


def _placed(p: Piece) -> np.ndarray:
    """A buffer for ``p`` at the file offset's remainder modulo 4096, as the engine places them."""
    skew = p.offset % ALIGN
    return aligned_empty(p.nbytes + skew, ALIGN)[skew:]


def _difference(got: np.ndarray, want: np.ndarray, offset: int) -> str | None:
    bad = np.flatnonzero(got != want)
    if not bad.size:
        return None
    i = int(bad[0])
    return (f"{bad.size} of {want.size} bytes differ; first at +{i} (file offset {offset + i}): "
            f"got 0x{int(got[i]):02x}, {REFERENCE} read 0x{int(want[i]):02x}")


def _batches(pieces: list[Piece]) -> Iterator[list[Piece]]:
    batch: list[Piece] = []
    size = 0
    for p in pieces:
        if batch and (size + p.nbytes > BATCH_BYTES or len(batch) >= 4 * DEPTH):
            yield batch
            batch, size = [], 0
        batch.append(p)
        size += p.nbytes
    if batch:
        yield batch


def _broke(exc: BaseException) -> str:
    return f"raised {type(exc).__name__}: {exc} (a backend raises StorageError or nothing)"


def _check_file(result: StorageCheck, backend: StorageBackend, reference: StorageBackend,
                path: Path, pieces: list[Piece]) -> None:
    ref = reference.open(path)
    try:
        try:
            mine: StorageFile = backend.open(path)
        except StorageError as exc:
            result.add(Problem("open", path, 0, 0, f"'{result.storage}' refused it: {exc.message}"))
            return
        except Exception as exc:
            result.add(Problem("open", path, 0, 0, _broke(exc)))
            return
        try:
            if mine.size != ref.size:
                result.add(Problem("open", path, 0, 0, f"size {mine.size}, {REFERENCE} says "
                                                        f"{ref.size}"))
                return
            for batch in _batches(pieces):
                _check_batch(result, mine, ref, batch)
        finally:
            mine.close()
    finally:
        ref.close()


def _check_batch(result: StorageCheck, mine: StorageFile, ref: StorageFile,
                 batch: list[Piece]) -> None:
    outs = [_placed(p) for p in batch]
    try:
        answers: list[StorageError | None] = mine.read_many(
            [(p.offset, out) for p, out in zip(batch, outs, strict=True)], depth=DEPTH)
    except Exception as exc:  # a backend bug: every read of the batch is suspect
        for p in batch:
            result.add(Problem(p.what, p.path, p.offset, p.nbytes, _broke(exc)))
        result.reads += len(batch)
        return
    for p, out, answer in zip(batch, outs, answers, strict=True):
        want = _placed(p)
        ref.read_into(p.offset, want)  # plain failing is the file's problem: StorageError
        result.reads += 1
        result.nbytes += p.nbytes
        if answer is not None:
            result.add(Problem(p.what, p.path, p.offset, p.nbytes,
                               f"'{result.storage}' failed a read {REFERENCE} completes: "
                               f"{answer.message}"))
            continue
        detail = _difference(out, want, p.offset)
        if detail:
            result.add(Problem(p.what, p.path, p.offset, p.nbytes, detail))


def _index_alike(result: StorageCheck, backend: StorageBackend, plain_index: CheckpointIndex) -> None:
    """Index the shards through the backend too: the same tensors at the same places."""
    try:
        index = CheckpointIndex.open(result.model_dir, backend)
    except (CheckpointError, StorageError) as exc:
        result.add(Problem("shard headers", result.model_dir, 0, 0,
                           f"indexing them through '{result.storage}' failed: {exc.message}"))
        return
    except Exception as exc:
        result.add(Problem("shard headers", result.model_dir, 0, 0, _broke(exc)))
        return
    try:
        if index.fingerprint() != plain_index.fingerprint() or index.tensors != plain_index.tensors:
            result.add(Problem("shard headers", result.model_dir, 0, 0,
                               f"read through '{result.storage}' they describe other tensors "
                               f"than read through '{REFERENCE}'"))
    finally:
        index.close()


def check_storage(name: str, model_dir: Path, trunk_dir: Path | None = None,
                  progress: Callable[[str], None] | None = None) -> StorageCheck:
    """Read ``model_dir`` (and ``trunk_dir``) through storage backend ``name`` and ``plain``;
    the result says what was read and every difference."""
    config_path(model_dir)  # a missing or model-less directory is refused plainly (exit 2)
    if trunk_dir is not None and not trunk_dir.exists():
        raise UsageError(f"--trunk {trunk_dir} does not exist")
    backend = _backend(name)
    reference = _backend(REFERENCE)
    result = StorageCheck(name, model_dir, trunk_dir)
    with CheckpointIndex.open(model_dir, reference) as index:
        _index_alike(result, backend, index)
        files: dict[Path, list[Piece]] = {p: [] for p in index.shards}
        for t in sorted(index.tensors.values(), key=lambda t: (str(t.path), t.offset)):
            files.setdefault(t.path, []).extend(_pieces(f"tensor {t.name}", t.path, t.offset,
                                                        t.nbytes))
        result.tensors = len(index.tensors)
        if trunk_dir is not None:
            man = open_trunk(trunk_dir, index, load_config(model_dir))
            files[man.bin_path] = [piece for lay in man.layers for piece in
                                   _pieces(f"trunk layer {lay.layer}", man.bin_path,
                                           lay.file_off, lay.disk_nbytes)]
            result.layers = man.n_layers
        seconds0, ref_seconds0 = backend.stats.snapshot()[1], reference.stats.snapshot()[1]
        for path, pieces in files.items():
            _check_file(result, backend, reference, path, pieces)
            result.seconds = backend.stats.snapshot()[1] - seconds0
            result.reference_seconds = reference.stats.snapshot()[1] - ref_seconds0
            result.files += 1
            if progress is not None:
                progress(f"checked {path.name}: {len(pieces)} reads, "
                         f"{human(sum(p.nbytes for p in pieces))}"
                         + ("" if result.ok else f" ({result.differing} differ so far)"))
    return result
