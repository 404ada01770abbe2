"""The session file: a saved sequence that only the same model and config may resume.

Layout (little-endian), written atomically (a temporary file in the same directory, then
a rename), so a file is complete or absent:

=========  ===================================================================
8 bytes    magic ``K3STATE\\n``
4 bytes    format version (:data:`VERSION`)
4 bytes    header length H
32 bytes   SHA-256 of the 16 bytes above and the H header bytes
H bytes    JSON header: ``model`` (``config``, ``layers``, ``weights``), ``ids``, ``pos``,
           ``capacity``, per array ``name``, ``dtype``, ``shape``, ``offset``, ``nbytes``;
           ``body_bytes`` and ``body_sha256``
N bytes    the arrays' bytes (N = ``body_bytes``), in header order, then the end of the file
=========  ===================================================================

Every byte is covered by a checksum: the header's digest covers the magic, version, length
and header (which holds the ids, the position and the body's digest), the body's digest
covers the arrays, and the file must end exactly where the checked header says the body
ends. Nothing is used before it is checked: the header's digest first, then the model it
names, then the sizes (the KV cache the positions imply is checked against the memory
available); the body is read once, in chunks, straight into the new state while its digest
is taken, and the state is handed back only when the digest matches.

``model`` binds the file to what makes its state: a SHA-256 of the architecture (every
config field), the number of layers run, and a SHA-256 of a sample of the weights (the final
norm and the first bytes of the embedding and ``lm_head``). The kernel backend, storage,
cache policy, trunk and budgets give the same bits, so they are not part of it.

Every refusal is a :class:`StateFileError`, exit 2 (a file k3 cannot trust is bad input,
like a damaged tokenizer or a trace of another model, ``docs/exit-codes.md``), one line,
before the first token; nothing is half-loaded. A file written by an older k3 (format
version 1 held the expanded per-head keys and values; version 2 had no checksum over its
header) cannot be resumed: the session must be saved again.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from io import BufferedReader
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from k3core.api.errors import Exit, K3Error
from k3core.api.outputs import write_bytes_atomic
from k3core.api.safejson import JSONRejected, parse_json
from k3core.model import names
from k3core.model.state import SequenceState
from k3core.run.memory_plan import check_kv

if TYPE_CHECKING:
    from k3core.run.binding import Bound

MAGIC = b"K3STATE\n"
VERSION = 3
#: what each older format was, for the refusal message
OLD_VERSIONS = {1: "it held the expanded per-head MLA keys and values",
                2: "it had no checksum over its ids and positions"}
PREAMBLE = 16  # magic, version, header length
DIGEST = 32  # SHA-256 of the preamble and the header
START = PREAMBLE + DIGEST
MAX_HEADER = 16 << 20
SAMPLE = 4096
CHUNK = 16 << 20  # body bytes read and hashed at a time


class StateFileError(K3Error):
    """A session file that cannot be read or trusted, or belongs to another model or config
    (exit 2)."""

    exit_code = Exit.USAGE


def model_identity(engine: Bound) -> dict[str, Any]:
    """What a session file is bound to (see the module docstring)."""
    cfg = json.dumps(engine.cfg.to_flat_dict(), sort_keys=True, default=str).encode()
    weights = hashlib.sha256()
    for name in (names.NORM, names.EMBED, names.LM_HEAD):
        info = engine.index.info(name)
        with open(info.path, "rb") as f:
            weights.update(os.pread(f.fileno(), min(info.nbytes, SAMPLE), info.offset))
    return {"config": hashlib.sha256(cfg).hexdigest(), "layers": int(engine.model.n_layers),
            "weights": weights.hexdigest()}


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
    entries: list[dict[str, Any]] = []
    views: list[memoryview] = []
    body_digest, offset = hashlib.sha256(), 0
    for name, a in _arrays(st) if st is not None else []:
        view = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).data.cast("B")
        entries.append({"name": name, "dtype": a.dtype.newbyteorder("<").str,
                        "shape": list(a.shape), "offset": offset, "nbytes": view.nbytes})
        body_digest.update(view)
        views.append(view)
        offset += view.nbytes
    header = json.dumps({
        "model": model_identity(engine), "ids": [int(i) for i in ids], "pos": pos,
        "capacity": st.capacity if st is not None else 0, "arrays": entries,
        "body_bytes": offset, "body_sha256": body_digest.hexdigest(),
    }).encode()
    pre = MAGIC + struct.pack("<II", VERSION, len(header))
    blob = b"".join([pre, hashlib.sha256(pre + header).digest(), header, *views])
    write_bytes_atomic(path, blob, "the session file")
    return len(blob)


def read_state(path: Path, engine: Bound) -> tuple[list[int], SequenceState | None]:
    """The ids and state saved at ``path``, checked (see the module docstring)."""
    where = f"session file {path}"
    try:
        if not path.is_file():
            raise StateFileError(f"{where}: no such file" if not path.exists() else
                                 f"{where}: not a regular file")
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = _header(f, size, where)
            ids, pos = _check_model(head, engine, where)
            return ids, _body(f, size, head, engine, pos, where)
    except OSError as exc:
        raise StateFileError(f"{where}: cannot read it ({exc.strerror or exc})") from None


def _header(f: BufferedReader, size: int, where: str) -> dict[str, Any]:
    """The header, once its checksum matches."""
    start = f.read(START)
    if len(start) < PREAMBLE or start[:8] != MAGIC:
        raise StateFileError(f"{where}: not a k3 session file (bad magic)")
    version, hlen = struct.unpack("<II", start[8:PREAMBLE])
    if version != VERSION:
        if version < VERSION:
            why = f"; {OLD_VERSIONS[version]}" if version in OLD_VERSIONS else ""
            raise StateFileError(
                f"{where}: written by an older k3 (session format version {version}{why}); "
                f"this k3 reads version {VERSION} only, so it cannot be resumed: save the "
                "session again with this k3")
        raise StateFileError(f"{where}: written by a newer k3 (session format version "
                             f"{version}); this k3 reads version {VERSION} only")
    if len(start) < START or hlen > MAX_HEADER or START + hlen > size:
        raise StateFileError(f"{where}: truncated or damaged header (the file has {size} "
                             f"bytes, the header would end at byte {START + hlen})")
    raw = f.read(hlen)
    if len(raw) != hlen:
        raise StateFileError(f"{where}: truncated header (the file shrank while read)")
    if hashlib.sha256(start[:PREAMBLE] + raw).digest() != start[PREAMBLE:START]:
        raise StateFileError(f"{where}: the header (ids, positions, model) is damaged "
                             "(checksum differs)")
    try:
        head = parse_json(raw)
    except JSONRejected as exc:
        raise StateFileError(f"{where}: damaged header ({exc})") from None
    if not isinstance(head, dict):
        raise StateFileError(f"{where}: damaged header (not an object)")
    return head


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{v!r} is not an integer")
    return v


def read_ids(path: Path, engine: Bound, identity: dict[str, Any] | None = None) -> list[int]:
    """The ids a session file at ``path`` was saved after, from its checked header alone
    (the body is not read); ``identity`` is :func:`model_identity` of ``engine`` when the
    caller has it. Every refusal is a :class:`StateFileError`."""
    where = f"session file {path}"
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = _header(f, size, where)
            return _check_model(head, engine, where, identity)[0]
    except OSError as exc:
        raise StateFileError(f"{where}: cannot read it ({exc.strerror or exc})") from None


def _check_model(head: dict[str, Any], engine: Bound, where: str,
                 identity: dict[str, Any] | None = None) -> tuple[list[int], int]:
    """The ids and position, once the file is known to be this model's and consistent."""
    try:
        saved = head["model"]
        ids = [_int(i) for i in head["ids"]]
        pos = _int(head["pos"])
        layers = _int(saved["layers"])
        config, weights = str(saved["config"]), str(saved["weights"])
    except (KeyError, TypeError) as exc:
        raise StateFileError(f"{where}: damaged header ({exc})") from None
    here = identity if identity is not None else model_identity(engine)
    if weights != here["weights"]:
        why = "its weights differ"
    elif config != here["config"]:
        why = "its architecture (config.json or --config) differs"
    elif layers != here["layers"]:
        why = f"it ran {layers} layers, this run has {here['layers']} (--layers)"
    else:
        why = ""
    if why:
        raise StateFileError(f"{where}: saved by another model or config ({why}); a session "
                             "resumes only on the model and config that made it")
    if not 0 <= pos <= len(ids) or any(not 0 <= i < engine.cfg.vocab for i in ids):
        raise StateFileError(f"{where}: inconsistent positions or ids")
    return ids, pos


def _body(f: BufferedReader, size: int, head: dict[str, Any], engine: Bound, pos: int,
          where: str) -> SequenceState | None:
    """The state the body holds, read into place and handed back once its digest matches."""
    try:
        body_bytes, digest = _int(head["body_bytes"]), str(head["body_sha256"])
        entries = list(head["arrays"])
    except (KeyError, TypeError) as exc:
        raise StateFileError(f"{where}: damaged header ({exc})") from None
    end = f.tell() + body_bytes
    if size != end:
        extra = (f"{size - end} bytes after the end of the state" if size > end else
                 f"truncated: {size} bytes where the header says {end}")
        raise StateFileError(f"{where}: {extra}")
    if pos == 0:
        if body_bytes or entries:
            raise StateFileError(f"{where}: state arrays for a sequence with no positions")
        return None
    check_kv(engine.cfg, pos, n_layers=engine.model.n_layers)
    state = SequenceState(engine.cfg, pos)
    targets = _targets(state, engine, pos, entries, body_bytes, where)
    h = hashlib.sha256()
    for target in targets:
        view = target.data.cast("B")
        for at in range(0, view.nbytes, CHUNK):
            part = view[at: at + CHUNK]
            if f.readinto(part) != part.nbytes:
                raise StateFileError(f"{where}: truncated (the file shrank while read)")
            h.update(part)
    if h.hexdigest() != digest:
        raise StateFileError(f"{where}: the state bytes are damaged (checksum differs)")
    state.pos = pos
    return state


def _targets(state: SequenceState, engine: Bound, pos: int, entries: list[Any],
             body_bytes: int, where: str) -> list[np.ndarray]:
    """This model's state arrays for ``pos`` positions, in the order the body holds them,
    after checking that the header describes exactly them, back to back."""
    cfg = engine.cfg
    for layer in range(engine.model.n_layers):
        if cfg.is_mla(layer):
            state.kv_cache(layer)
        else:
            state.kda_state(layer)
    state.pos = pos  # for _arrays' KV slices; set again once the body is read
    want = _arrays(state)
    state.pos = 0
    if len(entries) != len(want):
        raise StateFileError(f"{where}: its arrays do not match this model's state")
    offset = 0
    for e, (name, a) in zip(entries, want, strict=True):
        try:
            ok = (isinstance(e, dict) and e["name"] == name
                  and [_int(n) for n in e["shape"]] == list(a.shape)
                  and np.dtype(e["dtype"]) == a.dtype.newbyteorder("<")
                  and _int(e["offset"]) == offset and _int(e["nbytes"]) == a.nbytes)
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise StateFileError(f"{where}: array {name} is not this model's "
                                 "(name, shape, dtype or place differ)")
        offset += a.nbytes
    if offset != body_bytes:
        raise StateFileError(f"{where}: its arrays do not match this model's state")
    return [a for _, a in want]
