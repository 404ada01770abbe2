"""The plugin boundary, both ways, checked on the source (``ast``; nothing is imported).

* The engine (``k3core``) never imports a built-in plugin package: it reaches a plugin only
  through the registry, by name, as it reaches a third-party one. Reading the shipped
  preset files of ``k3_presets`` (data, not a plugin: it registers nothing) with
  ``importlib.resources`` is not an import of a plugin.
* The built-ins (``backends/``, ``storage/``, ``caches/``) and the examples
  (``examples/*/``) take from k3 only its public plugin API, ``k3.plugin`` and
  ``k3.testing``, as a third-party plugin must: nothing of ``k3core``, no other part of
  ``k3``, and no other built-in (one plugin uses another through ``k3.plugin.create``).

Both count imports at module level, inside functions, under ``TYPE_CHECKING`` and by a
literal name handed to ``importlib.import_module`` or ``__import__``.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

from imports import PACKAGE, ROOT

#: what a plugin may import from k3
PUBLIC = ("k3.plugin", "k3.testing")
#: the source folders of the built-in plugins (installed under ``k3_*`` names by setup.py)
BUILTIN_DIRS = ("backends", "storage", "caches")


def builtin_packages() -> set[str]:
    """The import names of the plugin packages k3 registers (its ``k3`` entry points)."""
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.entry-points.k3]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r'^\s*[\w-]+\s*=\s*"(\w+)', section, re.M))


def imported(path: Path) -> Iterator[tuple[int, str]]:
    """``(line, absolute module name)`` of every import in ``path``'s source; a relative
    import is named after the file's own top-level package (``.`` + the rest)."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                yield node.lineno, "." + base
            else:
                for alias in node.names:
                    yield node.lineno, f"{base}.{alias.name}" if base else alias.name
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and ast.unparse(node.func).split(".")[-1] in ("import_module", "__import__")):
            yield node.lineno, node.args[0].value


def _top(module: str) -> str:
    return module.split(".")[0]


def test_the_engine_imports_no_builtin_plugin():
    plugins = builtin_packages()
    assert {"k3_backends", "k3_storage", "k3_caches"} <= plugins
    bad = [f"{p.relative_to(ROOT)}:{line} imports {mod}"
           for p in sorted(PACKAGE.rglob("*.py"))
           for line, mod in imported(p) if _top(mod) in plugins]
    assert bad == [], "k3core reaches plugins through the registry (get_registry().create)"


def _plugin_sources() -> Iterator[tuple[Path, set[str]]]:
    """Every Python file of the built-ins and examples, with the top-level packages that
    are its own (a built-in's ``k3_*`` name; an example distribution's packages)."""
    names = {"backends": "k3_backends", "storage": "k3_storage", "caches": "k3_caches"}
    for folder in BUILTIN_DIRS:
        for p in sorted((ROOT / folder).rglob("*.py")):
            yield p, {names[folder]}
    for example in sorted(d for d in (ROOT / "examples").iterdir() if d.is_dir()):
        own = {d.name for d in example.iterdir() if (d / "__init__.py").exists()}
        for p in sorted(example.rglob("*.py")):
            yield p, own


def test_builtins_and_examples_use_only_the_public_plugin_api():
    plugins = builtin_packages()
    bad = []
    for path, own in _plugin_sources():
        for line, mod in imported(path):
            top = _top(mod)
            if top in own or mod.startswith("."):
                continue
            public = mod in PUBLIC or mod.startswith(tuple(f"{m}." for m in PUBLIC))
            if (top in ("k3", "k3core") and not public) or top in plugins:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {mod}")
    assert bad == [], (f"plugins take from k3 only {' and '.join(PUBLIC)} (export what they "
                       "need there under a public name, docs/plugins.md section 0)")


def test_the_boundary_check_sees_every_kind_of_import(tmp_path):
    """The scanner finds imports at module level, in functions, under TYPE_CHECKING and by
    name, so the two rules above cannot be passed by moving an import."""
    src = tmp_path / "m.py"
    src.write_text(
        "import k3core.api\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from k3_storage.plain import PlainStorage\n"
        "def f():\n"
        "    from k3core.experts import trace\n"
        "    import importlib\n"
        "    return importlib.import_module('k3_backends.avx2_probe')\n"
        "from . import sibling\n"
    )
    found = {mod for _, mod in imported(src)}
    assert {"k3core.api", "k3_storage.plain.PlainStorage", "k3core.experts.trace",
            "k3_backends.avx2_probe", "."} <= found


def test_every_public_plugin_name_resolves_and_the_trace_readers_load_on_first_use():
    """Each name ``k3.plugin`` and ``k3.testing`` list is there (the lazy ones too), and
    importing ``k3.plugin`` loads no trace reader (nor what it needs) until one is asked for."""
    import subprocess
    import sys

    probe = ("import sys, k3.plugin\n"
             "loaded = sorted(m for m in sys.modules if m.startswith('k3core.experts'))\n"
             "import k3.plugin as P, k3.testing as T\n"
             "missing = [n for m in (P, T) for n in m.__all__ if getattr(m, n, None) is None]\n"
             "print(loaded, missing)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["[]", "[]"], out.stdout
