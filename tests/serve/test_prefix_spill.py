"""The prefix cache's disk tier (--prefix-cache-dir): evicted states spilled, read back with a
fresh run's bytes, found again by a restarted server, another model's files left alone, the
disk budget kept, and the flags' refusals."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.run.engine import open_engine
from k3core.run.prefix_cache import PrefixCache
from k3core.run.prefix_spill import SUFFIX, PrefixSpill
from k3core.run.request import EngineRequest, GenerationParams
from k3core.serve.worker import PREFIX_BLOCK, Job, Worker
from k3core.tools.synth.writer import synthesize

SYSTEMS = [[(7 * i + k) % 50 + 1 for i in range(PREFIX_BLOCK)] for k in range(3)]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("spill")
    cfg = ModelConfig.from_json_dict(size_config("tiny"))
    return synthesize(root / "a", cfg, seed=4), synthesize(root / "b", cfg, seed=5)


def _engine(model: Path):
    return open_engine(EngineRequest(model_dir=model, backend="numpy", storage="plain"))


def _spill_once(model: Path, d: Path, prompt: list[int], max_tokens: int) -> None:
    """One job on a fresh engine whose prefix cache keeps everything on disk in ``d``."""
    eng = _engine(model)
    try:
        w = Worker(eng, 256, PrefixCache(0, PrefixSpill(d, eng, 10**9)))  # disk only
        w.run(Job(prompt, GenerationParams(max_tokens=max_tokens)))
    finally:
        eng.close()


def _one_state_bytes(eng) -> int:
    w = Worker(eng, 256, PrefixCache(10**9))
    w.run(Job(SYSTEMS[0] + [4], GenerationParams(max_tokens=1)))
    assert w.prefix is not None
    return min(n for _, n, _ in w.prefix._entries.values())


def test_evicted_states_spill_and_come_back_with_fresh_bytes(models, tmp_path):
    eng = _engine(models[0])
    try:
        room = _one_state_bytes(eng) + 1  # memory holds one state: the rest spill
        (tmp_path / "spill").mkdir()
        spill = PrefixSpill(tmp_path / "spill", eng, 10**9)
        w = Worker(eng, 256, PrefixCache(room, spill))
        for s in SYSTEMS:  # each keeps its opening at the block boundary, and its whole prompt
            w.run(Job(s + [4, 4], GenerationParams(max_tokens=3)))
        assert spill.stats.spilled >= 2 and len(list((tmp_path / "spill").glob(f"*{SUFFIX}")))
        prompt = SYSTEMS[0] + [6, 1, 2]
        out = w.run(Job(prompt, GenerationParams(max_tokens=5)))
        assert out.reused == PREFIX_BLOCK and spill.stats.loaded >= 1  # read back from disk
        assert w.last_generation is not None
        assert w.last_generation.first_logits.tobytes() == eng.logits(prompt).tobytes()
        assert out.ids == eng.generate(prompt, max_tokens=5).ids
        health = w.health()["prefix_cache"]["disk"]
        assert health["files"] == len(spill) and health["loaded"] >= 1
    finally:
        eng.close()


def test_a_restarted_server_finds_the_spilled_states(models, tmp_path):
    d = tmp_path / "spill"
    d.mkdir()
    _spill_once(models[0], d, SYSTEMS[1] + [9, 9], 2)
    eng = _engine(models[0])  # the restart: a new engine, a new index of the same directory
    try:
        spill = PrefixSpill(d, eng, 10**9)
        assert len(spill) >= 1 and spill.stats.foreign == 0
        w = Worker(eng, 256, PrefixCache(10**8, spill))
        prompt = SYSTEMS[1] + [3, 3, 3]
        out = w.run(Job(prompt, GenerationParams(max_tokens=4)))
        assert out.reused == PREFIX_BLOCK
        assert out.ids == eng.generate(prompt, max_tokens=4).ids
    finally:
        eng.close()


def test_another_models_files_and_damaged_ones_are_left_alone(models, tmp_path):
    d = tmp_path / "spill"
    d.mkdir()
    _spill_once(models[0], d, SYSTEMS[2] + [5], 1)
    files = sorted(d.glob(f"*{SUFFIX}"))
    assert files
    damaged = d / ("0" * 64 + SUFFIX)
    damaged.write_bytes(b"not a state")
    other = _engine(models[1])  # same architecture, other weights
    try:
        spill = PrefixSpill(d, other, 10**9)
        assert len(spill) == 0 and spill.stats.foreign == len(files) + 1
        w = Worker(other, 256, PrefixCache(10**8, spill))
        prompt = SYSTEMS[2] + [5, 6]
        out = w.run(Job(prompt, GenerationParams(max_tokens=3)))
        assert out.reused == 0 and out.ids == other.generate(prompt, max_tokens=3).ids
    finally:
        other.close()
    assert all(f.exists() for f in files) and damaged.exists()  # nothing of theirs deleted


def test_the_disk_budget_removes_the_least_recently_used(models, tmp_path):
    d = tmp_path / "spill"
    d.mkdir()
    eng = _engine(models[0])
    try:
        probe = PrefixSpill(d, eng, 10**9)
        w = Worker(eng, 256, PrefixCache(0, probe))
        w.run(Job(SYSTEMS[0] + [1], GenerationParams(max_tokens=1)))
        size = max(os.path.getsize(f) for f in d.glob(f"*{SUFFIX}"))
        for f in d.glob(f"*{SUFFIX}"):
            f.unlink()
        spill = PrefixSpill(d, eng, int(2.5 * size))
        w = Worker(eng, 256, PrefixCache(0, spill))
        for s in SYSTEMS:
            w.run(Job(s + [1], GenerationParams(max_tokens=1)))
        assert spill.bytes <= spill.budget and spill.stats.evicted >= 1
        assert len(list(d.glob(f"*{SUFFIX}"))) == len(spill) <= 2
        assert spill.best(tuple(SYSTEMS[0] + [1, 2])) == 0  # the oldest went first
    finally:
        eng.close()


@pytest.mark.parametrize("args, says", [
    (["--prefix-cache-disk-gb", "1"], "--prefix-cache-disk-gb needs --prefix-cache-dir"),
    (["--prefix-cache-dir", "FILE"], "not a directory"),
    (["--prefix-cache-dir", "DIR", "--prefix-cache-disk-gb", "0"], "--prefix-cache-disk-gb"),
    (["--prefix-cache-dir", "DIR", "--prefix-cache-disk-gb", "nan"], "--prefix-cache-disk-gb"),
])
def test_the_flags_refusals(models, tmp_path, args, says):
    from k3core.cli.app import app

    f = tmp_path / "a-file"
    f.write_text("x")
    args = [str(f) if a == "FILE" else str(tmp_path / "d") if a == "DIR" else a for a in args]
    res = CliRunner().invoke(app, ["serve", str(models[0]), *args])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("k3: error:") and says in lines[0], res.output


def test_the_same_prompt_again_starts_from_spilled_logits_without_a_pass(models, tmp_path):
    d = tmp_path / "spill"
    d.mkdir()
    eng = _engine(models[0])
    try:
        spill = PrefixSpill(d, eng, 10**9)
        w = Worker(eng, 256, PrefixCache(0, spill))  # every state straight to disk
        prompt = [5, 9, 2, 7, 7, 3]
        first = w.run(Job(prompt, GenerationParams(max_tokens=4)))
        assert list(d.glob("*.k3logits"))  # the whole prompt's state spilled with its logits
        again = w.run(Job(prompt, GenerationParams(max_tokens=4)))
        assert again.reused == len(prompt) and again.ids == first.ids
        assert w.last_generation is not None and w.last_generation.prefill_chunks == 0
        assert w.last_generation.first_logits.tobytes() == eng.logits(prompt).tobytes()
        for f in d.glob("*.k3logits"):  # damaged logits: the state is a prefix only
            raw = bytearray(f.read_bytes())
            raw[-1] ^= 1  # one bit of the last logit: the checksum no longer matches
            f.write_bytes(bytes(raw))
        third = w.run(Job(prompt, GenerationParams(max_tokens=4)))
        assert third.ids == first.ids and w.last_generation.prefill_chunks >= 1
    finally:
        eng.close()


def test_logits_spilled_later_join_the_state_already_on_disk(models, tmp_path):
    """A state spilled without logits, then again with them: one state file (not rewritten),
    its logits beside it, the bytes counted once."""
    eng = _engine(models[0])
    try:
        d = tmp_path / "spill"
        d.mkdir()
        spill = PrefixSpill(d, eng, 10**9)
        w = Worker(eng, 256, PrefixCache(10**8))
        prompt = [4, 8, 15, 16]
        w.run(Job(prompt, GenerationParams(max_tokens=1)))
        assert w.prefix is not None
        snap, logits = w.prefix.exact(prompt)
        assert spill.put(prompt, snap)
        (state_file,) = d.glob(f"*{SUFFIX}")
        written = state_file.stat().st_mtime_ns
        assert spill.put(prompt, snap, logits) and len(spill) == 1
        assert state_file.stat().st_mtime_ns == written  # the state kept its file
        assert spill.bytes == sum(f.stat().st_size for f in d.iterdir())
        assert spill.load_logits(tuple(prompt)).tobytes() == logits.tobytes()
    finally:
        eng.close()
