"""``k3 doctor``: can this machine run the model, with what preset, and what to type next.

Sections: toolchain (Python, a C compiler for the compiled backends), plugins (every kernel,
storage and cache plugin and why one is unavailable), CPU (cores, AVX2/FMA/AVX-512), memory
(total, available, the preset that fits), disk (free space against the checkpoint and the
packed trunk, read bandwidth measured the way the engine reads, see
:mod:`k3core.tools.doctor.disk_probe`, and what that bandwidth means for each preset, see
:mod:`k3core.tools.doctor.needs`), and given a model directory its completeness
(:mod:`k3core.tools.doctor.model`) and whether even the ultra-low-memory floor fits.

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

from k3core.api.units import align_up, human
from k3core.plugins.registry import KIND_WORDS, Registry, get_registry
from k3core.run.memory_plan import MemoryRequest, plan_memory
from k3core.tools.doctor.disk_probe import (
    DEFAULT_PROBE_BYTES,
    DiskMeasure,
    default_measure,
    remove_probe_file,
    write_probe_file,
)
from k3core.tools.doctor.model import Check, ModelCheck, Status, check_model
from k3core.tools.doctor.needs import (
    SLOW_SECONDS_PER_TOKEN,
    checkpoint_bytes,
    packed_trunk_bytes,
    preset_reads,
    released_sizes,
)

Progress = Callable[[str], None]

GIB = 1 << 30
#: the reference doctor's MemAvailable (GiB) -> preset mapping
RAM_PRESETS = ((192, "server"), (96, "workstation"), (32, "desktop"), (10, "laptop"))
REFERENCE_PROMPT = "The capital of France is"
REFERENCE_IDS = (1008, 10484, 318, 15383, 387)


@dataclass
class DoctorReport:
    checks: list[Check] = field(default_factory=list)
    preset: str = "ultra"
    next_commands: list[str] = field(default_factory=list)
    model: ModelCheck | None = None

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
        return {"result": self.result, "exit_code": self.exit_code,
                "warnings": self.warnings, "preset": self.preset,
                "next_commands": list(self.next_commands),
                "checks": [{"section": c.section, "name": c.name, "status": c.status,
                            "detail": c.detail} for c in self.checks]}


def preset_for_memory(available: int) -> str | None:
    """The reference mapping: the biggest preset whose MemAvailable threshold is met."""
    for gib, name in RAM_PRESETS:
        if available >= gib * GIB:
            return name
    return None


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


def check_memory(r: DoctorReport, total: int, available: int) -> None:
    preset = preset_for_memory(available)
    r.add("memory", "RAM", "ok", f"{human(total)} total, {human(available)} available "
          f"({available / GIB:.1f} GiB)")
    if preset is None:
        r.add("memory", "preset", "warn", f"{available / GIB:.1f} GiB available is below the "
              "10 GiB floor of the ordinary path: only --preset ultra can run Kimi K3 here "
              "(building and testing still work)")
        r.preset = "ultra"
    else:
        r.add("memory", "preset", "ok", f"fits --preset {preset} (reference mapping: >=192 GiB "
              "server, >=96 workstation, >=32 desktop, >=10 laptop)")
        r.preset = preset


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


def check_space(r: DoctorReport, mc: ModelCheck | None, root: Path | None) -> None:
    """Room for the checkpoint (when none is given) and for the packed trunk."""
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
    target = root.resolve().parent  # `k3 pack-trunk MODEL MODEL-trunk` writes beside it
    free = _free(target)
    if free is None:
        return
    ok = free >= trunk
    r.add("disk", "room for the trunk", "ok" if ok else "warn",
          f"packing the trunk writes {human(trunk)} into {target}; {human(free)} is free there"
          + ("" if ok else ": pack it onto another disk (k3 pack-trunk MODEL_DIR OTHER_DIR)"))


def rate_bandwidth(r: DoctorReport, mbs: float, mc: ModelCheck | None) -> None:
    """Each shipped preset's reads per token against the measured bandwidth."""
    if mbs <= 0:
        return
    from k3core.run.presets import list_presets

    sz = mc.sizes if mc is not None and mc.sizes is not None else released_sizes()
    which = "this model" if mc is not None and mc.sizes is not None else "Kimi K3"
    for p in list_presets(on_error=lambda e: None):
        need = preset_reads(p, sz)
        secs = need.seconds_at(mbs)
        slow = secs > SLOW_SECONDS_PER_TOKEN
        r.add("disk", f"preset {p.name}", "warn" if slow else "ok",
              f"{which} reads ~{human(need.total)} per token ({need.pinned_layers}/"
              f"{need.n_layers} trunk layers pinned; trunk {human(need.trunk_bytes)}, experts "
              f"~{human(need.expert_bytes)} if routing were uniform): at {mbs:,.0f} MB/s that "
              f"is >= {secs:.1f} s/token of reading" + (" (slow)" if slow else ""))


def check_fit(r: DoctorReport, mc: ModelCheck, available: int, baseline: int | None) -> None:
    """Fail when not even the ultra-low-memory floor fits; say whether the preset does."""
    cfg, sz = mc.cfg, mc.sizes
    if cfg is None or sz is None:
        return
    floor = plan_memory(cfg, MemoryRequest(
        streamed=True, trunk_budget=align_up(sz.largest_layer),
        cache_bytes=(sz.topk + 1) * sz.expert_slot_bytes, prompt_len=32, gen=8,
        incremental=False, ultra=True), sizes=sz, available=available, baseline=baseline)
    if not floor.fits():
        r.add("fit", "ultra floor", "fail", f"even --preset ultra plans {human(floor.total)} and "
              f"{human(available)} is available: this machine cannot run this model")
        return
    r.add("fit", "ultra floor", "ok", f"--preset ultra plans {human(floor.total)}")
    from k3core.run.presets import load_preset

    p = load_preset(r.preset)
    plan = plan_memory(cfg, MemoryRequest(
        streamed=True, trunk_budget=p.trunk_bytes, cache_bytes=p.cache_bytes, prompt_len=32,
        gen=8, incremental=True, ultra=p.ultra_low_memory), sizes=sz, available=available,
        baseline=baseline)
    status: Status = "ok" if plan.fits() else "warn"
    r.add("fit", f"preset {p.name}", status, f"plans {human(plan.total)} of {human(available)} "
          "available" + ("" if plan.fits() else "; use --preset ultra or auto"))
    if not plan.fits():
        r.preset = "ultra"


def next_commands(model_dir: Path, preset: str, mc: ModelCheck) -> list[str]:
    model = str(model_dir).rstrip("/") or "/"
    trunk = model + "-trunk"
    q = shlex.quote
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
    check_memory(r, tot, avail)
    step("checks", 4, n_checks)
    how = "injected"
    if disk_probe and measure is None:
        measure, how = default_measure(
            probe_bytes, on_test=lambda done, total: step("read tests", done, total))
    root = Path(model_dir) if model_dir is not None else None
    mc = None
    if root is not None:
        say(f"checking the model directory {root} ...")
        backend, _, _ = reg.create("storage", storage)
        mc = check_model(root, backend)
        r.model = mc
        r.checks.extend(mc.checks)
        step("checks", 5, n_checks)
    largest = _largest_shard(root) if root is not None and root.is_dir() else None
    where = root if root is not None and root.is_dir() else Path.cwd()
    best = check_disk(r, where, largest, measure if disk_probe else None, how, probe_bytes,
                      probe_dir, say, lambda done, total: step("scratch file", done, total))
    check_space(r, mc if mc is not None and mc.sizes is not None else None,
                root if mc is not None and mc.sizes is not None else None)
    rate_bandwidth(r, best, mc)
    if mc is not None and mc.sizes is not None and root is not None:
        check_fit(r, mc, avail, baseline)
        if mc.complete and not r.failed:
            r.next_commands = next_commands(root, r.preset, mc)
    return r


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
