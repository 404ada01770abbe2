"""The prefix cache's disk: kept prompt-prefix states spilled to a directory, and found again.

``k3 serve --prefix-cache-dir DIR`` gives the prefix cache (:mod:`k3core.run.prefix_cache`)
a second tier. A state the memory budget evicts is written to ``DIR`` instead of dropped,
and a request whose prompt starts with a spilled prefix longer than any kept in memory reads
it back (into memory again) and feeds only the rest. The directory outlives the server: a
restarted server over the same directory starts with the system prompts and documents it had
kept.

**Files.** Each state is a session file (:mod:`k3core.run.state_file`: its ids, its arrays,
a checksum over every byte, and the model it belongs to: the architecture, the layers run
and a sample of the weights), named ``<sha256 of the ids>.k3prefix``, written atomically (a
temporary file, then a rename: complete or absent). At start the directory's ``*.k3prefix``
files are indexed from their checked headers alone; a file of another model or config, a
damaged one or one of another format is left where it is and not used (``foreign`` counts
them). A file that turns out damaged when it is read back is dropped from the index and the
request goes on as a miss. Nothing but ``*.k3prefix`` files this index holds is ever deleted.

**Budget.** ``--prefix-cache-disk-gb`` (default :data:`DEFAULT_DISK_GB`) bounds the bytes of
the files; the least recently used go first. A spill that fails (a full disk, a directory
that went away) is counted (``errors``) and the request goes on: the disk tier never fails a
request. A state kept with its last row's logits (a whole prompt's) is spilled with them, in
a file of its own beside the state's (``.k3logits``: a magic, the SHA-256 of the float32
bytes, the bytes), so the same prompt sent again starts from disk without a pass; a logits
file that is missing or does not check leaves the state usable as a prefix only.

**Bits.** A state read back holds the bytes written (the checksums say so), and a restored
state gives a fresh run's logits, as the memory tier does (``tests/serve/test_prefix_spill.py``).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from k3core.api.errors import K3Error, UsageError
from k3core.api.files import FileRejected, read_capped
from k3core.api.outputs import write_bytes_atomic
from k3core.model.state import SequenceState, StateSnapshot, restore, snapshot
from k3core.run.state_file import StateFileError, model_identity, read_ids, read_state, write_state

if TYPE_CHECKING:
    from k3core.run.binding import Bound

#: the disk tier's budget when ``--prefix-cache-disk-gb`` is not given
DEFAULT_DISK_GB = 4.0
SUFFIX = ".k3prefix"
LOGITS_SUFFIX = ".k3logits"
LOGITS_MAGIC = b"K3LOGIT1"


@dataclass
class SpillStats:
    spilled: int = 0  # states written
    loaded: int = 0  # states read back
    evicted: int = 0  # files removed to keep the budget
    foreign: int = 0  # files at start that are not this model's (left alone)
    errors: int = 0  # writes or reads that failed (the request went on)


class PrefixSpill:
    """Spilled states of one engine's model in ``directory``, at most ``budget`` bytes."""

    def __init__(self, directory: Path, engine: Bound, budget: int):
        self.dir = directory
        self.engine = engine
        self.budget = max(0, int(budget))
        self.stats = SpillStats()
        self._identity = model_identity(engine)
        self._lock = threading.Lock()
        #: ids -> (file, bytes), least recently used first
        self._files: OrderedDict[tuple[int, ...], tuple[Path, int]] = OrderedDict()
        self._bytes = 0
        self._index()

    @staticmethod
    def check_dir(directory: Path) -> Path:
        """``directory`` made if missing and checked writable (a refusal: UsageError, exit 2),
        before the model opens."""
        if directory.exists() and not directory.is_dir():
            raise UsageError(f"--prefix-cache-dir {directory}: not a directory")
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"--prefix-cache-dir {directory}: cannot create it "
                             f"({exc.strerror or exc})") from None
        if not os.access(directory, os.W_OK | os.X_OK):
            raise UsageError(f"--prefix-cache-dir {directory}: not writable")
        return directory

    def _index(self) -> None:
        found: list[tuple[float, tuple[int, ...], Path, int]] = []
        for path in self.dir.glob(f"*{SUFFIX}"):
            try:
                if not path.is_file():
                    continue
                ids = tuple(read_ids(path, self.engine, self._identity))
                st = path.stat()
            except (StateFileError, OSError):
                self.stats.foreign += 1
                continue
            if ids and path.name == _name(ids):
                lp = _logits_path(path)
                size = st.st_size + (lp.stat().st_size if lp.is_file() else 0)
                found.append((st.st_mtime, ids, path, size))
            else:
                self.stats.foreign += 1
        for _, ids, path, size in sorted(found):  # oldest first: the LRU order
            self._files[ids] = (path, size)
            self._bytes += size
        self._shrink()

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._files)

    def best(self, key: tuple[int, ...], leave: int = 1) -> int:
        """The length of the longest spilled prefix of ``key`` leaving ``leave`` ids (0: none)."""
        with self._lock:
            return max((len(k) for k in self._files
                        if len(k) <= len(key) - leave and key[: len(k)] == k), default=0)

    def put(self, ids: Sequence[int], snap: StateSnapshot,
            logits: np.ndarray | None = None) -> bool:
        """Write ``snap`` (the state after ``ids``), and its last row's ``logits`` when given,
        to the directory; False when it does not fit the budget or the write failed
        (counted)."""
        key = tuple(int(i) for i in ids)
        if not key or self.budget <= 0:
            return False
        path = self.dir / _name(key)
        with self._lock:
            have = self._files.get(key)
            if have is not None:
                self._files.move_to_end(key)
        need_logits = logits is not None and not _logits_path(path).is_file()
        if have is not None and not need_logits:
            return True
        size, ok = 0 if have is None else have[1], True
        try:
            if have is None:  # the state (a state spilled before keeps its file)
                state = SequenceState(self.engine.cfg, max(1, snap.pos))
                restore(state, snap)
                size = write_state(path, self.engine, list(key), state)
            if need_logits:
                raw = np.ascontiguousarray(logits, dtype="<f4").tobytes()
                blob = LOGITS_MAGIC + hashlib.sha256(raw).digest() + raw
                write_bytes_atomic(_logits_path(path), blob, "the prefix logits")
                size += len(blob)
        except (K3Error, OSError):
            self.stats.errors += 1
            ok = False
        if not size:  # nothing written
            return False
        with self._lock:  # a state written stays indexed (within the budget) even if its logits failed
            old = self._files.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._files[key] = (path, size)
            self._bytes += size
            self.stats.spilled += have is None
            self._shrink()
            return ok and key in self._files

    def load_logits(self, ids: tuple[int, ...]) -> np.ndarray | None:
        """The last row's logits spilled with the state after ``ids``, checked, or ``None``."""
        with self._lock:
            got = self._files.get(ids)
        if got is None:
            return None
        try:
            blob = read_capped(_logits_path(got[0]), 8 + 32 + 4 * self.engine.cfg.vocab)
        except FileRejected:  # missing, or over the size a vocabulary's logits take
            return None
        raw = blob[40:]
        if (blob[:8] != LOGITS_MAGIC or len(raw) != 4 * self.engine.cfg.vocab
                or hashlib.sha256(raw).digest() != blob[8:40]):
            self.stats.errors += 1
            return None
        return np.frombuffer(raw, dtype="<f4").astype(np.float32)

    def load(self, ids: tuple[int, ...]) -> StateSnapshot | None:
        """The state spilled after exactly ``ids``, read back and checked, or ``None`` (not
        spilled, or its file is gone or damaged: dropped from the index)."""
        with self._lock:
            got = self._files.get(ids)
            if got is None:
                return None
            self._files.move_to_end(ids)
        path = got[0]
        try:
            saved, state = read_state(path, self.engine)
        except StateFileError:
            saved, state = [], None
        if state is None or tuple(saved[: state.pos]) != ids or state.pos != len(ids):
            self.stats.errors += 1
            with self._lock:
                if self._files.pop(ids, None) is not None:
                    self._bytes -= got[1]
            return None
        self.stats.loaded += 1
        return snapshot(state)

    def _shrink(self) -> None:
        """Remove the least recently used files until the budget holds (the lock held)."""
        while self._bytes > self.budget and self._files:
            _, (path, size) = self._files.popitem(last=False)
            self._bytes -= size
            self.stats.evicted += 1
            try:
                path.unlink()
                _logits_path(path).unlink(missing_ok=True)
            except OSError:
                self.stats.errors += 1

    def to_json(self) -> dict[str, int | str]:
        s = self.stats
        return {"dir": str(self.dir), "files": len(self), "bytes": self._bytes,
                "budget": self.budget, "spilled": s.spilled, "loaded": s.loaded,
                "evicted": s.evicted, "foreign": s.foreign, "errors": s.errors}


def _logits_path(path: Path) -> Path:
    """Where the logits spilled with the state at ``path`` are."""
    return path.with_suffix(LOGITS_SUFFIX)


def _name(ids: Sequence[int]) -> str:
    """A spilled state's file name: the SHA-256 of its ids."""
    raw = b"".join(int(i).to_bytes(8, "little") for i in ids)
    return hashlib.sha256(raw).hexdigest() + SUFFIX
