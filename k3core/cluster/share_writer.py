"""``k3 shard-experts``: cut a checkpoint into a head and one share per expert worker.

The plan is :func:`k3core.cluster.plan.plan_shares` over the checkpoint's headers. Every
source shard is read once, tensor by tensor in file order (a large tensor in chunks of
``CHUNK`` bytes, so no more than a chunk is ever in memory), and each tensor is appended
to the file of the same name in its destination: a routed expert's six tensors to its
owner's ``worker-i/``, everything else to ``head/``. The files keep the released layout
(``model-XXXXX-of-YYYYY.safetensors``, each directory with its own
``model.safetensors.index.json``; an expert's tensors stay one contiguous run), the head
gets the config, the tokenizer and the model's other small files, every worker the config,
and the manifests of :mod:`k3core.cluster.shares` name every file with its checksums.

Everything is written into a partial directory beside ``OUT_DIR``
(:mod:`k3core.api.partials`) and renamed into place only when complete; an ``OUT_DIR``
that is not empty is refused before anything is written.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from k3core.api.errors import UsageError
from k3core.api.outputs import Output, check_outputs
from k3core.api.partials import whole_tree
from k3core.api.storage import StorageBackend
from k3core.checkpoint.index import INDEX_NAME, CheckpointIndex, TensorInfo
from k3core.cluster.plan import SharePlan, plan_shares
from k3core.cluster.shares import (
    HEAD_MANIFEST,
    HEAD_NAME,
    SHARE_MANIFEST,
    FileSum,
    HeadManifest,
    ShareRecord,
    file_sum,
    share_manifest,
    worker_name,
    write_manifest,
)
from k3core.experts.locator import ExpertLocator
from k3core.model import names
from k3core.model.config import load_config
from k3core.run.model_dir import CONFIG_NAME, config_path

#: bytes copied at a time: the most of a tensor ever in memory
CHUNK = 1 << 26
HEAD = -1  # the head's destination number

Progress = Callable[[int, int], None]  # (bytes copied, bytes in all)


@dataclass(frozen=True)
class WrittenShares:
    """What was written: the plan and every directory's record."""

    out_dir: Path
    plan: SharePlan
    head: ShareRecord
    shares: list[ShareRecord]


def owner_of(name: str, plan: SharePlan) -> int:
    """The destination of tensor ``name``: its owner for a routed expert, else the head."""
    split = names.split_layer_name(name)
    if split is None:
        return HEAD
    layer, suffix = split
    m = names.EXPERT_RE.match(suffix)
    if m is None or layer not in plan.owner:
        return HEAD
    return plan.owner[layer][int(m.group(1))]


def write_shares(model_dir: Path, out_dir: Path, workers: int, storage: StorageBackend,
                 progress: Progress | None = None) -> WrittenShares:
    """Write ``out_dir/head`` and ``out_dir/worker-0..workers-1`` (see the module docstring)."""
    model_dir, out = Path(model_dir), Path(out_dir)
    cfg_file = config_path(model_dir)
    cfg = load_config(cfg_file)
    check_outputs([Output(out, "OUT_DIR", directory=True, create=False)],
                  inputs=[(model_dir, "MODEL_DIR")])
    if out.exists() and any(out.iterdir()):
        raise UsageError(f"OUT_DIR {out} exists and is not empty; k3 shard-experts writes only "
                         "into a new or empty directory")
    if all(cfg.is_dense(L) for L in range(cfg.n_layers)):
        raise UsageError(f"{model_dir} has no MoE layer: there are no routed experts to shard")
    with CheckpointIndex.open(model_dir, storage) as index:
        plan = plan_shares(cfg, ExpertLocator(cfg, index), cfg.n_layers, workers)
        with whole_tree(out, f"cannot write OUT_DIR {out}") as tmp:  # out empty (checked above)
            records = _write_all(index, plan, model_dir, cfg_file, tmp, progress)
            head, shares = records[HEAD], [records[w] for w in range(workers)]
            model = model_identity(index.fingerprint(), records)
            fp = plan.fingerprint(model)
            manifest = HeadManifest(model, fp, plan, shares, head)
            write_manifest(tmp / HEAD_NAME / HEAD_MANIFEST, manifest.to_json())
            for w in range(workers):
                write_manifest(tmp / worker_name(w) / SHARE_MANIFEST,
                               share_manifest(manifest.expect(w)))
    return WrittenShares(out, plan, head, shares)


def model_identity(headers: str, records: dict[int, ShareRecord]) -> str:
    """What the manifests call the model: SHA-256 of the source's header fingerprint and of
    every file written (head and shares, by directory and name), so two models of the same
    shape (equal headers) differ, and one model sharded for N workers is always the same."""
    h = hashlib.sha256(headers.encode())
    for d in sorted(records):
        for name, f in sorted(records[d].files.items()):
            h.update(f"{d}/{name}:{f.nbytes}:{f.sha256};".encode())
    return h.hexdigest()


class _Shard:
    """One destination file being written: its header first, then its tensors' bytes."""

    def __init__(self, path: Path, tensors: list[TensorInfo]):
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        pos = 0
        for t in tensors:
            header[t.name] = {"dtype": t.dtype, "shape": list(t.shape),
                              "data_offsets": [pos, pos + t.nbytes]}
            pos += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.path = path
        self.sha = hashlib.sha256()
        self.f: BinaryIO = open(path, "wb")
        self.write(len(raw).to_bytes(8, "little") + raw)

    def write(self, data: bytes | memoryview) -> None:
        self.f.write(data)
        self.sha.update(data)

    def finish(self) -> FileSum:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        return file_sum(self.path, self.sha.hexdigest())


def _write_all(index: CheckpointIndex, plan: SharePlan, model_dir: Path, cfg_file: Path,
               tmp: Path, progress: Progress | None) -> dict[int, ShareRecord]:
    dests = [HEAD, *range(plan.n_workers)]
    dirs = {d: tmp / (HEAD_NAME if d == HEAD else worker_name(d)) for d in dests}
    for p in dirs.values():
        p.mkdir()
    files: dict[int, dict[str, FileSum]] = {d: {} for d in dests}
    maps: dict[int, dict[str, str]] = {d: {} for d in dests}
    sizes = dict.fromkeys(dests, 0)
    total = index.total_bytes
    done = 0
    by_shard: dict[Path, list[TensorInfo]] = {}
    for t in index.tensors.values():
        by_shard.setdefault(t.path, []).append(t)
    for shard in index.shards:
        tensors = sorted(by_shard.get(shard, []), key=lambda t: t.offset)
        split: dict[int, list[TensorInfo]] = {}
        for t in tensors:
            split.setdefault(owner_of(t.name, plan), []).append(t)
        writers = {d: _Shard(dirs[d] / shard.name, ts) for d, ts in split.items()}
        try:
            for t in tensors:
                d = owner_of(t.name, plan)
                for off in range(0, t.nbytes, CHUNK):
                    n = min(CHUNK, t.nbytes - off)
                    writers[d].write(index.read_range(shard, t.offset + off, n).data)
                done += t.nbytes
                maps[d][t.name] = shard.name
                sizes[d] += t.nbytes
                if progress is not None:
                    progress(done, total)
            for d, sw in writers.items():
                files[d][shard.name] = sw.finish()
        finally:
            for sw in writers.values():
                if not sw.f.closed:
                    sw.f.close()
    for d in dests:
        body = {"metadata": {"total_size": sizes[d]}, "weight_map": dict(sorted(maps[d].items()))}
        (dirs[d] / INDEX_NAME).write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
        files[d][INDEX_NAME] = file_sum(dirs[d] / INDEX_NAME)
        shutil.copyfile(cfg_file, dirs[d] / CONFIG_NAME)
        files[d][CONFIG_NAME] = file_sum(dirs[d] / CONFIG_NAME)
    for extra in sorted(model_dir.iterdir()):  # the tokenizer and the model's other small files
        if (extra.is_file() and not extra.name.startswith(".") and extra.suffix != ".safetensors"
                and extra.name not in (INDEX_NAME, CONFIG_NAME)):
            shutil.copyfile(extra, dirs[HEAD] / extra.name)
            files[HEAD][extra.name] = file_sum(dirs[HEAD] / extra.name)
    out = {HEAD: ShareRecord(HEAD, 0, 0, files[HEAD])}
    for w in range(plan.n_workers):
        out[w] = ShareRecord(w, plan.experts_per_worker[w], plan.bytes_per_worker[w], files[w])
    return out
