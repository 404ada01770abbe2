"""Expert-request traces: ``expert_trace.bin`` and ``expert_hist.json`` (``--dump-cache-trace``).

Format (the reference engine's, so traces move between engines; docs/engine-behaviours.md §8):

``expert_trace.bin``
    Every expert request in order, recorded before the request is served (so it reflects
    what the model asked for, not the cache state), prefill and decode alike; prefetch and
    speculative reads are not requests and are not recorded. A flat sequence of
    little-endian int32 pairs ``(layer, expert)``, no header, 8 bytes per request (the
    reference writes host order; every machine k3 targets is little-endian, and k3 writes
    little-endian explicitly).
``expert_hist.json``
    ``{"n_layers": L, "n_experts": E, "counts": {"layer,expert": count, ...}}``: the request
    count of every expert over the whole run, zero entries omitted.

``expert_trace.bin.gz``
    A trace may be read gzipped (``gzip -9n expert_trace.bin``: the same bytes, compressed;
    routing traces shrink 10-50x), told apart by the gzip magic ``1f 8b``, which no trace
    can start with (it would be a layer over 35,000). k3 writes traces uncompressed; the
    test fixtures are kept compressed.
``expert_guess.bin``
    Only when the run made router-lookahead guesses: the guesses, a versioned sidecar
    (:mod:`k3core.experts.guess_trace`); the two files above keep the reference's format.

The files are written to partial names in the target directory (:mod:`k3core.api.partials`)
and renamed only when all are complete, so a reader never sees half a trace (and a full disk
leaves none). Reading refuses, with one line and exit 2
(:class:`TraceError`), anything that is not a plausible trace: a missing or empty file, an
odd number of int32 values, negative or out-of-range layers or experts, or a file larger
than :data:`MAX_TRACE_BYTES` (a gzipped one: once decompressed), or a gzipped file that does
not decompress.
"""

from __future__ import annotations

import errno
import gzip
import json
import os
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from k3core.api.cache_policy import KEY_SHIFT, key_expert, key_layer
from k3core.api.errors import OutputError, UsageError
from k3core.api.outputs import stage_bytes
from k3core.api.partials import Partials, space_note, sweep_stale
from k3core.experts.guess_trace import GUESS_NAME, guess_bytes

TRACE_NAME = "expert_trace.bin"
HIST_NAME = "expert_hist.json"
MAX_TRACE_BYTES = 10**9  # 1 GB: 125 M requests, ~85,000 tokens of the real model
_DTYPE = np.dtype("<i4")
_GZIP_MAGIC = b"\x1f\x8b"


class TraceError(UsageError):
    """A trace file that cannot be used (exit 2)."""


# ---- reading --------------------------------------------------------------------------
def read_trace(
    path: str | os.PathLike[str],
    n_layers: int | None = None,
    n_experts: int | None = None,
) -> np.ndarray:
    """Read ``expert_trace.bin`` as an ``(N, 2)`` int32 array of ``(layer, expert)``.

    ``n_layers``/``n_experts`` bound the values when given: layers must lie in
    ``0..n_layers`` (the one-based MoE layer numbers; 0 is allowed for engines that count
    from zero) and experts in ``0..n_experts-1``. Without them only the key range
    (``expert < 2**20``, ``layer < 2**11``) is enforced.
    """
    p = Path(path)
    try:
        size = p.stat().st_size
    except FileNotFoundError:
        raise TraceError(f"trace {p}: no such file") from None
    except OSError as exc:
        raise TraceError(f"trace {p}: cannot read it ({exc.strerror or exc})") from None
    if p.is_dir():
        raise TraceError(f"trace {p}: is a directory, expected an {TRACE_NAME} file")
    if size == 0:
        raise TraceError(f"trace {p}: the file is empty (no requests)")
    if size > MAX_TRACE_BYTES:
        raise TraceError(
            f"trace {p}: {size:,} bytes is larger than the {MAX_TRACE_BYTES:,}-byte limit "
            f"for a trace; is this really an {TRACE_NAME}?"
        )
    try:
        with open(p, "rb") as f:
            zipped = f.read(2) == _GZIP_MAGIC
    except OSError as exc:
        raise TraceError(f"trace {p}: cannot read it ({exc.strerror or exc})") from None
    if zipped:
        return _pairs(_gunzip(p), n_layers, n_experts, f"trace {p}")
    if size % 4:
        raise TraceError(f"trace {p}: {size} bytes is not a whole number of int32 values")
    try:
        raw = np.fromfile(p, dtype=_DTYPE)
    except OSError as exc:
        raise TraceError(f"trace {p}: cannot read it ({exc})") from None
    return validate_pairs(raw, n_layers, n_experts, where=f"trace {p}")


def _gunzip(p: Path) -> bytes:
    """A gzipped trace's bytes, at most :data:`MAX_TRACE_BYTES` of them."""
    try:
        with gzip.open(p, "rb") as f:
            data = f.read(MAX_TRACE_BYTES + 1)
    except (OSError, EOFError, zlib.error) as exc:
        raise TraceError(f"trace {p}: a gzipped file that does not decompress ({exc})") from None
    if len(data) > MAX_TRACE_BYTES:
        raise TraceError(f"trace {p}: decompresses to more than the {MAX_TRACE_BYTES:,}-byte "
                         "limit for a trace")
    return data


def _pairs(data: bytes, n_layers: int | None, n_experts: int | None, where: str) -> np.ndarray:
    if len(data) == 0:
        raise TraceError(f"{where}: the data is empty (no requests)")
    if len(data) % 4:
        raise TraceError(f"{where}: {len(data)} bytes is not a whole number of int32 values")
    return validate_pairs(np.frombuffer(data, dtype=_DTYPE), n_layers, n_experts, where=where)


def parse_trace_bytes(
    data: bytes, n_layers: int | None = None, n_experts: int | None = None
) -> np.ndarray:
    """:func:`read_trace` for bytes already in memory (same checks, same errors)."""
    if len(data) > MAX_TRACE_BYTES:
        raise TraceError(f"trace: {len(data):,} bytes is over the {MAX_TRACE_BYTES:,}-byte limit")
    return _pairs(data, n_layers, n_experts, "trace")


def validate_pairs(
    raw: np.ndarray, n_layers: int | None, n_experts: int | None, *, where: str = "trace"
) -> np.ndarray:
    """Check a flat integer array of pairs and return it as ``(N, 2)`` native int32."""
    if raw.size == 0:
        raise TraceError(f"{where}: no requests")
    if raw.size % 2:
        raise TraceError(
            f"{where}: {raw.size} int32 values is an odd count; a trace holds (layer, expert) pairs"
        )
    flat = np.asarray(raw)
    if not np.issubdtype(flat.dtype, np.integer):
        raise TraceError(f"{where}: expected integers, got {flat.dtype}")
    pairs = flat.reshape(-1, 2)
    layers, experts = pairs[:, 0], pairs[:, 1]
    max_layer = (1 << (31 - KEY_SHIFT)) - 1 if n_layers is None else int(n_layers)
    max_expert = (1 << KEY_SHIFT) - 1 if n_experts is None else int(n_experts) - 1
    for name, col, hi in (("layer", layers, max_layer), ("expert", experts, max_expert)):
        bad = np.flatnonzero((col < 0) | (col > hi))
        if bad.size:
            i = int(bad[0])
            raise TraceError(
                f"{where}: request {i} has {name} {int(col[i])}, outside 0..{hi} "
                f"({bad.size} such request(s)); is this a trace of this model?"
            )
    pairs = pairs.astype(np.int32, copy=True)
    return pairs


def trace_keys(pairs: np.ndarray) -> np.ndarray:
    """Cache keys (``layer << 20 | expert``) of an ``(N, 2)`` trace, as int64."""
    pairs = np.asarray(pairs)
    return (pairs[:, 0].astype(np.int64) << KEY_SHIFT) | pairs[:, 1].astype(np.int64)


def read_hist(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read ``expert_hist.json``; returns ``{"n_layers", "n_experts", "counts": {(l, e): n}}``."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TraceError(f"histogram {p}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TraceError(f"histogram {p}: not a readable JSON file ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("counts"), dict):
        raise TraceError(f"histogram {p}: expected an object with a 'counts' map")
    try:
        nl, ne = int(doc["n_layers"]), int(doc["n_experts"])
        counts: dict[tuple[int, int], int] = {}
        for k, v in doc["counts"].items():
            ls, es = str(k).split(",")
            layer, expert, n = int(ls), int(es), int(v)
            if not (0 <= layer <= nl and 0 <= expert < ne and n > 0):
                raise ValueError(f"entry {k!r}: {v!r}")
            counts[(layer, expert)] = n
    except (KeyError, TypeError, ValueError) as exc:
        raise TraceError(f"histogram {p}: malformed ({exc})") from None
    return {"n_layers": nl, "n_experts": ne, "counts": counts}


# ---- writing --------------------------------------------------------------------------
def histogram(pairs: np.ndarray) -> dict[tuple[int, int], int]:
    """Request count per ``(layer, expert)`` of a trace."""
    keys, counts = np.unique(trace_keys(pairs), return_counts=True)
    return {(key_layer(int(k)), key_expert(int(k))): int(c)
            for k, c in zip(keys, counts, strict=True)}


def write_trace(
    directory: str | os.PathLike[str],
    pairs: Any,
    hist: Mapping[tuple[int, int], int] | None = None,
    *,
    n_layers: int | None = None,
    n_experts: int | None = None,
    guesses: np.ndarray | None = None,
) -> tuple[Path, Path]:
    """Write ``expert_trace.bin`` and ``expert_hist.json`` into an existing ``directory``.

    With ``guesses`` (``(M, 3)`` ``(at, layer, expert)`` rows of the router lookahead) the
    sidecar ``expert_guess.bin`` (:mod:`k3core.experts.guess_trace`) is written with them;
    without, a sidecar left there by an earlier trace is removed (it would describe another
    trace).

    ``pairs`` is an ``(N, 2)`` array-like of ``(layer, expert)`` in request order; ``hist``
    the per-expert request counts (computed from ``pairs`` when omitted; the engine passes
    its own whole-run histogram). ``n_layers``/``n_experts`` default to the largest layer seen
    and the largest expert + 1. Each file appears complete or not at all; any failure is an
    :class:`~k3core.api.errors.OutputError` (exit 3). Returns the two paths.
    """
    d = Path(directory)
    if not d.is_dir():
        raise OutputError(f"cannot write the cache trace: {d} is not an existing directory")
    arr = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.int32).max):
        raise OutputError("cannot write the cache trace: a layer or expert is outside int32")
    if hist is None:
        hist = histogram(arr) if arr.size else {}
    nl = int(n_layers) if n_layers is not None else int(arr[:, 0].max(initial=0))
    ne = int(n_experts) if n_experts is not None else int(arr[:, 1].max(initial=-1)) + 1
    doc = {
        "n_layers": nl,
        "n_experts": ne,
        "counts": {f"{layer},{expert}": int(n) for (layer, expert), n in sorted(hist.items()) if n},
    }
    trace_path, hist_path, guess_path = d / TRACE_NAME, d / HIST_NAME, d / GUESS_NAME
    hist_bytes = (json.dumps(doc, separators=(",", ":")) + "\n").encode()
    finals = [trace_path, hist_path]
    target = trace_path
    with Partials() as parts:  # whatever happens, no partial file is left behind
        try:  # every file complete under partial names first: a full disk leaves none
            sweep_stale(d, [TRACE_NAME, HIST_NAME, GUESS_NAME])
            staged = [_stage(trace_path, arr.astype(_DTYPE).tobytes(), parts)]
            target = hist_path
            staged.append(_stage(hist_path, hist_bytes, parts))
            if guesses is not None:
                target = guess_path
                staged.append(_stage(guess_path, guess_bytes(guesses, arr.shape[0]), parts))
                finals.append(guess_path)
            elif guess_path.is_file():
                target = guess_path
                guess_path.unlink()
            for tmp, final in zip(staged, finals, strict=True):
                target = final
                os.replace(tmp, final)
                parts.keep(tmp)
        except OSError as exc:
            note = (space_note(d, [TRACE_NAME, HIST_NAME, GUESS_NAME])
                    if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "")
            raise OutputError(f"cannot write {target}: {exc.strerror or exc}"
                              + (f" ({note})" if note else "")) from None
    return trace_path, hist_path


def _stage(path: Path, data: bytes, parts: Partials) -> Path:
    """Write ``data`` to a new partial file next to ``path`` (registered in ``parts``)."""
    return stage_bytes(path, data, parts)


class TraceRecorder:
    """Collects requests as the cache serves them; writes both files at the end of a run.

    The cache calls :meth:`record` (or :meth:`record_many` for a batch) once per request,
    before serving it. Memory: 8 bytes per request in growable int32 chunks plus one counter
    per ``(layer, expert)`` (``n_layers + 1`` by ``n_experts``, never reset).
    """

    _CHUNK = 1 << 16  # requests per chunk

    def __init__(self, n_layers: int, n_experts: int):
        self.n_layers, self.n_experts = int(n_layers), int(n_experts)
        self._chunks: list[np.ndarray] = []
        self._buf = np.empty((self._CHUNK, 2), dtype=np.int32)
        self._fill = 0
        self.counts = np.zeros((self.n_layers + 1, self.n_experts), dtype=np.int64)
        self.guesses: list[tuple[int, int, int]] = []  # (at, layer, expert): the lookahead's

    def __len__(self) -> int:
        return len(self._chunks) * self._CHUNK + self._fill

    def record(self, layer: int, expert: int) -> None:
        self.counts[layer, expert] += 1  # IndexError for a bad id is a caller bug
        self._buf[self._fill] = (layer, expert)
        self._fill += 1
        if self._fill == self._CHUNK:
            self._chunks.append(self._buf)
            self._buf = np.empty((self._CHUNK, 2), dtype=np.int32)
            self._fill = 0

    def record_many(self, layer: int, experts: Iterable[int]) -> None:
        for e in experts:
            self.record(layer, int(e))

    def record_guess(self, layer: int, experts: Iterable[int]) -> None:
        """A lookahead guess of ``layer``'s experts, made before the next request."""
        at = len(self)
        self.guesses.extend((at, int(layer), int(e)) for e in experts)

    def pairs(self) -> np.ndarray:
        """All recorded requests so far as an ``(N, 2)`` int32 array."""
        return np.concatenate([*self._chunks, self._buf[: self._fill]], axis=0)

    def hist(self) -> dict[tuple[int, int], int]:
        layers, experts = np.nonzero(self.counts)
        return {
            (int(layer), int(e)): int(self.counts[layer, e])
            for layer, e in zip(layers, experts, strict=True)
        }

    def write(self, directory: str | os.PathLike[str]) -> tuple[Path, Path]:
        """Write ``expert_trace.bin`` and ``expert_hist.json`` into ``directory``."""
        guesses = np.array(self.guesses, dtype=np.int64).reshape(-1, 3) if self.guesses else None
        return write_trace(
            directory, self.pairs(), self.hist(), n_layers=self.n_layers, n_experts=self.n_experts,
            guesses=guesses,
        )
