"""The session file: a saved sequence that only the same model and config may resume.

Layout (little-endian), written atomically (a temporary file in the same directory, then
a rename), so a file is complete or absent:

=========  ===================================================================
8 bytes    magic ``K3STATE\\n``
4 bytes    format version (:data:`VERSION`; 2 since the KV cache holds the MLA latent)
4 bytes    header length H
H bytes    JSON header: ``fingerprint``, ``ids``, ``pos``, ``capacity`` and, per array,
           ``name``, ``dtype``, ``shape``, ``offset``, ``nbytes``; ``body_sha256``
rest       the arrays' bytes, in header order
=========  ===================================================================

The fingerprint is a SHA-256 over the model's architecture (every config field), the
number of layers run and a sample of its weights (the final norm and the first bytes of the
embedding and lm_head), so a session made on another model or config is refused, as is a
file whose arrays do not have the shapes this model's state has. A refused file is a
:class:`StateFileError` (exit 1); nothing is half-loaded. A file of another format version
(version 1 held the expanded per-head keys and values) is refused with exit 2: it is input
this k3 does not read, and the session must be made again.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from k3core.api.errors import Exit, K3Error
from k3core.api.outputs import write_bytes_atomic
from k3core.model import names
from k3core.model.state import SequenceState
from k3core.run.memory_plan import check_kv

if TYPE_CHECKING:
    from k3core.run.binding import Bound

MAGIC = b"K3STATE\n"
VERSION = 2
#: what each older format held, for the refusal message
OLD_VERSIONS = {1: "the expanded per-head MLA keys and values"}
MAX_HEADER = 16 << 20
SAMPLE = 4096


class StateFileError(K3Error):
    """A session file that cannot be read, or belongs to another model or config (exit 1)."""


def fingerprint(engine: Bound) -> str:
    """The model identity a session file is bound to (see the module docstring)."""
    h = hashlib.sha256()
    cfg = engine.cfg.to_flat_dict()
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    h.update(f"layers={engine.model.n_layers}".encode())
    for name in (names.NORM, names.EMBED, names.LM_HEAD):
        info = engine.index.info(name)
        with open(info.path, "rb") as f:
            h.update(os.pread(f.fileno(), min(info.nbytes, SAMPLE), info.offset))
    return h.hexdigest()


def _arrays(state: SequenceState) -> list[tuple[str, np.ndarray]]:
    out: list[tuple[str, np.ndarray]] = []
    for layer in sorted(state.kda):
        st = state.kda[layer]
        out.append((f"kda.{layer}.S", st.S))
        out += [(f"kda.{layer}.conv.{k}", st.conv[k]) for k in sorted(st.conv)]
    for layer in sorted(state.kv):
        kv = state.kv[layer]
        for fname in sorted(vars(kv)):
            a = getattr(kv, fname)
            if isinstance(a, np.ndarray):
                out.append((f"kv.{layer}.{fname}", a[: state.pos]))
    return out


def write_state(path: Path, engine: Bound, ids: list[int], st: SequenceState | None) -> int:
    """Serialise a sequence (its ids and carried state) to ``path``; returns the file's size."""
    pos = st.pos if st is not None else 0
    entries, chunks, offset = [], [], 0
    for name, a in _arrays(st) if st is not None else []:
        data = np.ascontiguousarray(a).tobytes()
        entries.append({"name": name, "dtype": a.dtype.str, "shape": list(a.shape),
                        "offset": offset, "nbytes": len(data)})
        chunks.append(data)
        offset += len(data)
    body = b"".join(chunks)
    header = json.dumps({
        "fingerprint": fingerprint(engine), "ids": ids, "pos": pos,
        "capacity": st.capacity if st is not None else 0, "arrays": entries,
        "body_sha256": hashlib.sha256(body).hexdigest(),
    }).encode()
    blob = MAGIC + struct.pack("<II", VERSION, len(header)) + header + body
    write_bytes_atomic(path, blob, "the session file")
    return len(blob)


def read_state(path: Path, engine: Bound) -> tuple[list[int], SequenceState | None]:
    """The ids and state saved at ``path``, checked against ``engine``'s model.

    The header is read and checked first (magic, version, fingerprint, positions); the KV
    cache it implies is checked against the memory available, and the file must hold exactly
    the bytes this model's state for those positions takes, before the body is read."""
    where = f"session file {path}"
    try:
        if not path.is_file():
            raise StateFileError(f"{where}: no such file" if not path.exists() else
                                 f"{where}: not a regular file")
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            ids, pos, entries, digest, hlen = _header(f, size, engine, where)
            if pos == 0:
                return ids, None
            check_kv(engine.cfg, pos, n_layers=engine.model.n_layers)
            state = SequenceState(engine.cfg, pos)
            want = _expected(state, engine, pos)
            expected = sum(int(np.prod(shape)) * a.dtype.itemsize for a, shape in want.values())
            if size - 16 - hlen != expected:
                raise StateFileError(f"{where}: {size - 16 - hlen} bytes of state where this "
                                     f"model's {pos} positions take {expected}")
            body = f.read(expected)
    except OSError as exc:
        raise StateFileError(f"{where}: cannot read it ({exc.strerror or exc})") from None
    if hashlib.sha256(body).hexdigest() != digest:
        raise StateFileError(f"{where}: the state bytes are damaged (checksum differs)")
    _fill(want, entries, body, where)
    state.pos = pos
    return ids, state


def _header(f: Any, size: int, engine: Bound, where: str
            ) -> tuple[list[int], int, list[Any], str, int]:
    start = f.read(16)
    if len(start) < 16 or start[:8] != MAGIC:
        raise StateFileError(f"{where}: not a k3 session file (bad magic)")
    version, hlen = struct.unpack("<II", start[8:16])
    if version != VERSION:
        held = f" (it holds {OLD_VERSIONS[version]})" if version in OLD_VERSIONS else ""
        raise StateFileError(
            f"{where}: session format version {version}{held}; this k3 reads version {VERSION} "
            "only (the KV cache now holds the MLA latent): save the session again with this k3",
            exit_code=Exit.USAGE)
    if hlen > MAX_HEADER or 16 + hlen > size:
        raise StateFileError(f"{where}: truncated or damaged header")
    try:
        head = json.loads(f.read(hlen))
        ids = [int(i) for i in head["ids"]]
        pos, entries = int(head["pos"]), list(head["arrays"])
        fp, digest = str(head["fingerprint"]), str(head["body_sha256"])
    except (ValueError, KeyError, TypeError) as exc:
        raise StateFileError(f"{where}: damaged header ({exc})") from None
    if fp != fingerprint(engine):
        raise StateFileError(f"{where}: saved by another model or config (fingerprint "
                             "differs); a session resumes only on the model that made it")
    if not 0 <= pos <= len(ids) or any(not 0 <= i < engine.cfg.vocab for i in ids):
        raise StateFileError(f"{where}: inconsistent positions or ids")
    return ids, pos, entries, digest, hlen


def _expected(state: SequenceState, engine: Bound, pos: int
              ) -> dict[str, tuple[np.ndarray, tuple[int, ...]]]:
    """Every array this model's state has, with the shape it is saved in."""
    cfg = engine.cfg
    for layer in range(engine.model.n_layers):
        if cfg.is_mla(layer):
            state.kv_cache(layer)
        else:
            state.kda_state(layer)
    return {name: (a, (pos, *a.shape[1:]) if name.startswith("kv.") else tuple(a.shape))
            for name, a in _arrays_full(state)}


def _fill(want: dict[str, tuple[np.ndarray, tuple[int, ...]]], entries: list[Any],
          body: bytes, where: str) -> None:
    got = {str(e.get("name")): e for e in entries if isinstance(e, dict)}
    if set(got) != set(want):
        raise StateFileError(f"{where}: its arrays do not match this model's state")
    for name, (target, shape) in want.items():
        e = got[name]
        try:
            off, n = int(e["offset"]), int(e["nbytes"])
            ok = (tuple(e["shape"]) == shape and np.dtype(e["dtype"]) == target.dtype
                  and n == int(np.prod(shape)) * target.dtype.itemsize and 0 <= off
                  and off + n <= len(body))
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise StateFileError(f"{where}: array {name} does not have this model's shape")
        a = np.frombuffer(body, dtype=target.dtype, count=n // target.dtype.itemsize, offset=off)
        target[: shape[0]] = a.reshape(shape)


def _arrays_full(state: SequenceState) -> list[tuple[str, np.ndarray]]:
    out: list[tuple[str, np.ndarray]] = []
    for name, a in _arrays(state):
        if name.startswith("kv."):
            _, layer, fname = name.split(".", 2)
            a = getattr(state.kv[int(layer)], fname)
        out.append((name, a))
    return out
