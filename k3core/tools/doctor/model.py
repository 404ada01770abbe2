"""Is a model directory complete? The model half of ``k3 doctor``.

Checks, in order, stopping where the next check would be meaningless: the config reads
with confidence; every shard ``model.safetensors.index.json`` names is there (all missing
ones listed, with how many tensors each would have held); the shard headers index cleanly;
every trunk tensor and model table the config needs is present; every routed expert of every
MoE layer is present (six MXFP4 tensors, or three dense ones); the tokenizer files.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from k3core.api.errors import K3Error
from k3core.api.files import FileRejected, read_capped
from k3core.api.safejson import JSONRejected, parse_json, show
from k3core.api.storage import StorageBackend
from k3core.api.units import human
from k3core.checkpoint.index import INDEX_NAME, MAX_INDEX_BYTES, CheckpointIndex
from k3core.model import names
from k3core.model.config import ModelConfig, load_config
from k3core.model.layer_params import trunk_suffixes
from k3core.model.sizes import ModelSizes, sizes_from_index

Status = Literal["ok", "warn", "fail", "info"]
TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json")
LISTED = 6


@dataclass(frozen=True)
class Check:
    section: str
    name: str
    status: Status
    detail: str


@dataclass
class ModelCheck:
    checks: list[Check] = field(default_factory=list)
    cfg: ModelConfig | None = None
    sizes: ModelSizes | None = None
    has_tokenizer: bool = False

    @property
    def complete(self) -> bool:
        return self.sizes is not None and not any(c.status == "fail" for c in self.checks)

    def add(self, name: str, status: Status, detail: str) -> None:
        self.checks.append(Check("model", name, status, detail))


def _listed(items: list[str]) -> str:
    more = f" and {len(items) - LISTED} more" if len(items) > LISTED else ""
    return ", ".join(items[:LISTED]) + more


def check_model(model_dir: str | Path, storage: StorageBackend) -> ModelCheck:
    root = Path(model_dir)
    mc = ModelCheck()
    if not root.is_dir():
        mc.add("directory", "fail", f"{root} is not a directory")
        return mc
    try:
        cfg = load_config(root)
    except K3Error as exc:
        mc.add("config", "fail", str(exc))
        return mc
    mc.cfg = cfg
    mc.add("config", "ok", cfg.describe().removeprefix("config: "))
    if not _shards_present(root, mc):
        return mc
    try:
        index = CheckpointIndex.open(root, storage)
    except K3Error as exc:
        mc.add("shards", "fail", str(exc))
        return mc
    with index:
        tensors = {n: t.nbytes for n, t in index.tensors.items()}
        mc.add("shards", "ok", f"{len(index.shards)} shards, {len(tensors)} tensors, "
                               f"{human(index.total_bytes)}")
    _check_trunk(cfg, tensors, mc)
    _check_experts(cfg, tensors, mc)
    mc.sizes = sizes_from_index(cfg, tensors)
    missing_tok = [f for f in TOKENIZER_FILES if not (root / f).is_file()]
    mc.has_tokenizer = not missing_tok
    if missing_tok:
        mc.add("tokenizer", "warn", f"no {', '.join(missing_tok)}: run with --ids, or pass "
                                    "--tok DIR")
    else:
        mc.add("tokenizer", "ok", "tiktoken.model and tokenizer_config.json present")
    if (root / "tokenization_kimi.py").exists():
        mc.add("remote code", "info", "tokenization_kimi.py is data to k3: it is never imported")
    return mc


def _shards_present(root: Path, mc: ModelCheck) -> bool:
    index_path = root / INDEX_NAME
    if not index_path.is_file():
        if not any(root.glob("*.safetensors")):
            mc.add("shards", "fail", f"no *.safetensors files (and no {INDEX_NAME}) in {root}")
            return False
        return True
    try:
        doc = parse_json(read_capped(index_path, MAX_INDEX_BYTES))
        wm = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise ValueError("no usable weight_map")
    except (FileRejected, ValueError, JSONRejected) as exc:
        mc.add("shards", "fail", f"{index_path}: cannot be read: {exc}")
        return False
    held = Counter(wm.values())
    missing = sorted(s for s in held if not (root / s).is_file())
    if missing:
        lost = sum(held[s] for s in missing)
        mc.add("shards", "fail", f"missing {len(missing)} of {len(held)} shards named in "
                                 f"{INDEX_NAME}: {_listed([show(m) for m in missing])} ({lost} tensors); re-run "
                                 "`k3 download` to fetch them")
        return False
    return True


def _check_trunk(cfg: ModelConfig, tensors: dict[str, int], mc: ModelCheck) -> None:
    missing = [n for n in names.MODEL_TABLES if n not in tensors]
    wanted = len(names.MODEL_TABLES)
    for L in range(cfg.n_layers):
        for s in trunk_suffixes(cfg, L):
            wanted += 1
            if names.layer_name(L, s) not in tensors:
                missing.append(names.layer_name(L, s))
    if missing:
        mc.add("trunk", "fail", f"{len(missing)} of {wanted} trunk tensors missing: "
                                f"{_listed(missing)}")
    else:
        mc.add("trunk", "ok", f"all {wanted} trunk tensors and model tables present")


def _check_experts(cfg: ModelConfig, tensors: dict[str, int], mc: ModelCheck) -> None:
    missing: list[str] = []
    found = 0
    for L in range(cfg.n_layers):
        if cfg.is_dense(L):
            continue
        for e in range(cfg.n_experts):
            packed = [names.expert_name(L, e, p, f) for p in names.EXPERT_PARTS
                      for f in ("weight_packed", "weight_scale")]
            dense = [names.expert_name(L, e, p, "weight") for p in names.EXPERT_PARTS]
            if all(n in tensors for n in packed) or all(n in tensors for n in dense):
                found += 1
            else:
                missing.append(f"layer {L} expert {e}")
    total = found + len(missing)
    if missing:
        mc.add("experts", "fail", f"{len(missing)} of {total} routed experts missing or "
                                  f"incomplete: {_listed(missing)}")
    else:
        mc.add("experts", "ok", f"all {total} routed experts present")
