"""The memory ladder: the same request at trunk budgets from nothing pinned to all pinned.

Each rung runs ``k3 run --trunk DIR --trunk-gb X --incremental --out rung.json`` as a child
process under an enforced memory limit where the machine allows one: a cgroup v2 child
group with ``memory.max`` (and ``memory.swap.max`` 0) when ``/sys/fs/cgroup`` offers the
memory controller to us, otherwise ``RLIMIT_AS`` set in the child with generous headroom
for virtual address space (a Python process maps far more than it touches). Per rung it
records the budget, the pinned layers and ring, the steady-state seconds per token (step 0
excluded; median, with the mean beside it), the trunk bytes read per token, the measured peak RSS (the child's own
``ru_maxrss``), the memory plan and the generated ids; it writes ``ladder.tsv`` and
``ladder.png`` atomically and fails (exit 1) unless every rung produced the same ids.
Given a second trunk of the same model packed with a codec (``--codec-trunk``), every
budget runs from both, and the ``codec_*`` columns carry the coded trunk's time and trunk
bytes read per token beside the raw trunk's (its read seconds include the decode).

For each streaming rung it also says what bounds the time per token: the larger of the
trunk read time per token (device seconds on the reader) and the compute time per token
(wall time minus the time ``acquire`` was left waiting for a read), all over the same
steady-state steps (the child's ``--out`` carries per-step trunk figures).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import resource
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3core.api.errors import K3Error, OutputError, UsageError
from k3core.api.outputs import write_bytes_atomic
from k3core.api.units import check_gb
from k3core.model.config import ModelConfig
from k3core.model.state import kv_bytes_per_position, recurrent_bytes_per_layer

MIN_RUNGS = 6
#: extra RSS allowed over the plan under a cgroup (interpreter, numpy, experts, index)
CGROUP_HEADROOM = 2_000_000_000
#: extra virtual address space allowed over the plan under RLIMIT_AS (thread stacks, malloc
#: arenas and BLAS buffers are reserved address space that is never touched)
AS_HEADROOM = 4_000_000_000
CGROUP_ROOT = Path("/sys/fs/cgroup")
#: how a child runs the k3 command line with this interpreter
K3_CMD = [sys.executable, "-c", "from k3core.cli.app import main; main()"]


@dataclass
class Rung:
    budget_gb: float
    ok: bool = False
    error: str = ""
    pinned: int = 0
    n_layers: int = 0
    ring: int = 0
    slot_bytes: int = 0
    steps: int = 0
    step0_s: float = 0.0  # prefill step (prompt + pin load effects), excluded below
    s_per_token: float = 0.0  # steady state: median of the steps after the first
    mean_s_per_token: float = 0.0  # steady state: mean of the steps after the first
    trunk_bytes_per_token: float = 0.0
    read_s_per_token: float = 0.0
    wait_s_per_token: float = 0.0
    peak_rss: int = 0
    plan_total: int = 0
    limit_bytes: int = 0
    limit_kind: str = "none"
    ids: list[int] = field(default_factory=list)
    codec: str = "none"
    #: the same budget run from the trunk packed with a codec (``--codec-trunk``)
    coded: Rung | None = None

    @property
    def compute_s_per_token(self) -> float:
        return max(0.0, self.mean_s_per_token - self.wait_s_per_token)

    @property
    def bound(self) -> str:
        if self.ring == 0:
            return "compute (nothing streams)"
        return "trunk reads" if self.read_s_per_token >= self.compute_s_per_token else "compute"


def default_budgets(sizes: Sequence[int], n: int = 8) -> list[float]:
    """``n`` budgets (decimal GB, rounded up to the KB) from the floor (one slot, nothing
    pinned) and two slots of the floor, evenly on to everything pinned."""
    floor, total = max(sizes), sum(sizes)
    points: list[float] = [floor, 2 * floor]
    lo, hi = 2 * floor, total
    for k in range(1, n - 2):
        points.append(lo + (hi - lo) * k / (n - 2))
    points.append(total)
    return sorted({math.ceil(p / 1e3) / 1e6 for p in points if p <= total})


def parse_budgets(text: str) -> list[float]:
    out = []
    for part in text.split(","):
        try:
            v = float(part)
        except ValueError:
            raise UsageError(f"--budgets expects GB values like 0.5,1,2; got {part!r}") from None
        check_gb(v, "--budgets", positive=True)
        out.append(v)
    if len(out) < 1:
        raise UsageError("--budgets is empty")
    return sorted(set(out))


def plan_total(cfg: ModelConfig, doc: dict[str, Any], positions: int) -> int:
    """The child's own memory plan (every row, the interpreter included) when it reports one;
    else trunk plan + tables + recurrent state + KV cache, as the child reported them."""
    own = doc.get("memory_plan")
    if isinstance(own, dict) and isinstance(own.get("total"), int):
        return int(own["total"])
    trunk = int(doc.get("trunk_plan", {}).get("planned_bytes", 0))
    tables = int(doc.get("tables_resident_bytes", 0))
    n = int(doc.get("layers", cfg.n_layers))
    kda = sum(1 for L in range(n) if not cfg.is_mla(L))
    recurrent = recurrent_bytes_per_layer(cfg) * kda
    mla = n - kda
    kv = kv_bytes_per_position(cfg) * positions * mla // max(cfg.n_mla, 1)
    return trunk + tables + recurrent + kv


def fixed_bytes(cfg: ModelConfig, index: Any, positions: int) -> int:
    """What a run holds besides the trunk: tables, every routed expert (the in-memory expert
    source keeps what it loads), recurrent state and KV cache. The memory cap is the trunk
    budget plus this plus headroom."""
    from k3core.model import names

    tables = sum(index.info(n).nbytes for n in names.MODEL_TABLES if n in index)
    experts = 0
    for name in index:
        split = names.split_layer_name(name)
        if split is not None and names.is_routed_expert(split[1]):
            experts += index.info(name).nbytes
    state = recurrent_bytes_per_layer(cfg) * cfg.n_kda + kv_bytes_per_position(cfg) * positions
    return tables + experts + state


# ---- limits ---------------------------------------------------------------------------------
class _Limit:
    """How one child's memory is capped: a cgroup v2 group, RLIMIT_AS, or nothing."""

    def __init__(self, kind: str, nbytes: int, cgroup: Path | None = None):
        self.kind = kind
        self.nbytes = nbytes
        self.cgroup = cgroup

    def preexec(self) -> Callable[[], None] | None:
        if self.kind == "cgroup-v2" and self.cgroup is not None:
            procs = str(self.cgroup / "cgroup.procs")

            def enter() -> None:
                with open(procs, "w") as fh:
                    fh.write(str(os.getpid()))
            return enter
        if self.kind == "rlimit-as":
            n = self.nbytes

            def cap() -> None:
                resource.setrlimit(resource.RLIMIT_AS, (n, n))
            return cap
        return None

    def peak(self) -> int:
        if self.cgroup is not None:
            with contextlib.suppress(OSError, ValueError):
                return int((self.cgroup / "memory.peak").read_text().split()[0])
        return 0

    def close(self) -> None:
        if self.cgroup is not None:
            with contextlib.suppress(OSError):
                self.cgroup.rmdir()


def make_limit(nbytes: int, tag: str, enforce: bool = True,
               headroom: int | None = None) -> _Limit:
    """A cgroup v2 memory group if we may create one, else RLIMIT_AS with headroom."""
    if not enforce:
        return _Limit("none", 0)
    cap = nbytes + (CGROUP_HEADROOM if headroom is None else headroom)
    cg = _cgroup_v2(cap, tag)
    if cg is not None:
        return _Limit("cgroup-v2", cap, cg)
    if hasattr(resource, "RLIMIT_AS") and sys.platform.startswith("linux"):
        return _Limit("rlimit-as", nbytes + (AS_HEADROOM if headroom is None else headroom))
    return _Limit("none", 0)


def _cgroup_v2(limit: int, tag: str) -> Path | None:
    try:
        if "memory" not in (CGROUP_ROOT / "cgroup.controllers").read_text().split():
            return None
        own = ""
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                own = line[3:].strip().lstrip("/")
        parent = CGROUP_ROOT / own if own else CGROUP_ROOT
        if "memory" not in (parent / "cgroup.subtree_control").read_text().split():
            return None
        child = parent / f"k3-ladder-{os.getpid()}-{tag}"
        child.mkdir()
    except OSError:
        return None
    try:
        (child / "memory.max").write_text(str(limit))
        with contextlib.suppress(OSError):
            (child / "memory.swap.max").write_text("0")
        return child
    except OSError:
        with contextlib.suppress(OSError):
            child.rmdir()
        return None


# ---- running --------------------------------------------------------------------------------
def run_rung(
    i: int,
    budget_gb: float,
    cfg: ModelConfig,
    base_cmd: list[str],
    out_dir: Path,
    positions: int,
    limit_bytes: int,
    enforce: bool,
    timeout: float | None,
    headroom: int | None = None,
    tag: str = "",
) -> Rung:
    rung = Rung(budget_gb)
    out_json = out_dir / f"rung-{i:02d}{tag}.json"
    log = out_dir / f"rung-{i:02d}{tag}.log"
    cmd = base_cmd + ["--trunk-gb", f"{budget_gb:.6f}", "--out", str(out_json)]
    with contextlib.suppress(FileNotFoundError):
        out_json.unlink()
    limit = make_limit(limit_bytes, f"{i}", enforce, headroom)
    rung.limit_kind, rung.limit_bytes = limit.kind, limit.nbytes
    try:
        with open(log, "wb") as fh:
            proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT,
                                  preexec_fn=limit.preexec(), timeout=timeout, check=False)
        cg_peak = limit.peak()
    except subprocess.TimeoutExpired:
        rung.error = f"timed out after {timeout} s"
        return rung
    except OSError as exc:
        raise OutputError(f"cannot run rung {i} or write {log}: {exc.strerror or exc}") from None
    finally:
        limit.close()
    if proc.returncode != 0 or not out_json.is_file():
        lines = log.read_text(errors="replace").strip().splitlines() if log.is_file() else []
        first = max((k for k, line in enumerate(lines) if line.startswith("k3: error:")),
                    default=max(len(lines) - 1, 0))
        rung.error = f"exit {proc.returncode}: {' '.join(x.strip() for x in lines[first:])}"
        return rung
    doc = json.loads(out_json.read_text())
    steps = [float(x) for x in doc.get("step_seconds", [])]
    per = doc.get("step_trunk") or [{} for _ in steps]
    steady = slice(1, None) if len(steps) > 1 else slice(0, None)
    n = len(steps[steady])
    rung.ok = True
    rung.steps = len(steps)
    rung.ids = [int(t) for t in doc["generated_ids"]]
    rung.step0_s = steps[0] if steps else 0.0
    if n:
        rung.s_per_token = statistics.median(steps[steady])
        rung.mean_s_per_token = sum(steps[steady]) / n
        rung.trunk_bytes_per_token = sum(p.get("bytes", 0) for p in per[steady]) / n
        rung.read_s_per_token = sum(p.get("read_seconds", 0.0) for p in per[steady]) / n
        rung.wait_s_per_token = sum(p.get("wait_seconds", 0.0) for p in per[steady]) / n
    rung.pinned = int(doc.get("trunk_pinned_layers", 0))
    rung.n_layers = int(doc.get("trunk_layers", doc.get("layers", 0)))
    rung.ring = int(doc.get("trunk_ring_slots", 0))
    rung.codec = str(doc.get("trunk_codec", "none"))
    rung.slot_bytes = int(doc.get("trunk_slot_bytes", 0))
    rung.peak_rss = max(int(doc.get("peak_rss_bytes", 0)), cg_peak)
    rung.plan_total = plan_total(cfg, doc, positions)
    return rung


TSV_COLUMNS = ("budget_gb", "pinned_layers", "n_layers", "ring_slots", "slot_gb", "step0_s",
               "s_per_token", "mean_s_per_token", "trunk_gb_read_per_token", "trunk_read_s_per_token",
               "exposed_wait_s_per_token", "compute_s_per_token", "bound", "peak_rss_gb",
               "plan_total_gb", "limit_kind", "limit_gb", "ok", "generated_ids",
               "codec", "codec_s_per_token", "codec_trunk_gb_read_per_token",
               "codec_trunk_read_s_per_token", "codec_ok")


def tsv_text(rungs: Sequence[Rung]) -> str:
    rows = ["\t".join(TSV_COLUMNS)]
    for r in rungs:
        rows.append("\t".join([
            f"{r.budget_gb:.6f}", str(r.pinned), str(r.n_layers), str(r.ring),
            f"{r.slot_bytes / 1e9:.4f}", f"{r.step0_s:.3f}", f"{r.s_per_token:.3f}",
            f"{r.mean_s_per_token:.3f}",
            f"{r.trunk_bytes_per_token / 1e9:.4f}", f"{r.read_s_per_token:.3f}",
            f"{r.wait_s_per_token:.3f}", f"{r.compute_s_per_token:.3f}", r.bound,
            f"{r.peak_rss / 1e9:.3f}", f"{r.plan_total / 1e9:.3f}", r.limit_kind,
            f"{r.limit_bytes / 1e9:.2f}", "yes" if r.ok else f"no ({r.error})",
            ",".join(map(str, r.ids)), *_codec_cells(r.coded),
        ]))
    return "\n".join(rows) + "\n"


def _codec_cells(c: Rung | None) -> list[str]:
    if c is None:
        return ["-", "-", "-", "-", "-"]
    return [c.codec, f"{c.s_per_token:.3f}", f"{c.trunk_bytes_per_token / 1e9:.4f}",
            f"{c.read_s_per_token:.3f}", "yes" if c.ok else f"no ({c.error})"]


def write_plot(path: Path, rungs: Sequence[Rung], title: str) -> None:
    """s/token and peak RSS against the budget, written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rungs if r.ok]
    fig, ax = plt.subplots(figsize=(7.5, 4.6), dpi=120)
    x = [r.budget_gb for r in ok]
    ax.plot(x, [r.s_per_token for r in ok], "o-", color="tab:blue", label="s/token (median, steady)")
    ax.plot(x, [max(r.read_s_per_token, r.compute_s_per_token) for r in ok], "x--",
            color="tab:gray", label="max(trunk read, compute) per token (mean)")
    ax.plot(x, [r.read_s_per_token for r in ok], "v:", color="tab:green",
            label="trunk read s/token (reader thread)")
    coded = [r for r in ok if r.coded is not None and r.coded.ok]
    if coded:
        name = coded[0].coded.codec if coded[0].coded else ""
        ax.plot([r.budget_gb for r in coded], [r.coded.s_per_token for r in coded if r.coded],
                "o-", color="tab:purple", label=f"s/token, {name} trunk")
        ax.plot([r.budget_gb for r in coded],
                [r.coded.read_s_per_token for r in coded if r.coded], "v:",
                color="tab:pink", label=f"read+decode s/token, {name} trunk")
    ax.set_xlabel("--trunk-gb (GB)")
    ax.set_ylabel("seconds per token")
    ax.set_ylim(bottom=0)
    ax2 = ax.twinx()
    ax2.plot(x, [r.peak_rss / 1e9 for r in ok], "s:", color="tab:red", label="peak RSS (GB)")
    ax2.plot(x, [r.plan_total / 1e9 for r in ok], "d-.", color="tab:orange",
             label="memory plan (GB)")
    ax2.set_ylabel("GB")
    ax2.set_ylim(bottom=0)
    for r in ok:
        ax.annotate(f"{r.pinned}p/{r.ring}r", (r.budget_gb, r.s_per_token), fontsize=7,
                    textcoords="offset points", xytext=(0, 6), ha="center")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    fig.legend(h1 + h2, l1 + l2, fontsize=7, loc="lower center", ncol=3)
    fig.subplots_adjust(bottom=0.25)
    ax.set_title(title, fontsize=9)
    png = io.BytesIO()
    try:
        fig.savefig(png, format="png")
    finally:
        plt.close(fig)
    write_bytes_atomic(path, png.getvalue(), "ladder.png")


def bound_lines(rungs: Sequence[Rung]) -> list[str]:
    out = []
    for r in rungs:
        if not r.ok or r.ring == 0:
            continue
        ideal = max(r.read_s_per_token, r.compute_s_per_token)
        out.append(f"  {r.budget_gb:g} GB ({r.pinned}/{r.n_layers} pinned, ring {r.ring}): "
                   f"{r.mean_s_per_token:.3f} s/token (mean) vs max(trunk read "
                   f"{r.read_s_per_token:.3f}, compute {r.compute_s_per_token:.3f}) = "
                   f"{ideal:.3f}: bound by {r.bound}; {r.wait_s_per_token:.3f} s/token "
                   "exposed waiting for the trunk")
    return out


def check_same_ids(rungs: Sequence[Rung]) -> None:
    failed = [f"{r.budget_gb:g} GB: {r.error}" for r in rungs if not r.ok] + [
        f"{r.budget_gb:g} GB from the codec trunk: {r.coded.error}" for r in rungs
        if r.coded is not None and not r.coded.ok]
    if failed:
        raise K3Error("ladder: rung(s) failed: " + "; ".join(failed))
    first = rungs[0].ids
    for r in rungs[1:]:
        if r.ids != first:
            raise K3Error(f"ladder: the {r.budget_gb:g} GB rung generated {r.ids}, the "
                          f"{rungs[0].budget_gb:g} GB rung {first}; every budget must give "
                          "the same tokens")
    for r in rungs:
        if r.coded is not None and r.coded.ids != first:
            raise K3Error(f"ladder: the {r.budget_gb:g} GB rung from the {r.coded.codec} trunk "
                          f"generated {r.coded.ids}, the raw trunk {first}; a codec must give "
                          "the same tokens")


def write_tsv(path: Path, rungs: Sequence[Rung]) -> None:
    write_bytes_atomic(path, tsv_text(rungs).encode(), "ladder.tsv")


@dataclass(frozen=True, kw_only=True)
class LadderOptions:
    """What ``k3 bench-ladder`` was asked for (``None``: the default said beside it)."""

    model_dir: Path
    trunk_dir: Path
    budgets: str | None = None  # trunk budgets in GB, "0.2,0.4,1" (None: default_budgets)
    gen: int = 6
    ids: str = "3,7,11,5,9"
    out_dir: Path = Path("build/ladder")
    storage: str = "auto"
    backend: str = "auto"
    threads: int | None = None
    ring: int | None = None
    limit: bool = True  # cap each rung's memory
    headroom_gb: float | None = None
    timeout: float | None = None
    codec_trunk: Path | None = None
    cache_gb: float | None = None  # None: top-k + 1 slots, the smallest legal cache


def run_ladder(o: LadderOptions, say: Callable[[str], None] = print) -> list[Rung]:
    """Check the request, run every rung (and its coded twin), write ``ladder.tsv`` and
    ``ladder.png``, say what bounds each rung; refuses (exit 1) unless every rung generated
    the same ids. ``say`` hears each line of the report."""
    from k3core.api.outputs import Output, check_outputs
    from k3core.api.units import human
    from k3core.checkpoint.index import CheckpointIndex
    from k3core.experts.locator import ExpertLocator
    from k3core.model.config import load_config
    from k3core.model.sizes import slot_bytes
    from k3core.plugins.registry import get_registry
    from k3core.run.prompt import check_vocab, parse_ids
    from k3core.trunk.manifest import open_trunk
    from k3core.trunk.parts import stream_unit_sizes
    from k3core.trunk.plan import trunk_floor

    check_gb(o.headroom_gb, "--headroom-gb")
    check_gb(o.cache_gb, "--cache-gb", positive=True)
    given_budgets = parse_budgets(o.budgets) if o.budgets else None
    if o.gen < 2:
        raise UsageError(f"--gen must be >= 2 (step 0 is excluded from s/token), got {o.gen}")
    prompt = parse_ids(o.ids)
    cfg = load_config(o.model_dir / "config.json")
    check_vocab(prompt, cfg.vocab)
    cache_gb = o.cache_gb
    backend_obj, _, _ = get_registry().create("storage", o.storage, for_path=o.model_dir)
    with CheckpointIndex.open(o.model_dir, backend_obj) as index:
        man = open_trunk(o.trunk_dir, index, cfg)
        coded_man = open_trunk(o.codec_trunk, index, cfg) if o.codec_trunk is not None else None
        if coded_man is not None and not coded_man.compressed:
            raise UsageError(f"--codec-trunk {o.codec_trunk} was packed without a codec; pack "
                             "it with `k3 pack-trunk MODEL_DIR DIR --codec NAME`")
        rest = fixed_bytes(cfg, index, len(prompt) + o.gen + 1)
        if cache_gb is None:
            stride = slot_bytes(ExpertLocator(cfg, index).max_bytes(range(cfg.n_layers)))
            cache_gb = (cfg.topk + 1) * stride / 1e9 * 1.001
    sizes = [lay.nbytes for lay in man.layers[: cfg.n_layers]]
    rung_budgets = given_budgets or default_budgets(sizes)
    if len(rung_budgets) < MIN_RUNGS:
        say(f"note: {len(rung_budgets)} budgets; a ladder wants at least {MIN_RUNGS}")
    check_outputs([Output(o.out_dir, "--out-dir", directory=True,
                          files=("ladder.tsv", "ladder.png"))],
                  inputs=[(o.model_dir, "MODEL_DIR"), (o.trunk_dir, "TRUNK_DIR"),
                          (o.codec_trunk, "--codec-trunk")])
    base = [*K3_CMD, "run", str(o.model_dir), "--ids", o.ids,
            "--gen", str(o.gen), "--incremental", "--trunk", str(o.trunk_dir),
            "--storage", o.storage, "--backend", o.backend, "--cache-gb", f"{cache_gb:.6f}"]
    if o.threads is not None:
        base += ["--threads", str(o.threads)]
    if o.ring is not None:
        base += ["--trunk-ring", str(o.ring)]
    positions = len(prompt) + o.gen + 1
    headroom = None if o.headroom_gb is None else int(o.headroom_gb * 1e9)
    say(f"ladder: {len(rung_budgets)} rungs over {human(man.total_bytes)} packed "
        f"(floor {human(trunk_floor(stream_unit_sizes(man, cfg.n_layers)))}), {o.gen} tokens "
        "each, incremental")
    rungs = []
    for i, b in enumerate(rung_budgets):
        r = run_rung(i, b, cfg, base, o.out_dir, positions, int(b * 1e9) + rest, o.limit,
                     o.timeout, headroom)
        rungs.append(r)
        status = (f"{r.s_per_token:.3f} s/token, {r.pinned}/{r.n_layers} pinned, ring {r.ring}, "
                  f"{r.trunk_bytes_per_token / 1e9:.3f} GB trunk/token, peak RSS "
                  f"{r.peak_rss / 1e9:.2f} GB (plan {r.plan_total / 1e9:.2f}), "
                  f"limit {r.limit_kind}") if r.ok else f"FAILED: {r.error}"
        say(f"  rung {i}: --trunk-gb {b:g}: {status}")
        if o.codec_trunk is not None:
            coded_base = [str(o.codec_trunk) if x == str(o.trunk_dir) else x for x in base]
            c = r.coded = run_rung(i, b, cfg, coded_base, o.out_dir, positions,
                                   int(b * 1e9) + rest, o.limit, o.timeout, headroom,
                                   tag="-codec")
            status = (f"{c.s_per_token:.3f} s/token, {c.trunk_bytes_per_token / 1e9:.3f} GB "
                      f"trunk/token read, {c.read_s_per_token:.3f} s/token reading and "
                      f"decoding, peak RSS {c.peak_rss / 1e9:.2f} GB") if c.ok else (
                          f"FAILED: {c.error}")
            say(f"  rung {i}: --trunk-gb {b:g}, {c.codec} trunk: {status}")
    write_tsv(o.out_dir / "ladder.tsv", rungs)
    say(f"wrote {o.out_dir / 'ladder.tsv'}")
    ok = [r for r in rungs if r.ok]
    if ok:
        same = "same" if len({tuple(r.ids) for r in ok}) == 1 else "DIFFER"
        write_plot(o.out_dir / "ladder.png", rungs,
                   f"k3 memory ladder: {cfg.hidden} hidden x {cfg.n_layers} layers, "
                   f"{o.gen} tokens, ids {same}")
        say(f"wrote {o.out_dir / 'ladder.png'}")
    say("what bounds time per token (steady-state means, step 0 excluded):")
    for line in bound_lines(rungs):
        say(line)
    check_same_ids(rungs)
    say(f"every rung generated {','.join(map(str, rungs[0].ids))}")
    return rungs
