"""Registry behaviour: auto, explicit choices, disabling, unknown names, conflicts, and
plugins that break (at import, in a hook, in a probe) being reported instead of crashing."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

from k3core.api.errors import Exit, K3Error, PluginError
from k3core.api.hookspecs import hookimpl
from k3core.api.specs import Availability, KernelBackendSpec, StorageBackendSpec
from k3core.plugins import registry as registry_mod
from k3core.plugins.registry import HOOKS, Registry


def _spec(name, priority=0, ok=True, reason="", hint="", probe=None, factory="builtins:dict"):
    def default_probe():
        return Availability.yes() if ok else Availability.no(reason, hint)

    return KernelBackendSpec(
        name=name, factory=factory, priority=priority, probe=probe or default_probe
    )


class _Plugin:
    """A plugin object whose kernel hook returns ``specs`` (or raises ``raises``)."""

    def __init__(self, specs=(), raises=None):
        self.specs = list(specs)
        self.raises = raises

    @hookimpl
    def k3_kernel_backends(self):
        if self.raises is not None:
            raise self.raises
        return self.specs


def _registry(*plugins):
    reg = Registry(entries={k: {} for k in HOOKS})
    for i, (origin, plugin) in enumerate(plugins):
        reg.add_plugin(plugin, origin, f"plugin{i}")
    return reg


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("K3_DISABLE_BACKENDS", raising=False)
    monkeypatch.delenv("K3_DISABLE_PLUGINS", raising=False)


def test_auto_picks_highest_available_priority_and_says_so():
    reg = _registry(
        ("a==1", _Plugin([_spec("slow", 0), _spec("mid", 10)])),
        ("b==1", _Plugin([_spec("fast", 20, ok=False, reason="no AVX2")])),
    )
    spec, note = reg.resolve("kernel", "auto")
    assert spec.name == "mid"
    assert note == "auto picked kernel backend 'mid'"


def test_auto_with_nothing_available_is_an_error():
    reg = _registry(("a==1", _Plugin([_spec("x", ok=False, reason="nope")])))
    with pytest.raises(PluginError, match="no kernel backend is available"):
        reg.resolve("kernel", "auto")


def test_explicit_choice_never_falls_back():
    reg = _registry(
        ("a==1", _Plugin([_spec("slow", 0)])),
        ("b==1", _Plugin([_spec("fast", 20, ok=False, reason="CPU lacks AVX2", hint="use numba")])),
    )
    with pytest.raises(PluginError) as err:
        reg.resolve("kernel", "fast")
    assert "not available here: CPU lacks AVX2" in str(err.value)
    assert err.value.hint == "use numba"
    assert err.value.exit_code == Exit.USAGE
    with pytest.raises(PluginError):
        reg.create("kernel", "fast")
    spec, note = reg.resolve("kernel", "slow")
    assert spec.name == "slow" and note == ""


def test_disable_backends_env(monkeypatch):
    monkeypatch.setenv("K3_DISABLE_BACKENDS", "numba, other")
    reg = Registry.discover()
    assert "numba" in reg.names("kernel")
    with pytest.raises(PluginError) as err:
        reg.resolve("kernel", "numba")
    assert "disabled by K3_DISABLE_BACKENDS=numba, other" in str(err.value)
    assert err.value.hint == "unset K3_DISABLE_BACKENDS"
    spec, note = reg.resolve("kernel", "auto")
    assert spec.name != "numba" and "auto picked" in note


def test_unknown_name_lists_choices_and_a_close_match():
    reg = _registry(("a==1", _Plugin([_spec("numba"), _spec("numpy"), _spec("avx2")])))
    with pytest.raises(PluginError) as err:
        reg.resolve("kernel", "numbaa")
    msg = str(err.value)
    assert "unknown kernel backend 'numbaa'" in msg
    assert "registered: avx2, numba, numpy" in msg
    assert "did you mean 'numba'?" in msg


def test_two_plugins_claiming_one_name_is_an_error_naming_both():
    reg = _registry(
        ("alpha==1.0 (alpha.plugin)", _Plugin([_spec("dup", 5)])),
        ("beta==2.0 (beta.plugin)", _Plugin([_spec("dup", 7)])),
        ("gamma==1 (g)", _Plugin([_spec("fine", 1)])),
    )
    with pytest.raises(PluginError) as err:
        reg.resolve("kernel", "dup")
    assert "alpha==1.0 (alpha.plugin)" in str(err.value)
    assert "beta==2.0 (beta.plugin)" in str(err.value)
    assert reg.resolve("kernel", "auto")[0].name == "fine"  # auto skips the contested name


def test_raising_probe_is_reported_not_a_crash():
    def boom():
        raise RuntimeError("probe exploded")

    reg = _registry(("a==1", _Plugin([_spec("bad", 50, probe=boom), _spec("good", 1)])))
    avail = reg.probe("kernel", "bad")
    assert not avail.ok and "probe raised RuntimeError('probe exploded')" in avail.reason
    with pytest.raises(PluginError, match="probe exploded"):
        reg.resolve("kernel", "bad")
    assert reg.resolve("kernel", "auto")[0].name == "good"


def test_probe_returning_nonsense_is_reported():
    reg = _registry(("a==1", _Plugin([_spec("odd", probe=lambda: "yes please")])))
    avail = reg.probe("kernel", "odd")
    assert not avail.ok and "returned 'yes please', not an Availability" in avail.reason
    with pytest.raises(PluginError, match="not an Availability"):
        reg.resolve("kernel", "odd")


def test_broken_hooks_are_reported():
    storage_spec = StorageBackendSpec(name="mislabelled", factory="builtins:dict")
    reg = _registry(
        ("raiser==1", _Plugin(raises=ValueError("hook failed"))),
        ("junk==1", _Plugin(["not a spec", _spec("ok")])),
        ("wrongkind==1", _Plugin([storage_spec])),
        ("scalar==1", SimpleNamespace(k3_kernel_backends=hookimpl(lambda: _spec("lonely")))),
    )
    reasons = " | ".join(f"{b.origin}: {b.reason}" for b in reg.broken)
    assert "raiser==1: k3_kernel_backends() raised ValueError('hook failed')" in reasons
    assert "junk==1: k3_kernel_backends() returned something that is not a spec: 'not a spec'" in reasons
    assert "wrongkind==1: k3_kernel_backends() returned the storage spec 'mislabelled'" in reasons
    assert "scalar==1: k3_kernel_backends() returned" in reasons
    assert reg.names("kernel") == ["ok"]


def test_invalid_plugin_object_is_reported():
    class NotAPlugin:
        @hookimpl
        def k3_kernel_backends(self, unexpected_argument):
            return []

    reg = _registry(("weird==1", NotAPlugin()))
    assert reg.broken and "not a valid k3 plugin" in reg.broken[0].reason


@dataclass(frozen=True)
class _CallableSpec(KernelBackendSpec):
    """A spec whose factory is a Python callable (instead of a "module:attr" string)."""

    fn: Any = None

    def load(self) -> Any:
        return self.fn


def test_factory_failure_is_a_plugin_error_but_refusals_pass_through():
    def crash():
        raise RuntimeError("segfault avoided")

    def refuse():
        raise K3Error("needs IEEE subnormals", hint="use numpy")

    reg = _registry(
        ("a==1", _Plugin([_spec("missing", factory="k3core.no_such_module:Thing")])),
        ("b==1", _Plugin([_CallableSpec("crashes", "-", fn=crash)])),
        ("c==1", _Plugin([_CallableSpec("refuses", "-", fn=refuse)])),
    )
    with pytest.raises(PluginError, match="'missing' failed to start: ModuleNotFoundError"):
        reg.create("kernel", "missing")
    with pytest.raises(PluginError, match="'crashes' failed to start: RuntimeError"):
        reg.create("kernel", "crashes")
    with pytest.raises(K3Error) as err:
        reg.create("kernel", "refuses")
    assert not isinstance(err.value, PluginError) and err.value.hint == "use numpy"


class _FakeEntryPoint:
    def __init__(self, name, dist, value, load):
        self.name = name
        self.value = value
        self.dist = SimpleNamespace(name=dist, version="1.0")
        self._load = load

    def load(self):
        return self._load()


def _fake_entry_points(monkeypatch):
    def raise_at_import():
        raise ImportError("No module named 'missing_dep'")

    def exit_at_import():
        raise SystemExit(3)

    eps = [
        _FakeEntryPoint("builtin", "k3", "k3_fake.builtin", lambda: _Plugin([_spec("core")])),
        _FakeEntryPoint("third", "k3-timing-backend", "tp.mod", lambda: _Plugin([_spec("extra")])),
        _FakeEntryPoint("broken", "k3-broken", "broken.mod", raise_at_import),
        _FakeEntryPoint("exits", "k3-exits", "exits.mod", exit_at_import),
    ]
    monkeypatch.setattr(registry_mod, "_entry_points", lambda: eps)


def test_plugin_raising_at_import_is_reported(monkeypatch):
    _fake_entry_points(monkeypatch)
    reg = Registry.discover()
    assert reg.names("kernel") == ["core", "extra"]
    reasons = {b.name: b.reason for b in reg.broken}
    assert "failed to import" in reasons["broken"] and "missing_dep" in reasons["broken"]
    assert "SystemExit" in reasons["exits"]
    with pytest.raises(PluginError) as err:
        reg.resolve("kernel", "broken")
    assert "failed to import" in str(err.value)


def test_disable_plugins_ignores_third_party_entry_points(monkeypatch):
    _fake_entry_points(monkeypatch)
    monkeypatch.setenv("K3_DISABLE_PLUGINS", "1")
    reg = Registry.discover()
    assert reg.names("kernel") == ["core"]
    assert reg.broken == []
    monkeypatch.setenv("K3_DISABLE_PLUGINS", "0")
    assert Registry.discover().names("kernel") == ["core", "extra"]


def test_real_registry_lists_the_builtin_kernels():
    reg = Registry.discover()
    assert {"numpy", "numba"} <= set(reg.names("kernel"))
    assert reg.probe("kernel", "numpy").ok
    assert reg.probe("kernel", "not-registered").ok is False
