"""``import k3``: the engine opened once, generate/stream/logits, sessions and their files,
and the same ids and logit bytes as ``k3 run`` for the same settings."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

import k3
from k3core.cli.app import app
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.run.request import GenerationParams, RunRequest
from k3core.tools.synth.writer import synthesize

IDS = [3, 7, 11]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return synthesize(tmp_path_factory.mktemp("api") / "tiny",
                      ModelConfig.from_json_dict(size_config("tiny")), seed=4)


@pytest.fixture(scope="module")
def engine(model):
    with k3.load(model) as eng:
        yield eng


def cli(tmp_path, *args):
    out = tmp_path / "r.json"
    res = CliRunner().invoke(app, ["run", *map(str, args), "--out", str(out)])
    assert res.exit_code == 0, res.output
    return json.loads(out.read_text())


def test_generate_matches_k3_run_greedy_and_sampled(engine, model, tmp_path):
    rec = cli(tmp_path, model, "--ids", "3,7,11", "-n", "6", "--ignore-eos", "--dump-logits",
              tmp_path / "l.f32")
    out = engine.generate(IDS, max_tokens=6, ignore_eos=True)
    assert out.ids == rec["generated_ids"] and out.text == rec["generated_text"]
    assert out.first_logits.tobytes() == (tmp_path / "l.f32").read_bytes()
    assert engine.logits(IDS).tobytes() == (tmp_path / "l.f32").read_bytes()
    assert out.report["generated_ids"] == out.ids and out.report["incremental"] is True
    rec = cli(tmp_path, model, "--ids", "3,7,11", "-n", "6", "--ignore-eos", "--temperature",
              "0.9", "--top-p", "0.9", "--seed", "11")
    out = engine.generate(IDS, max_tokens=6, ignore_eos=True, temperature=0.9, top_p=0.9, seed=11)
    assert out.ids == rec["generated_ids"]
    assert out.report["sampling"] == rec["sampling"]


def test_text_prompt_matches_k3_run(engine, model, tmp_path):
    rec = cli(tmp_path, model, "--prompt", "Grüße, k3", "-n", "4")
    out = engine.generate("Grüße, k3", max_tokens=4)
    assert out.prompt_ids == rec["prompt_ids"] and out.ids == rec["generated_ids"]


def test_engine_is_reusable_and_full_recompute_gives_the_same_ids(engine, model):
    a = engine.generate(IDS, max_tokens=5, ignore_eos=True)
    b = engine.generate(IDS, max_tokens=5, ignore_eos=True)
    full = engine.session(incremental=False).generate(IDS, max_tokens=5, ignore_eos=True)
    assert a.ids == b.ids == full.ids
    assert a.first_logits.tobytes() == full.first_logits.tobytes()


def test_stream_pieces_are_the_text_and_stop_strings_never_appear(engine):
    full = engine.generate(IDS, max_tokens=10, ignore_eos=True)
    assert "".join(engine.stream(IDS, max_tokens=10, ignore_eos=True)) == full.text
    stop = full.text[len(full.text) // 2:][:2]
    pieces = list(engine.stream(IDS, max_tokens=10, ignore_eos=True, stop=[stop]))
    assert "".join(pieces) == full.text[: full.text.find(stop)]
    assert all(stop not in p for p in pieces)


def test_session_over_many_calls_equals_one_run(engine):
    s = engine.session()
    seq = list(IDS)
    for extra in ([5], [9, 2], [17]):  # each call grows the carried state
        got = s.generate(extra if len(seq) > 3 else seq, max_tokens=2, ignore_eos=True)
        if len(seq) > 3:
            seq += extra
        one = engine.generate(seq, max_tokens=2, ignore_eos=True)
        assert got.ids == one.ids and got.first_logits.tobytes() == one.first_logits.tobytes()
        seq += got.ids
    assert s.ids == seq


def test_saved_session_resumes_on_a_new_engine(engine, model, tmp_path):
    s = engine.session()
    s.generate(IDS, max_tokens=3, ignore_eos=True)
    path = tmp_path / "s.k3s"
    s.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["s.k3s"]  # no temporary file left
    with k3.load(model, backend="numpy") as other_engine:
        r = other_engine.session()
        r.load(path)
        assert r.ids == s.ids and r.pending == s.pending
        a = r.generate([4], max_tokens=3, ignore_eos=True)
    b = s.generate([4], max_tokens=3, ignore_eos=True)
    assert a.ids == b.ids and a.first_logits.tobytes() == b.first_logits.tobytes()


def test_session_file_refusals(engine, model, tmp_path):
    s = engine.session()
    s.generate(IDS, max_tokens=2)
    path = tmp_path / "s.k3s"
    s.save(path)
    other = synthesize(tmp_path / "other", ModelConfig.from_json_dict(size_config("tiny")), 5)
    with k3.load(other) as eng, pytest.raises(k3.StateFileError, match="another model"):
        eng.session().load(path)
    with k3.load(model, layers=4) as eng, pytest.raises(k3.StateFileError, match="another model"):
        eng.session().load(path)
    raw = path.read_bytes()
    cases = {
        "bad magic": b"K3STATX\n" + raw[8:],
        "format version 9": raw[:8] + struct.pack("<I", 9) + raw[12:],
        "truncated or damaged header": raw[:20],
        "checksum differs": raw[:-1] + bytes([raw[-1] ^ 1]),
        "64 bytes after the end of the state": raw + b"\0" * 64,  # checked before reading it
    }
    for needle, data in cases.items():
        bad = tmp_path / "bad.k3s"
        bad.write_bytes(data)
        fresh = engine.session()
        with pytest.raises(k3.StateFileError, match=needle) as exc:
            fresh.load(bad)
        # a file k3 cannot trust is bad input, like a damaged tokenizer (docs/exit-codes.md)
        assert exc.value.exit_code == 2 and fresh.ids == [] and fresh.state is None
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(k3.StateFileError, match="not a regular file"):
        engine.session().load(fifo)  # refused, never a blocking read
    with pytest.raises(k3.UsageError, match="needs incremental"):
        engine.session(incremental=False).save(tmp_path / "x.k3s")


def test_errors_are_k3_errors(engine, model, tmp_path):
    with pytest.raises(k3.UsageError, match="does not exist"):
        k3.load(tmp_path / "nowhere")
    with pytest.raises(k3.UsageError, match="unknown option"):
        k3.load(model, turbo=True)
    with pytest.raises(k3.UsageError, match="threads"):
        k3.load(model, threads="many")
    with pytest.raises(k3.UsageError, match="outside the vocabulary"):
        engine.generate([5000])
    with pytest.raises(k3.UsageError, match="empty"):
        engine.generate([])
    with pytest.raises(k3.UsageError, match="^top_p must be in"):
        engine.generate(IDS, top_p=2.0)
    with pytest.raises(k3.UsageError, match="either a GenerationParams or keywords"):
        engine.session().generate(IDS, GenerationParams(max_tokens=1), max_tokens=2)
    bare = tmp_path / "bare"
    bare.mkdir()
    for p in model.iterdir():
        if p.suffix != ".model" and p.name != "tokenizer_config.json":
            shutil.copy(p, bare / p.name)
    with k3.load(bare) as eng:
        assert eng.tokenizer is None and eng.generate(IDS, max_tokens=1).text is None
        with pytest.raises(k3.UsageError, match="needs a tokenizer"):
            eng.generate("hello")
    closed = k3.load(model)
    closed.close()
    with pytest.raises(k3.UsageError, match="closed"):
        closed.generate(IDS)


def test_generation_params_object_and_request_serialise(engine):
    p = GenerationParams(max_tokens=2, stop_ids=[1], ignore_eos=True)
    assert engine.session().generate(IDS, p).ids == engine.generate(IDS, max_tokens=2,
                                                                     stop_ids=[1],
                                                                     ignore_eos=True).ids
    r = RunRequest.from_flags({"model_dir": "m", "ids": "3,7", "gen": 4, "threads": 2,
                               "stop": ["x"], "quiet": True})
    again = RunRequest.model_validate(r.to_json())
    assert again == r and r.verbosity == -1 and r.generation.max_tokens == 4
    assert r.given()["engine"] == {"model_dir": "m", "threads": 2}


def test_plan_knows_every_source(engine, model, monkeypatch):
    monkeypatch.setenv("K3_THREADS", "1")
    with k3.load(model, cache_gb=0.01) as eng:
        s = eng.plan.to_json()["settings"]  # type: ignore[union-attr]
        shown = str(eng.plan)
    assert "setting: cache_gb = 0.01  (keyword cache_gb)" in shown and "memory plan" in shown
    json.dumps(eng.plan.to_json())  # type: ignore[union-attr]  # serialisable as it is
    assert s["threads"] == {"value": 1, "source": "env K3_THREADS"}
    assert s["cache_gb"] == {"value": 0.01, "source": "keyword cache_gb"}
    assert s["model_dir"]["source"] == "keyword model_dir"
    assert s["backend"]["source"] == "default"


def test_import_k3_loads_no_numeric_library():
    code = "import sys, k3; print(sorted(m for m in ('numpy', 'numba', 'tiktoken', 'rich') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_logits_all_positions(engine):
    every = engine.logits(IDS, all_positions=True)
    assert every.shape == (3, 1024) and every.dtype == np.float32
    assert every[-1].tobytes() == engine.logits(IDS).tobytes()


def test_interrupted_session_stays_usable(engine):
    """Ctrl-C inside a forward pass (after some layers advanced their state) leaves the
    session consistent: the next call gives the ids of one uninterrupted run."""
    s = engine.session()
    s.generate(IDS, max_tokens=2, ignore_eos=True)
    calls = {"n": 0}

    def on_layer(layer: int, h: object) -> None:
        calls["n"] += 1
        if calls["n"] == 20:  # the second step, mid-way through the layers
            raise KeyboardInterrupt

    engine.model.on_layer = on_layer
    try:
        with pytest.raises(KeyboardInterrupt):
            s.generate([5], max_tokens=4, ignore_eos=True)
    finally:
        engine.model.on_layer = None
    assert s.last is not None and s.last.interrupted and len(s.last.ids) == 1
    got = s.generate([9], max_tokens=3, ignore_eos=True)
    one = engine.generate(s.ids[: -len(got.ids)], max_tokens=3, ignore_eos=True)
    assert got.ids == one.ids and got.first_logits.tobytes() == one.first_logits.tobytes()
