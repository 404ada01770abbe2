"""The malloc arena cap: set once through glibc's mallopt, the user's MALLOC_ARENA_MAX kept."""

from __future__ import annotations

import ctypes
import sys

from k3core.run import arenas


def _glibc() -> bool:
    return sys.platform.startswith("linux") and hasattr(ctypes.CDLL(None), "gnu_get_libc_version")


def test_the_cap_is_set_once(monkeypatch) -> None:
    monkeypatch.setattr(arenas, "_done", None)
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    first = arenas.limit_arenas()
    assert first is _glibc()  # in force where glibc runs the process, untouched elsewhere
    assert arenas.limit_arenas() is first  # later calls: the first answer, no second mallopt


def test_the_users_malloc_arena_max_is_left_alone(monkeypatch) -> None:
    class Libc:
        def __getattr__(self, name: str):
            raise AssertionError(f"libc.{name} touched with MALLOC_ARENA_MAX set")

    monkeypatch.setattr(arenas, "_done", None)
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    monkeypatch.setattr(arenas.ctypes, "CDLL", lambda _name: Libc())
    assert arenas.limit_arenas() is True


def test_an_engine_opens_with_the_cap(tmp_path, monkeypatch) -> None:
    from k3core.model.config import ModelConfig
    from k3core.model.shapes import size_config
    from k3core.run.engine import open_engine
    from k3core.run.request import EngineRequest
    from k3core.tools.synth.writer import synthesize

    model = synthesize(tmp_path / "tiny", ModelConfig.from_json_dict(size_config("tiny", {})), 3)
    monkeypatch.setattr(arenas, "_done", None)
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    eng = open_engine(EngineRequest(model_dir=model, backend="numpy"))
    try:
        assert arenas._done is _glibc()
    finally:
        eng.close()
