"""Can the avx2 kernel backend run here? Checked in an order that never crashes the process.

1. The CPU: AVX2 and FMA must be present, checked WITHOUT executing any AVX2 code (the
   compiled module is built with ``-mavx2``; loading it on an older CPU could die with
   SIGILL). Linux reads the ``flags`` line of ``/proc/cpuinfo``; macOS asks ``sysctl``
   (``machdep.cpu.features`` / ``machdep.cpu.leaf7_features``); any other system, or a
   non-x86-64 machine, is reported as not supported.
2. The compiled module ``k3_backends._k3avx2`` (built by ``pip install``): it must import,
   and the contract constants it was compiled with must equal ``k3core.api.contract`` today
   (an editable checkout whose contract changed after the build is refused as stale).
"""

from __future__ import annotations

import importlib
import platform
import subprocess
from pathlib import Path

from k3.plugin import Availability

COMPILED_MODULE = "k3_backends._k3avx2"
BUILD_ERROR_NOTE = "_k3avx2.build-error.txt"
REQUIRED_FLAGS = ("avx2", "fma")
CPU_HINT = "use --backend numba or numpy"
BUILD_HINT = "install gcc and reinstall: pip install -e ."
_X86 = {"x86_64", "amd64", "x64", "i386", "i686"}


def cpu_flags() -> set[str] | None:
    """The CPU feature flags (lower case), or None when this system cannot be asked."""
    machine = platform.machine().lower()
    if machine and machine not in _X86:
        return set()
    system = platform.system()
    if system == "Linux":
        try:
            text = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return None
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "flags":
                return set(value.lower().split())
        return None
    if system == "Darwin":
        flags: set[str] = set()
        for key in ("machdep.cpu.features", "machdep.cpu.leaf7_features"):
            try:
                out = subprocess.run(
                    ["sysctl", "-n", key], capture_output=True, text=True, timeout=5, check=False
                ).stdout
            except (OSError, subprocess.SubprocessError):
                return None
            flags |= set(out.lower().split())
        return flags or None
    return None


def check_cpu(flags: set[str] | None = None) -> Availability:
    """AVX2 and FMA present (``flags`` may be given to test the logic)."""
    if flags is None:
        flags = cpu_flags()
    if flags is None:
        return Availability.no(
            f"cannot check this CPU for AVX2/FMA on {platform.system() or 'this system'} "
            f"({platform.machine() or 'unknown machine'})",
            CPU_HINT,
        )
    missing = [f for f in REQUIRED_FLAGS if f not in flags]
    if missing:
        have = [f for f in REQUIRED_FLAGS if f in flags]
        machine = platform.machine() or "unknown"
        detail = f"missing {', '.join(missing)}" + (f"; has {', '.join(have)}" if have else "")
        return Availability.no(f"CPU lacks AVX2/FMA (flags: {detail}; machine {machine})", CPU_HINT)
    return Availability.yes()


def _build_error() -> str | None:
    """The reason recorded by setup.py when the compile failed at install time."""
    try:
        import k3_backends

        note = Path(k3_backends.__file__).with_name(BUILD_ERROR_NOTE)
        text = note.read_text().strip()
    except (OSError, ImportError, TypeError):
        return None
    return (text[:300] + "...") if len(text) > 300 else text or None


def contract_values() -> list[float]:
    """``k3core.api.contract`` in the order ``k3_contract_values`` reports it."""
    from k3.plugin import contract as C

    head = [C.LANES, C.MXFP4_GROUP, C.EXP_HI, C.EXP_LO, C.LOG2E, C.LN2_HI, C.LN2_LO,
            C.EXPM1_SERIES_MAX, C.TANH_SAT, C.L2_EPS, C.ROUTER_EPS]
    return [float(v) for v in (*head, *C.EXP_COEF, *C.EXPM1_COEF, *C.E2M1, *C.E8M0)]


def load_module():
    """Import the compiled module (call only after :func:`check_cpu` said yes)."""
    return importlib.import_module(COMPILED_MODULE)


def check_module() -> Availability:
    """The compiled module imports and was built for today's contract."""
    try:
        mod = load_module()
    except ImportError as exc:
        noted = _build_error()
        reason = f"the build failed at install: {noted}" if noted else str(exc)
        return Availability.no(f"compiled module {COMPILED_MODULE} is missing ({reason})", BUILD_HINT)
    want = contract_values()
    buf = mod.ffi.new("double[]", len(want) + 1)
    n = mod.lib.k3_contract_values(buf, len(want) + 1)
    got = [float(buf[i]) for i in range(min(n, len(want)))]
    if n != len(want) or [v.hex() for v in got] != [v.hex() for v in want]:
        return Availability.no(
            f"compiled module {COMPILED_MODULE} is stale (built for a different kernel "
            "contract than k3core/api/contract.py)",
            "reinstall: pip install -e .",
        )
    return Availability.yes()


def probe() -> Availability:
    """The registry's probe: CPU first (never SIGILL), then the compiled module."""
    cpu = check_cpu()
    if not cpu.ok:
        return cpu
    return check_module()
