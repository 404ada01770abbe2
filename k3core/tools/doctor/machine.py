"""``k3 doctor``: can this machine run the model, with what preset, and what to type next.

Sections: toolchain (Python, a C compiler for the compiled backends), plugins (every kernel,
storage and cache plugin and why one is unavailable), CPU (cores, AVX2/FMA/AVX-512), memory
(total, available, the preset that fits), disk (free space against the checkpoint and the
packed trunk, read bandwidth measured the way the engine reads, see
:mod:`k3core.tools.doctor.disk_probe`, and each preset rated on memory and that bandwidth
together), and given a model directory its completeness (:mod:`k3core.tools.doctor.model`)
and whether even the ultra-low-memory floor fits.

The facts are gathered first (memory, the model's sizes, the bandwidth); every verdict is
then one pure function of them (:func:`k3core.tools.doctor.verdict.judge`), so the memory
line, each preset's line, the ``fit`` section and the next command agree, and they are
scaled to the model given (a model that fits whole in memory is told to run resident: no
packed trunk, no preset).

Only blocking problems are ``fail`` (exit 1): an incomplete model directory, or a machine
that cannot run the model at all. Everything else is a warning, and the result line counts
the warnings. ``progress`` (the CLI prints it on stderr) hears what is being probed while it
is, including the scratch file the bandwidth probe writes when there is no shard to read.
"""

from __future__ import annotations

import os
import platform
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from k3core.api.units import human
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.model.sizes import sizes_from_config
from k3core.plugins.registry import KIND_WORDS, Registry, get_registry
from k3core.run.memory_plan import process_rss
from k3core.tools.doctor.disk_probe import (
    DEFAULT_PROBE_BYTES,
    DiskMeasure,
    default_measure,
    remove_probe_file,
    write_probe_file,
)
from k3core.tools.doctor.model import Check, ModelCheck, Status, check_model
from k3core.tools.doctor.needs import checkpoint_bytes, packed_trunk_bytes, released_sizes
from k3core.tools.doctor.verdict import MachineFacts, ModelFacts, Verdict, judge

Progress = Callable[[str], None]

GIB = 1 << 30
REFERENCE_PROMPT = "The capital of France is"
REFERENCE_IDS = (1008, 10484, 318, 15383, 387)


@dataclass
class DoctorReport:
    checks: list[Check] = field(default_factory=list)
    #: the recommended preset (None: the model runs resident without one, or none fits)
    preset: str | None = None
    next_commands: list[str] = field(default_factory=list)
    model: ModelCheck | None = None
    verdict: Verdict | None = None

    def add(self, section: str, name: str, status: Status, detail: str) -> None:
        self.checks.append(Check(section, name, status, detail))

    @property
    def failed(self) -> bool:
        return any(c.status == "fail" for c in self.checks)

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0

    @property
    def warnings(self) -> int:
        return sum(c.status == "warn" for c in self.checks)

    @property
    def result(self) -> str:
        return "fail" if self.failed else "ready" if self.next_commands else "ok"

    def to_json(self) -> dict[str, Any]:
        v = self.verdict
        return {"result": self.result, "exit_code": self.exit_code,
                "warnings": self.warnings, "preset": self.preset,
                "resident": v.resident if v is not None else False,
                "verdict": v.to_json() if v is not None else None,
                "next_commands": list(self.next_commands),
                "checks": [{"section": c.section, "name": c.name, "status": c.status,
                            "detail": c.detail} for c in self.checks]}


def check_toolchain(r: DoctorReport) -> None:
    v = sys.version_info
    ok = v >= (3, 10)
    r.add("toolchain", "python", "ok" if ok else "fail",
          f"Python {platform.python_version()} ({sys.executable})"
          + ("" if ok else "; k3 needs Python 3.10 or newer"))
    for cc in ("cc", "gcc", "clang"):
        path = shutil.which(cc)
        if path is None:
            continue
        try:
            out = subprocess.run([path, "--version"], capture_output=True, text=True,
                                 timeout=10, check=False).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        first = out.strip().splitlines()[0] if out.strip() else path
        r.add("toolchain", "C compiler", "ok", f"{cc}: {first}")
        return
    r.add("toolchain", "C compiler", "warn", "none found (cc, gcc, clang): compiled kernel "
          "backends cannot be built; the numpy backend still works")


def check_plugins(r: DoctorReport, reg: Registry) -> None:
    for kind, word in KIND_WORDS.items():
        names = reg.names(kind)
        if not names:
            r.add("plugins", word, "info", "none registered")
        for name in names:
            a = reg.probe(kind, name)
            detail = "available" if a.ok else f"unavailable: {a.reason}" + (
                f" (fix: {a.hint})" if a.hint else "")
            r.add("plugins", f"{word} {name}", "ok" if a.ok else "warn", detail)
    for b in reg.broken:
        r.add("plugins", f"plugin {b.name}", "warn", f"broken: {b.reason} ({b.origin})")


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str] | None:
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        return None
    return set()


def check_cpu(r: DoctorReport) -> None:
    phys = psutil.cpu_count(logical=False)
    r.add("cpu", "cores", "ok", f"{os.cpu_count()} logical, {phys or '?'} physical "
          f"({platform.machine()})")
    flags = cpu_flags()
    if flags is None:
        r.add("cpu", "features", "info", "unknown (no /proc/cpuinfo on this system)")
        return
    have = {f: f in flags for f in ("avx2", "fma", "avx512f")}
    r.add("cpu", "AVX2 + FMA", "ok" if have["avx2"] and have["fma"] else "warn",
          "present" if have["avx2"] and have["fma"] else
          "absent: the avx2 kernel backend will refuse to load; numpy/numba still work")
    r.add("cpu", "AVX-512", "info", "present" if have["avx512f"] else "absent (not needed)")


def check_memory(r: DoctorReport, total: int, available: int, v: Verdict) -> None:
    """Total and available memory, and the one preset (or the resident run) that fits."""
    r.add("memory", "RAM", "ok", f"{human(total)} total, {human(available)} available "
          f"({available / GIB:.1f} GiB)")
    r.add("memory", "resident" if v.resident else "preset", v.memory_status, v.memory_detail)
    r.preset = v.preset


def check_disk(r: DoctorReport, where: Path, probe_target: Path | None,
               measure: DiskMeasure | None, how: str, probe_bytes: int,
               probe_dir: Path | None = None, progress: Progress | None = None,
               on_bytes: Callable[[int, int], None] | None = None) -> float:
    """Free space at ``where`` and the measured bandwidth; returns the best MB/s (0: none).
    ``on_bytes(written, total)`` hears the scratch file being written."""
    say = progress or (lambda msg: None)
    try:
        free = shutil.disk_usage(where).free
        r.add("disk", "free space", "ok", f"{human(free)} free at {where}")
    except OSError as exc:
        r.add("disk", "free space", "warn", f"cannot stat {where}: {exc.strerror or exc}")
    if measure is None:
        return 0.0
    scratch = None
    try:
        if probe_target is None:
            folder = probe_dir or where
            say(f"writing a {human(probe_bytes)} scratch file in {folder} for the read probe "
                "(removed afterwards; --probe-dir DIR puts it elsewhere, --no-disk-probe "
                "skips it)")
            scratch = probe_target = write_probe_file(folder, probe_bytes, on_bytes)
        say(f"probing read bandwidth on {probe_target} (up to {human(probe_bytes)}) ...")
        results = measure(probe_target)
    except OSError as exc:
        r.add("disk", "read bandwidth", "warn", f"not measured: {exc.strerror or exc}")
        return 0.0
    finally:
        if scratch is not None:
            remove_probe_file(scratch)
    if not results:
        r.add("disk", "read bandwidth", "info", f"not measured: {probe_target} is too small")
    where_read = f"scratch file in {probe_target.parent}, removed" if scratch else str(probe_target)
    for mode, depth, mbs in results:
        r.add("disk", f"read {mode} QD{depth}", "ok", f"{mbs:,.0f} MB/s ({how}; {where_read})")
    return max((mbs for _, _, mbs in results), default=0.0)


def check_space(r: DoctorReport, mc: ModelCheck | None, root: Path | None,
                resident: bool = False) -> None:
    """Room for the checkpoint (when none is given) and for the packed trunk (unless the
    model runs resident: then it needs no packed trunk)."""
    sz = mc.sizes if mc is not None and mc.sizes is not None else None
    trunk = packed_trunk_bytes(sz or released_sizes())
    if sz is None:  # no model yet: room to download Kimi K3 and pack its trunk here
        here = Path.cwd()
        need = checkpoint_bytes(released_sizes())
        free = _free(here)
        if free is None:
            return
        ok = free >= need + trunk
        r.add("disk", "room for Kimi K3", "ok" if ok else "warn",
              f"{human(free)} free at {here}; the checkpoint is {human(need)} and its packed "
              f"trunk {human(trunk)}" + ("" if ok else
                                        ": not enough here; download to a larger disk"))
        return
    assert root is not None
    if resident:
        return
    target = root.resolve().parent  # `k3 pack-trunk MODEL MODEL-trunk` writes beside it
    free = _free(target)
    if free is None:
        return
    ok = free >= trunk
    r.add("disk", "room for the trunk", "ok" if ok else "warn",
          f"packing the trunk writes {human(trunk)} into {target}; {human(free)} is free there"
          + ("" if ok else ": pack it onto another disk (k3 pack-trunk MODEL_DIR OTHER_DIR)"))


def rate_presets(r: DoctorReport, v: Verdict) -> None:
    """Each preset on memory and read speed together (:func:`judge`); one line when the
    model runs resident (nothing streams)."""
    if v.resident:
        r.add("disk", "reads per token", "ok", "none once loaded: the whole model stays in "
              "memory (trunk resident, every expert cached), so the presets' streaming does "
              "not apply")
        return
    for p in v.presets:
        r.add("disk", f"preset {p.name}", p.status, p.detail)


def check_fit(r: DoctorReport, v: Verdict) -> None:
    """Fail when not even the ultra-low-memory floor fits; say what the recommendation plans."""
    avail = human(v.available)
    if not v.floor_fits:
        r.add("fit", "ultra floor", "fail", f"even --preset ultra plans {human(v.floor_planned)} "
              f"and {avail} is available: this machine cannot run this model")
        return
    r.add("fit", "ultra floor", "ok", f"--preset ultra plans {human(v.floor_planned)}")
    if v.resident:
        r.add("fit", "resident", "ok", f"plans {human(v.resident_planned)} of {avail} available "
              "(trunk resident, every expert cached)")
        return
    pv = v.preset_verdict(v.preset) if v.preset is not None else None
    if pv is None:
        r.add("fit", "presets", "warn", f"none of the presets fits in {avail} available (see "
              "memory above)")
        return
    r.add("fit", f"preset {pv.name}", "ok", f"plans {human(pv.planned)} of {avail} available")


def next_commands(model_dir: Path, preset: str | None, mc: ModelCheck) -> list[str]:
    """Pack the trunk and run with ``preset``; with ``None`` (the model runs resident) just
    run it."""
    model = str(model_dir).rstrip("/") or "/"
    trunk = model + "-trunk"
    q = shlex.quote
    if preset is None:
        cmds, run = [], f"k3 run {q(model)}"
    else:
        cmds = [f"k3 pack-trunk {q(model)} {q(trunk)}"]
        run = f"k3 run {q(model)} --trunk {q(trunk)} --preset {preset}"
    if mc.has_tokenizer:
        run += f" --tok {q(model)} --prompt {q(REFERENCE_PROMPT)}"
    else:
        vocab = mc.cfg.vocab if mc.cfg else 0
        ids = REFERENCE_IDS if max(REFERENCE_IDS) < vocab else tuple(
            i % max(vocab, 1) for i in (3, 7, 11, 5, 9))
        run += f" --ids {','.join(map(str, ids))}"
    cmds.append(run + " --gen 8 --incremental")
    return cmds


def run_doctor(model_dir: str | Path | None = None, *, measure: DiskMeasure | None = None,
               probe_bytes: int = DEFAULT_PROBE_BYTES, disk_probe: bool = True,
               storage: str = "auto", registry: Registry | None = None,
               total: int | None = None, available: int | None = None,
               baseline: int | None = None, probe_dir: Path | None = None,
               progress: Progress | None = None,
               steps: Callable[[str, int, int], None] | None = None) -> DoctorReport:
    """Run every check. ``measure``/``total``/``available``/``baseline`` are injectable.
    ``steps(stage, done, total)`` hears the ``checks`` done, the ``scratch file``'s bytes
    written and the ``read tests`` done."""
    say = progress or (lambda msg: None)
    step = steps or (lambda stage, done, total: None)
    r = DoctorReport()
    reg = registry or get_registry()
    vm = psutil.virtual_memory()
    tot = int(vm.total) if total is None else total
    avail = int(vm.available) if available is None else available
    n_checks = 5 if model_dir is not None else 4
    step("checks", 0, n_checks)
    check_toolchain(r)
    step("checks", 1, n_checks)
    check_plugins(r, reg)
    step("checks", 2, n_checks)
    check_cpu(r)
    step("checks", 3, n_checks)
    how = "injected"
    if disk_probe and measure is None:
        measure, how = default_measure(
            probe_bytes, on_test=lambda done, total: step("read tests", done, total))
    root = Path(model_dir) if model_dir is not None else None
    mc = None
    if root is not None:
        say(f"checking the model directory {root} ...")
        backend, _, _ = reg.create("storage", storage, for_path=root)
        mc = check_model(root, backend)
        r.model = mc
        step("checks", 4, n_checks)
    largest = _largest_shard(root) if root is not None and root.is_dir() else None
    where = root if root is not None and root.is_dir() else Path.cwd()
    disk = DoctorReport()  # measured now, printed after the memory and model sections
    best = check_disk(disk, where, largest, measure if disk_probe else None, how, probe_bytes,
                      probe_dir, say, lambda done, total: step("scratch file", done, total))
    from k3core.run.presets import list_presets

    machine = MachineFacts(tot, avail, best, process_rss() if baseline is None else baseline)
    v = judge(machine, model_facts(mc), list_presets(on_error=lambda e: None))
    r.verdict = v
    check_memory(r, tot, avail, v)
    step("checks", n_checks, n_checks)
    if mc is not None:
        r.checks.extend(mc.checks)
    r.checks.extend(disk.checks)
    sized = mc is not None and mc.sizes is not None
    check_space(r, mc if sized else None, root if sized else None, v.resident)
    rate_presets(r, v)
    if mc is not None and mc.sizes is not None and root is not None:
        check_fit(r, v)
        if mc.complete and not r.failed and (v.resident or v.preset is not None):
            r.next_commands = next_commands(root, v.preset, mc)
    return r


def model_facts(mc: ModelCheck | None) -> ModelFacts:
    """The model given (its counted sizes, else planned from its config), else Kimi K3."""
    if mc is not None and mc.cfg is not None:
        return ModelFacts(mc.cfg, mc.sizes or sizes_from_config(mc.cfg), True)
    cfg = ModelConfig.from_json_dict(size_config("real"), source="Kimi K3")
    return ModelFacts(cfg, released_sizes(), False)


def _largest_shard(root: Path) -> Path | None:
    try:
        shards = [p for p in root.glob("*.safetensors") if p.is_file()]
    except OSError:
        return None
    return max(shards, key=lambda p: p.stat().st_size, default=None)


def _free(where: Path) -> int | None:
    try:
        return shutil.disk_usage(where).free
    except OSError:
        return None
