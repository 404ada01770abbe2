"""Plugin authoring mistakes said plainly: a module with no hooks, a factory that does not
import, an install hint for something installed; and ``k3 backends --check`` / ``--json``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from k3.plugin import Availability, KernelBackendSpec, PluginError, hookimpl
from k3core.plugins.registry import HOOKS, Registry

NUMPY = "k3_backends.numpy_backend:NumpyBackend"


def _registry(*plugins: tuple[str, object]) -> Registry:
    reg = Registry(entries={k: {} for k in HOOKS})
    for origin, plugin in plugins:
        reg.add_plugin(plugin, origin, origin.split("==")[0], dist=origin.split("==")[0])
    return reg


def test_a_module_without_hooks_is_broken_and_says_why() -> None:
    unmarked = SimpleNamespace(k3_cache_policies=lambda: [])  # @hookimpl forgotten
    empty = SimpleNamespace()
    reg = _registry(("unmarked==1", unmarked), ("empty==1", empty))
    reasons = {b.name: b.reason for b in reg.broken}
    assert "defines no k3 hooks: k3_cache_policies is not marked; did you forget @hookimpl" \
        in reasons["unmarked"]
    assert "defines no k3 hooks; did you forget @hookimpl" in reasons["empty"]
    with pytest.raises(PluginError, match="plugin 'unmarked' .* defines no k3 hooks"):
        reg.resolve("cache", "unmarked")


def test_check_factory_reports_each_kind_of_typo() -> None:
    specs = [KernelBackendSpec(name="ok", factory=NUMPY),
             KernelBackendSpec(name="nomodule", factory="k3_no_such_module:Backend"),
             KernelBackendSpec(name="noattr", factory="k3_backends.numpy_backend:NumpyBakend"),
             KernelBackendSpec(name="wrongclass", factory="builtins:dict")]
    reg = _registry(("typos==1", SimpleNamespace(k3_kernel_backends=hookimpl(lambda: specs))))
    assert reg.check_factory("kernel", "ok") == ""
    assert "cannot be imported" in reg.check_factory("kernel", "nomodule")
    assert "has no attribute 'NumpyBakend'" in reg.check_factory("kernel", "noattr")
    assert "not a subclass of k3core.api.kernels.KernelBackend" in \
        reg.check_factory("kernel", "wrongclass")


def test_no_install_hint_for_an_installed_distribution() -> None:
    spec = KernelBackendSpec(name="broken", factory="k3_no_such_module:B",
                             install_hint="pip install numpy",
                             probe=lambda: Availability.no("it is broken", "pip install numpy"))
    missing = KernelBackendSpec(name="missing", factory=NUMPY,
                                probe=lambda: Availability.no("absent", "pip install k3-no-such-dist"))
    reg = _registry(("hinty==1", SimpleNamespace(k3_kernel_backends=hookimpl(lambda: [spec, missing]))))
    with pytest.raises(PluginError) as err:
        reg.resolve("kernel", "broken")
    assert "pip install" not in (err.value.hint or "") and "is installed" in (err.value.hint or "")
    with pytest.raises(PluginError) as err:
        reg.resolve("kernel", "missing")
    assert err.value.hint == "pip install k3-no-such-dist"


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("authoring")
    pkg = root / "k3_typo"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "nohooks.py").write_text("def k3_kernel_backends():\n    return []\n")
    (pkg / "typo.py").write_text(
        "from k3.plugin import KernelBackendSpec, hookimpl\n\n@hookimpl\n"
        "def k3_kernel_backends():\n    return [KernelBackendSpec(name='typo', "
        "factory='k3_backends.numpy_backend:NumpyBakend', description='a [b] typo')]\n")
    info = root / "k3_typo-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: k3-typo\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[k3]\nnohooks = k3_typo.nohooks\ntypo = k3_typo.typo\n")
    return root


def _k3(plugin_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("K3_")}
    env.update(PYTHONPATH=str(plugin_path), NO_COLOR="1", TERM="dumb", COLUMNS="80")
    return subprocess.run([sys.executable, "-m", "k3core.cli", *args], env=env,
                          capture_output=True, text=True, timeout=120)


def test_backends_shows_descriptions_uncut_and_the_broken_module(plugin_path: Path) -> None:
    res = _k3(plugin_path, "backends")
    assert res.returncode == 0, res.stderr
    rows = {line.split("│")[2].strip(): line for line in res.stdout.splitlines()
            if line.count("│") > 3}
    assert "a [b] typo" in rows["typo"] and "│ available" in rows["typo"]  # not imported yet
    assert "defines no k3 hooks" in rows["nohooks"] and "did you forget @hookimpl" in rows["nohooks"]
    assert "NumPy reference: defines the bits every backend must match" in rows["numpy"]


def test_backends_check_imports_every_factory(plugin_path: Path) -> None:
    res = _k3(plugin_path, "backends", "--check")
    assert res.returncode == 1, res.stdout
    row = next(line for line in res.stdout.splitlines() if "│ typo " in line)
    assert "broken" in row and "has no attribute 'NumpyBakend'" in row
    assert "pip install" not in row
    assert "2 broken" in res.stdout


def test_backends_json(plugin_path: Path) -> None:
    res = _k3(plugin_path, "backends", "--json", "--check")
    doc = json.loads(res.stdout)
    by_name = {p["name"]: p for p in doc["plugins"]}
    assert by_name["numpy"]["status"] == "available" and by_name["numpy"]["priority"] == 0
    assert by_name["typo"]["status"] == "broken" and by_name["typo"]["description"] == "a [b] typo"
    assert by_name["nohooks"]["kind"] == "plugin" and "k3-typo==0.1" in by_name["nohooks"]["origin"]
