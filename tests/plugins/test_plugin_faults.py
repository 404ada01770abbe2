"""Hostile third-party plugins, found through the real discovery path.

A temporary directory on ``PYTHONPATH`` holds a package ``k3_dummy`` and the
``k3_dummy-0.1.dist-info`` that ``importlib.metadata`` reads (``METADATA`` and an
``entry_points.txt`` in the ``k3`` group), exactly what ``pip install`` would leave, without
touching the virtual environment. Every command runs as a subprocess so discovery starts
fresh: a plugin that raises or exits at import, hooks returning nonsense, probes that raise
or return nonsense, a factory that builds the wrong thing. ``k3 backends`` must still work
and name each broken plugin and where it comes from; choosing one exits 2 with the reason;
the other backends (and a well-behaved third-party one) keep working; and
``K3_DISABLE_PLUGINS=1`` makes every third-party plugin disappear.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.tools.synth.writer import synthesize

DIST = "k3-dummy==0.1"

_MODULES = {
    "__init__": "",
    "raising": "raise RuntimeError('boom at import [/] [red]x')\n",
    "exiting": "import sys\nsys.exit(3)\n",
    "notlist": "from k3core.api.hookspecs import hookimpl\n\n"
               "@hookimpl\ndef k3_kernel_backends():\n    return 42\n",
    "notspecs": "from k3core.api.hookspecs import hookimpl\n\n"
                "@hookimpl\ndef k3_kernel_backends():\n    return ['junk', {'name': 'x'}, None]\n",
    "hookraises": "from k3core.api.hookspecs import hookimpl\n\n"
                  "@hookimpl\ndef k3_storage_backends():\n    raise ValueError('hook failed')\n",
    "specs": """\
from k3core.api.hookspecs import hookimpl
from k3core.api.specs import Availability, KernelBackendSpec, StorageBackendSpec

NUMPY = "k3_backends.numpy_backend:NumpyBackend"


def _raises():
    raise RuntimeError("probe exploded")


@hookimpl
def k3_kernel_backends():
    return [
        KernelBackendSpec(name="badprobe", factory=NUMPY, probe=_raises),
        KernelBackendSpec(name="nonsenseprobe", factory=NUMPY, probe=lambda: "yes"),
        KernelBackendSpec(name="markup", factory=NUMPY,
                          probe=lambda: Availability.no("[/] [red]not[/red] here")),
        KernelBackendSpec(name="wrongclass", factory="builtins:dict"),
        KernelBackendSpec(name="badpriority", factory=NUMPY, priority="high"),
        StorageBackendSpec(name="wrongkind", factory="k3_storage.plain:PlainStorage"),
    ]


@hookimpl
def k3_storage_backends():
    return [StorageBackendSpec(name="dummy-plain", factory="k3_storage.plain:PlainStorage",
                               description="a well-behaved third-party backend")]
""",
}
_ENTRY_POINTS = ["raising", "exiting", "notlist", "notspecs", "hookraises", "specs"]


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("plugins")
    pkg = root / "k3_dummy"
    pkg.mkdir()
    for name, text in _MODULES.items():
        (pkg / f"{name}.py").write_text(text)
    info = root / "k3_dummy-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: k3-dummy\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[k3]\n" + "".join(f"{n} = k3_dummy.{n}\n" for n in _ENTRY_POINTS))
    return root


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return synthesize(tmp_path_factory.mktemp("plugmodel") / "tiny",
                      ModelConfig.from_json_dict(size_config("tiny")), 2)


def k3(plugin_path: Path, *args: object, disable: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("K3_")}
    env.update(PYTHONPATH=str(plugin_path), COLUMNS="1000", NO_COLOR="1", TERM="dumb")
    if disable:
        env["K3_DISABLE_PLUGINS"] = "1"
    return subprocess.run([sys.executable, "-m", "k3core.cli", *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=120)


def _flat(res: subprocess.CompletedProcess) -> str:
    return " ".join((res.stdout + res.stderr).split())


def test_backends_lists_every_broken_plugin_with_its_origin(plugin_path) -> None:
    res = k3(plugin_path, "backends")
    out = _flat(res)
    assert res.returncode == 0, out
    assert "Traceback" not in out
    def rows(name: str) -> list[str]:
        return [line for line in res.stdout.splitlines() if f"│ {name} " in line]

    for name, reason in [
        ("raising", "failed to import: RuntimeError('boom at import [/] [red]x')"),
        ("exiting", "failed to import: SystemExit(3)"),
        ("notlist", "k3_kernel_backends() returned 42, not a list of specs"),
        ("notspecs", "returned something that is not a spec: 'junk'"),
        ("notspecs", "returned something that is not a spec: {'name': 'x'}"),
        ("hookraises", "k3_storage_backends() raised ValueError('hook failed')"),
        ("specs", "returned the storage spec 'wrongkind' from the kernel hook"),
        ("specs", "returned spec 'badpriority' whose priority 'high' is not an integer"),
    ]:
        assert any("broken" in r and reason in r and f"{DIST} (k3_dummy.{name})" in r
                   for r in rows(name)), (name, reason, res.stdout)
    assert "its probe raised RuntimeError('probe exploded')" in rows("badprobe")[0]
    assert "its probe returned 'yes', not an Availability" in rows("nonsenseprobe")[0]
    assert "unavailable: [/] [red]not[/red] here" in rows("markup")[0]  # printed, not markup
    assert "│ available" in rows("dummy-plain")[0] and DIST in rows("dummy-plain")[0]
    assert "│ available" in rows("numpy")[0] and "k3==" in rows("numpy")[0]


@pytest.mark.parametrize("args, needle", [
    (["--backend", "raising"], f"plugin 'raising' from {DIST} (k3_dummy.raising) failed to "
                               "import: RuntimeError('boom at import"),
    (["--backend", "notlist"], "k3_kernel_backends() returned 42, not a list of specs"),
    (["--backend", "badprobe"], "kernel backend 'badprobe' is not available here: its probe "
                                "raised RuntimeError('probe exploded')"),
    (["--backend", "nonsenseprobe"], "its probe returned 'yes', not an Availability"),
    (["--backend", "wrongclass"], "kernel backend 'wrongclass' is broken: its factory "
                                  "builtins:dict built {}, not a k3core.api.kernels.KernelBackend"),
    (["--storage", "hookraises"], "k3_storage_backends() raised ValueError('hook failed')"),
])
def test_choosing_a_broken_plugin_exits_2_with_the_reason(plugin_path, model, args,
                                                         needle) -> None:
    res = k3(plugin_path, "run", model, "--ids", "3,7", "--gen", "1", *args)
    out = _flat(res)
    assert res.returncode == 2, out
    assert needle in out and "Traceback" not in out
    assert "generated ids" not in out


def test_other_backends_still_work(plugin_path, model) -> None:
    res = k3(plugin_path, "run", model, "--ids", "3,7", "--gen", "2", "--backend", "numpy",
             "--storage", "dummy-plain", "--cache-policy", "lru")
    assert res.returncode == 0, _flat(res)
    assert "storage=dummy-plain" in res.stderr and "generated ids:" in res.stderr
    auto = k3(plugin_path, "run", model, "--ids", "3,7", "--gen", "2")
    assert auto.returncode == 0, _flat(auto)
    assert auto.stderr.split("generated ids:")[1].split()[0] == \
        res.stderr.split("generated ids:")[1].split()[0]
    assert auto.stdout == res.stdout  # the same text


def test_disable_plugins_hides_third_party_plugins(plugin_path, model) -> None:
    res = k3(plugin_path, "backends", disable=True)
    assert res.returncode == 0, _flat(res)
    assert "k3-dummy" not in res.stdout and "dummy-plain" not in res.stdout
    assert "broken" not in res.stdout and "numpy" in res.stdout
    run = k3(plugin_path, "run", model, "--ids", "3", "--gen", "1", "--storage", "dummy-plain",
             disable=True)
    assert run.returncode == 2 and "unknown storage backend 'dummy-plain'" in _flat(run)
