"""Registration of the avx2 kernel backend and its refusals: disabled, CPU without AVX2/FMA,
compiled module missing or stale. An explicit ``avx2`` never falls back to another backend."""

from __future__ import annotations

import sys

import pytest
from k3_backends import avx2_probe

from k3core.api.errors import Exit, PluginError
from k3core.plugins.registry import Registry


@pytest.fixture
def registry() -> Registry:
    return Registry.discover()  # fresh: probes are cached per registry


def test_registered_with_priority_20(registry):
    entry = registry.entries["kernel"]["avx2"]
    assert entry.spec.factory == "k3_backends.avx2_backend:Avx2Backend"
    assert entry.spec.priority == 20
    assert entry.origin.startswith("k3==")


@pytest.mark.skipif(not avx2_probe.check_cpu().ok, reason="CPU lacks AVX2/FMA")
def test_resolves_and_creates(registry):
    backend, name, note = registry.create("kernel", "avx2", threads=1)
    assert name == "avx2" and backend.name == "avx2" and backend.threads == 1
    assert note == ""


def test_disabled_by_environment(registry, monkeypatch):
    monkeypatch.setenv("K3_DISABLE_BACKENDS", "avx2")
    with pytest.raises(PluginError) as err:
        registry.resolve("kernel", "avx2")
    assert err.value.exit_code == Exit.USAGE == 2
    assert err.value.message == (
        "kernel backend 'avx2' is not available here: disabled by K3_DISABLE_BACKENDS=avx2"
    )
    assert err.value.hint == "unset K3_DISABLE_BACKENDS"
    spec, note = registry.resolve("kernel", "auto")  # auto picks another and says so
    assert spec.name != "avx2" and note.startswith("auto picked kernel backend")


def test_missing_compiled_module(registry, monkeypatch):
    monkeypatch.setattr(avx2_probe, "check_cpu", lambda flags=None: avx2_probe.Availability.yes())
    monkeypatch.setattr(avx2_probe, "_build_error", lambda: None)
    monkeypatch.setitem(sys.modules, avx2_probe.COMPILED_MODULE, None)  # import now fails
    with pytest.raises(PluginError) as err:
        registry.resolve("kernel", "avx2")
    assert err.value.exit_code == 2
    assert err.value.message.startswith(
        "kernel backend 'avx2' is not available here: compiled module k3_backends._k3avx2 is "
        "missing ("
    )
    assert err.value.hint == "install gcc and reinstall: pip install -e ."


def test_missing_module_reports_the_install_time_failure(registry, monkeypatch):
    monkeypatch.setattr(avx2_probe, "check_cpu", lambda flags=None: avx2_probe.Availability.yes())
    monkeypatch.setattr(avx2_probe, "_build_error", lambda: "command 'gcc' failed: No such file")
    monkeypatch.setitem(sys.modules, avx2_probe.COMPILED_MODULE, None)
    with pytest.raises(PluginError, match=r"missing \(the build failed at install: command 'gcc'"):
        registry.resolve("kernel", "avx2")


def test_explicit_choice_never_falls_back(registry, monkeypatch):
    monkeypatch.setattr(avx2_probe, "check_cpu", lambda flags=None: avx2_probe.Availability.yes())
    monkeypatch.setitem(sys.modules, avx2_probe.COMPILED_MODULE, None)
    with pytest.raises(PluginError, match="avx2"):
        registry.create("kernel", "avx2")
    spec, note = registry.resolve("kernel", "auto")
    assert spec.name != "avx2" and "auto picked" in note


def test_cpu_without_avx2(registry, monkeypatch):
    monkeypatch.setattr(avx2_probe, "cpu_flags", lambda: {"sse2", "fma"})
    with pytest.raises(PluginError) as err:
        registry.resolve("kernel", "avx2")
    assert "CPU lacks AVX2/FMA (flags: missing avx2; has fma" in err.value.message
    assert err.value.hint == "use --backend numba or numpy"


def test_cpu_check_logic():
    assert avx2_probe.check_cpu({"avx2", "fma", "sse2"}).ok
    no = avx2_probe.check_cpu({"sse2"})
    assert not no.ok and "missing avx2, fma" in no.reason
    unknown = avx2_probe.check_cpu(None) if avx2_probe.cpu_flags() is None else None
    if unknown is not None:
        assert not unknown.ok and "cannot check" in unknown.reason


def test_cpu_unknown_is_refused(monkeypatch):
    monkeypatch.setattr(avx2_probe, "cpu_flags", lambda: None)
    result = avx2_probe.probe()
    assert not result.ok and result.reason.startswith("cannot check this CPU for AVX2/FMA")


@pytest.mark.skipif(not avx2_probe.check_cpu().ok, reason="CPU lacks AVX2/FMA")
def test_stale_module_is_refused(registry, monkeypatch):
    real = avx2_probe.contract_values()
    monkeypatch.setattr(avx2_probe, "contract_values", lambda: [*real[:2], real[2] + 1.0, *real[3:]])
    with pytest.raises(PluginError, match="is stale"):
        registry.resolve("kernel", "avx2")


@pytest.mark.skipif(not avx2_probe.check_cpu().ok, reason="CPU lacks AVX2/FMA")
def test_probe_ok_here():
    assert avx2_probe.probe().ok
