"""Numba's first compile is announced: a stderr note when no kernel is cached yet."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("numba")

from k3_backends.numba_kernels import cache


def fake(path):
    return SimpleNamespace(_cache=SimpleNamespace(_cache_path=str(path)))


def test_cold_is_true_without_cached_kernels(tmp_path):
    assert cache.cold([fake(tmp_path)])
    (tmp_path / "unrelated.foo-1.py311.nbi").write_bytes(b"")
    assert cache.cold([fake(tmp_path)])
    (tmp_path / "exact.exp_d-42.py311.nbi").write_bytes(b"")
    assert not cache.cold([fake(tmp_path)])


def test_a_cold_cache_is_announced_before_the_first_step(monkeypatch, capsys):
    import k3_backends.numba_backend as nb

    monkeypatch.setattr(cache, "cold", lambda dispatchers: True)
    nb.NumbaBackend(threads=1)
    assert "numba has no compiled k3 kernels cached yet" in capsys.readouterr().err
    monkeypatch.setattr(cache, "cold", lambda dispatchers: False)
    nb.NumbaBackend(threads=1)
    assert "numba" not in capsys.readouterr().err
