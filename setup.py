"""Build hook: setuptools reads pyproject.toml; compiled extensions are declared here.

Three cffi modules, all optional: when there is no C compiler, or a compile fails, the install
still succeeds and prints a warning.

* the avx2 kernel backend, built from ``backends/avx2_build.py``; ``--backend avx2`` then
  reports the missing module and how to fix it (install gcc, then ``pip install -e .``
  again). The reason is written next to where the module would have been
  (``k3_backends/_k3avx2.build-error.txt``) so the backend can say why;
* the ``bp-nib`` trunk codec's decoder, built by ``k3core/trunk/decoder_build.py:nibble``;
  without it a ``bp-nib`` trunk decodes through NumPy, to the same bytes, more slowly;
* the ``bp-bits`` trunk codec's decoder, built by ``k3core/trunk/decoder_build.py:bitcode``;
  the same holds for it.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext

ERROR_NOTE = "_k3avx2.build-error.txt"
#: what each optional module's absence costs, for the warning
WITHOUT = {
    "k3_backends._k3avx2": ("the optional avx2 kernel backend",
                            "k3 is installed and works without it (--backend numpy or numba)."),
    "k3core.trunk._k3nib": ("the bp-nib codec's compiled decoder",
                            "k3 is installed and works without it (bp-nib trunks decode through "
                            "NumPy, more slowly)."),
    "k3core.trunk._k3bits": ("the bp-bits codec's compiled decoder",
                             "k3 is installed and works without it (bp-bits trunks decode "
                             "through NumPy, more slowly)."),
}


def _reason(exc: Exception) -> str:
    """One line: which tool failed and how (the full compiler output is in the pip log)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    m = re.search(r"Command '\['([^']+)'.*returned non-zero exit status (\d+)", text)
    if m:
        return (f"the C compiler {m.group(1)} failed with exit status {m.group(2)} "
                "(pip install -v shows its output)")
    if "No such file or directory" in text or "command not found" in text:
        return f"no C compiler found ({text[:200]})"
    return text[:300]


class OptionalBuildExt(build_ext):
    """``build_ext`` that skips an extension it cannot compile instead of failing."""

    def _notes(self, ext) -> list[Path]:
        """Where the failure note goes: the build tree and, for editable installs, the source
        (only the avx2 backend reads one)."""
        if ext.name != "k3_backends._k3avx2":
            return []
        paths = [Path(self.get_ext_fullpath(ext.name)).with_name(ERROR_NOTE)]
        package = ext.name.rpartition(".")[0]
        try:
            source_dir = self.get_finalized_command("build_py").get_package_dir(package)
            paths.append(Path(source_dir or ".") / ERROR_NOTE)
        except Exception:
            pass
        return paths

    def build_extension(self, ext) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # no compiler, a compile or link error
            self._skip(ext, exc)
            return
        for note in self._notes(ext):
            if note.exists():
                note.unlink()

    def _skip(self, ext, exc: Exception) -> None:
        reason = _reason(exc)
        for i, note in enumerate(self._notes(ext)):
            # the source-tree copy only matters for editable installs; never litter otherwise
            if i and not getattr(self, "editable_mode", False):
                continue
            try:
                note.parent.mkdir(parents=True, exist_ok=True)
                note.write_text(f"{reason}\n")
            except OSError:
                pass
        bar = "=" * 78
        what, without = WITHOUT.get(ext.name, ("an optional module", "k3 works without it."))
        print(
            f"\n{bar}\nWARNING: {what} ({ext.name}) was not built:\n"
            f"  {reason}\n"
            f"{without}\n"
            "To build it: install a C compiler (gcc or clang), then reinstall: pip install -e .\n"
            f"{bar}\n",
            file=sys.stderr,
        )


# Import name -> folder. The plugin folders keep the names the product's layout gives them but
# install under ``k3_`` import names (``backends``, ``storage`` and ``caches`` are taken on PyPI).
PACKAGE_DIRS = {
    "k3": "k3",
    "k3core": "k3core",
    "k3_backends": "backends",
    "k3_storage": "storage",
    "k3_caches": "caches",
    "k3_presets": "presets",
}


def _packages() -> list[str]:
    """Every package under each folder, found by setuptools (a new subpackage needs no edit here)."""
    found = []
    for name, folder in PACKAGE_DIRS.items():
        if not Path(folder, "__init__.py").exists():
            continue
        found.append(name)
        found += [f"{name}.{sub}" for sub in find_packages(folder)]
    return found


setup(
    packages=_packages(),
    package_dir=PACKAGE_DIRS,
    cmdclass={"build_ext": OptionalBuildExt},
    cffi_modules=["backends/avx2_build.py:ffibuilder", "k3core/trunk/decoder_build.py:nibble",
                  "k3core/trunk/decoder_build.py:bitcode"],
)
