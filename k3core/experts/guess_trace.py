"""``expert_guess.bin``: the router lookahead's guesses beside a trace (a versioned extension).

``expert_trace.bin`` keeps the reference engine's format (requests only, no header), so
traces still move between engines and every trace written before the lookahead still loads.
The guesses live in a sidecar written with it (``--dump-cache-trace`` with ``--lookahead``
on), read by ``k3 sim-cache`` when it is there:

``expert_guess.bin``
    A 24-byte header, then one little-endian int32 triple ``(at, layer, expert)`` per guessed
    expert. The header is the magic ``K3GUESS\\0``, then little-endian uint32 ``version``
    (:data:`GUESS_VERSION`), uint32 ``fields`` (3), uint64 ``requests``: the length of the
    trace it was recorded with, so a sidecar never pairs with another trace. ``at`` is the
    number of requests the trace held when the guess was made (the guess comes before request
    ``at``); ``at`` never decreases.

Reading refuses (:class:`GuessError`, exit 2) a wrong magic, a newer
version than this k3 reads, a length that is not whole records, a guess outside the trace or
the model, and a sidecar of another trace.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from k3core.api.errors import UsageError

MAX_GUESS_BYTES = 10**9
GUESS_NAME = "expert_guess.bin"
GUESS_MAGIC = b"K3GUESS\x00"
GUESS_VERSION = 1
_HEADER = struct.Struct("<8sIIQ")
_DTYPE = np.dtype("<i4")


class GuessError(UsageError):
    """A guess file that cannot be used (exit 2)."""


def guess_bytes(guesses: np.ndarray, requests: int) -> bytes:
    """The sidecar's bytes for ``(N, 3)`` ``(at, layer, expert)`` rows of a trace of
    ``requests`` requests."""
    arr = np.asarray(guesses, dtype=np.int64).reshape(-1, 3)
    return _HEADER.pack(GUESS_MAGIC, GUESS_VERSION, 3, int(requests)) + arr.astype(_DTYPE).tobytes()


def parse_guesses(data: bytes, requests: int, n_layers: int | None = None,
                  n_experts: int | None = None, where: str = GUESS_NAME) -> np.ndarray:
    """Check a sidecar's bytes against its trace; ``(N, 3)`` int64 rows."""
    if len(data) < _HEADER.size:
        raise GuessError(f"{where}: {len(data)} bytes is shorter than the {_HEADER.size}-byte header")
    magic, version, fields, n_req = _HEADER.unpack_from(data)
    if magic != GUESS_MAGIC:
        raise GuessError(f"{where}: not a lookahead guess file (bad magic)")
    if version > GUESS_VERSION or version < 1:
        raise GuessError(f"{where}: version {version}; this k3 reads version {GUESS_VERSION}")
    if fields != 3:
        raise GuessError(f"{where}: {fields} fields a record, expected 3")
    if n_req != requests:
        raise GuessError(f"{where}: recorded with a trace of {n_req} requests, this trace has "
                         f"{requests}: it belongs to another trace")
    body = data[_HEADER.size:]
    if len(body) % (3 * _DTYPE.itemsize):
        raise GuessError(f"{where}: {len(body)} bytes after the header is not whole records")
    rows = np.frombuffer(body, dtype=_DTYPE).reshape(-1, 3).astype(np.int64)
    at, layer, expert = rows[:, 0], rows[:, 1], rows[:, 2]
    hi_layer = (1 << 11) - 1 if n_layers is None else int(n_layers)
    hi_expert = (1 << 20) - 1 if n_experts is None else int(n_experts) - 1
    for name, col, lo, hi in (("position", at, 0, requests), ("layer", layer, 0, hi_layer),
                              ("expert", expert, 0, hi_expert)):
        bad = np.flatnonzero((col < lo) | (col > hi))
        if bad.size:
            i = int(bad[0])
            raise GuessError(f"{where}: guess {i} has {name} {int(col[i])}, outside {lo}..{hi}")
    if rows.shape[0] > 1 and np.any(np.diff(at) < 0):
        raise GuessError(f"{where}: guess positions go backwards; not a recorded guess file")
    return rows


def read_guesses(path: str | os.PathLike[str], requests: int, n_layers: int | None = None,
                 n_experts: int | None = None) -> np.ndarray:
    """Read ``expert_guess.bin`` for a trace of ``requests`` requests (see the module doc)."""
    p = Path(path)
    try:
        size = p.stat().st_size
        if size > MAX_GUESS_BYTES:
            raise GuessError(f"{p}: {size:,} bytes is over the {MAX_GUESS_BYTES:,}-byte limit")
        data = p.read_bytes()
    except FileNotFoundError:
        raise GuessError(f"{p}: no such file") from None
    except IsADirectoryError:
        raise GuessError(f"{p}: is a directory, expected an {GUESS_NAME} file") from None
    except OSError as exc:
        raise GuessError(f"{p}: cannot read it ({exc.strerror or exc})") from None
    return parse_guesses(data, requests, n_layers, n_experts, where=str(p))
