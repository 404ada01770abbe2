"""``--gen -1`` (llama.cpp's ``-n -1``): generate until the end of sequence or the context is
full, through the CLI and the Python API, with ``stop_reason`` ``eos`` or ``context``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import k3
from k3core.cli.app import app
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.tools.synth.writer import synthesize

runner = CliRunner()
PROMPT = [3, 7, 11]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return synthesize(tmp_path_factory.mktemp("until-end") / "tiny",
                      ModelConfig.from_json_dict(size_config("tiny")), 1)


@pytest.fixture(scope="module")
def engine(model):
    with k3.load(model) as eng:
        yield eng


def _run(model: Path, tmp_path: Path, *args: str) -> tuple[int, str, dict]:
    out = tmp_path / "run.json"
    res = runner.invoke(app, ["run", str(model), "--ids", ",".join(map(str, PROMPT)),
                              "--out", str(out), *args])
    rec = json.loads(out.read_text()) if res.exit_code == 0 else {}
    return res.exit_code, res.output, rec


def test_cli_until_the_context_is_full(model, tmp_path) -> None:
    code, output, rec = _run(model, tmp_path, "-n", "-1", "--context", "12", "--ignore-eos")
    assert code == 0, output
    assert len(rec["generated_ids"]) == 12 - len(PROMPT)
    assert rec["stop_reason"] == "context"
    assert "generating until the end of sequence or the context is full" in output
    # the same ids as a fixed --gen of that length, which stops for its own reason
    code, output, fixed = _run(model, tmp_path, "-n", "9", "--ignore-eos")
    assert code == 0 and fixed["generated_ids"] == rec["generated_ids"]
    assert fixed["stop_reason"] == "length"


def test_cli_a_context_shorter_than_gen_ends_it_first(model, tmp_path) -> None:
    code, output, rec = _run(model, tmp_path, "-n", "50", "-c", "8", "--ignore-eos")
    assert code == 0, output
    assert len(rec["generated_ids"]) == 5 and rec["stop_reason"] == "context"
    code, output, rec = _run(model, tmp_path, "-n", "5", "-c", "8", "--ignore-eos")
    assert code == 0 and rec["stop_reason"] == "length"  # it made what was asked


def test_cli_until_end_of_sequence(model, tmp_path) -> None:
    """The 5th generated id made the end-of-sequence id (a config naming it): ``-n -1``
    stops right there, its text not printed."""
    code, output, free = _run(model, tmp_path, "-n", "12", "--ignore-eos")
    assert code == 0, output
    ids = free["generated_ids"]
    k = next(i for i in range(4, len(ids)) if ids[i] not in ids[:i])
    cfg = json.loads((model / "config.json").read_text())
    cfg["eos_token_id"] = ids[k]
    config = tmp_path / "config-eos.json"
    config.write_text(json.dumps(cfg))
    code, output, rec = _run(model, tmp_path, "-n", "-1", "--config", str(config))
    assert code == 0, output
    assert rec["generated_ids"] == ids[: k + 1]
    assert rec["stop_reason"] == "eos" and rec["stopped_at"] == ids[k]


@pytest.mark.parametrize("args, needle", [
    (["-n", "-2"], "--gen must be in 0..4096, or -1"),
    (["-n", "-1", "--context", "0"], "--context must be in 1.."),
    (["-n", "-1", "--context", "3"], "fills the context of 3"),
    (["-n", "4", "-c", "2"], "fills the context of 2"),
])
def test_cli_refusals(model, tmp_path, args, needle) -> None:
    code, output, _ = _run(model, tmp_path, *args)
    assert code == 2, output
    assert needle in output and "Traceback" not in output


def test_api_max_tokens_minus_one(engine) -> None:
    out = engine.generate(PROMPT, max_tokens=-1, context=10, ignore_eos=True)
    assert len(out.ids) == 7 and out.stop_reason == "context"
    assert out.report["stop_reason"] == "context"
    assert out.ids == engine.generate(PROMPT, max_tokens=7, ignore_eos=True).ids
    # without a context: at most 4096 past the sequence; a stop id ends it far sooner
    first = engine.generate(PROMPT, max_tokens=1).ids[0]
    stopped = engine.generate(PROMPT, max_tokens=-1, stop_ids=[first])
    assert stopped.ids == [first] and stopped.stop_reason == "stop_id"


def test_api_the_context_counts_the_whole_session(engine) -> None:
    s = engine.session()
    s.generate(PROMPT, max_tokens=3, ignore_eos=True)  # 6 ids held
    more = s.generate([5], max_tokens=-1, context=10, ignore_eos=True)
    assert len(more.ids) == 3 and more.stop_reason == "context" and len(s.ids) == 10
    with pytest.raises(k3.UsageError, match="fills the context of 10"):
        s.generate([5], max_tokens=-1, context=10)
