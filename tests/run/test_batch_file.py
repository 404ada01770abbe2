"""``k3 run MODEL --batch-file FILE``: every prompt of a JSON Lines file, batched.

Each result's ids are the bytes of that prompt run alone (``k3 run`` and
``Engine.generate``), sampled lines included; every refusal of the file is exit 2 with one
line naming the file and the line, and nothing generated; a prompt that fails while
running gets an error object and exit 1, the others their results."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import k3
from k3core.api.errors import StorageError
from k3core.cli.app import app
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.run.session import Session
from k3core.tools.synth.writer import synthesize

runner = CliRunner()

#: one line of each kind: ids, text, sampled with a seed, a stop text, the flags' defaults,
#: a line's own max_tokens, speculative decoding, an id echoed
LINES: list[dict[str, Any]] = [
    {"ids": [3, 7, 11], "id": "first"},
    {"prompt": "The quick brown fox", "max_tokens": 6, "id": 2},
    {"ids": [5, 6, 7, 8], "temperature": 0.8, "top_k": 20, "seed": 7},
    {"prompt": "Hello", "temperature": 1.3, "top_p": 0.9, "seed": 123, "max_tokens": 9},
    {"ids": [1, 2, 3, 1, 2, 3, 1, 2], "spec": "ngram", "max_tokens": 7},
    {"ids": [42], "max_tokens": 0},
    {"ids": [9, 9, 9], "stop_ids": [5], "ignore_eos": True, "context": 10},
]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return synthesize(tmp_path_factory.mktemp("batch-file") / "tiny",
                      ModelConfig.from_json_dict(size_config("tiny")), 1)


@pytest.fixture(scope="module")
def engine(model):
    with k3.load(model) as eng:
        yield eng


def _write(path: Path, lines: list[Any], *, raw: str | None = None) -> Path:
    path.write_text(raw if raw is not None else
                    "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def _batch(model: Path, file: Path, *args: str):
    return runner.invoke(app, ["run", str(model), "--batch-file", str(file), *args])


def _results(stdout: str) -> list[dict]:
    recs = [json.loads(line) for line in stdout.splitlines()]
    return sorted(recs, key=lambda r: r["index"])


def _alone(model: Path, tmp_path: Path, line: dict, defaults: tuple[str, ...] = ()) -> dict:
    """``k3 run`` of one line's prompt and fields, as flags."""
    flag = {"max_tokens": "--gen", "temperature": "--temperature", "top_p": "--top-p",
            "top_k": "--top-k", "seed": "--seed", "spec": "--spec", "context": "--context"}
    args = [*defaults]
    args += ["--ids", ",".join(map(str, line["ids"]))] if "ids" in line else ["--prompt", line["prompt"]]
    for k, v in line.items():
        if k in flag:
            args += [flag[k], str(v)]
    args += [a for s in line.get("stop_ids", []) for a in ("--stop-id", str(s))]
    args += ["--ignore-eos"] if line.get("ignore_eos") else []
    out = tmp_path / "alone.json"
    res = runner.invoke(app, ["run", str(model), "-q", "--out", str(out), *args])
    assert res.exit_code == 0, res.output
    return json.loads(out.read_text())


def test_every_result_is_the_prompt_run_alone(model, engine, tmp_path) -> None:
    file = _write(tmp_path / "prompts.jsonl", LINES[:3] + [""] + LINES[3:])  # a blank line
    res = _batch(model, file, "--max-batch", "3", "--gen", "5")
    assert res.exit_code == 0, res.output
    recs = _results(res.stdout)
    assert [r["index"] for r in recs] == list(range(len(LINES)))
    assert [r["line"] for r in recs] == [1, 2, 3, 5, 6, 7, 8]  # line 4 is blank
    assert [r["id"] for r in recs] == ["first", 2] + [None] * 5
    for line, rec in zip(LINES, recs, strict=True):
        alone = _alone(model, tmp_path, line, ("--gen", "5"))
        assert rec["ids"] == alone["generated_ids"], line
        assert rec["text"] == alone["generated_text"]
        assert rec["stop_reason"] == alone["stop_reason"]
        assert rec["prompt_tokens"] == len(alone["prompt_ids"])
        assert rec["completion_tokens"] == len(rec["ids"])
        assert rec["seconds"] >= 0
        want = line.get("max_tokens", 5)
        if rec["stop_reason"] == "length":
            assert len(rec["ids"]) == want  # the line's own max_tokens, else --gen's
    # the Python API agrees (ids lines: the same ids, the same parameters)
    for line, rec in zip(LINES, recs, strict=True):
        if "ids" in line:
            kw = {k: v for k, v in line.items() if k not in ("ids", "id")}
            kw.setdefault("max_tokens", 5)
            assert engine.generate(line["ids"], **kw).ids == rec["ids"], line
    assert recs[2]["seed"] == 7 and recs[0]["seed"] is None
    assert "batch: 7 prompts, 7 done" in res.stderr
    # the memory plan holds the three sequences running at once
    assert "at most 3 at once" in res.stderr and "KV cache (3 slots)" in res.stderr


def test_the_flags_are_the_defaults_and_a_line_overrides_them(model, tmp_path) -> None:
    file = _write(tmp_path / "p.jsonl", [{"ids": [3, 7, 11]},
                                         {"ids": [3, 7, 11], "seed": 8, "max_tokens": 2}])
    res = _batch(model, file, "-q", "--gen", "4", "--temperature", "0.9", "--seed", "5")
    assert res.exit_code == 0, res.output
    assert res.stderr == ""  # -q: nothing on stderr
    a, b = _results(res.stdout)
    assert a["seed"] == 5 and len(a["ids"]) == 4
    assert b["seed"] == 8 and len(b["ids"]) == 2
    alone = _alone(model, tmp_path, {"ids": [3, 7, 11], "max_tokens": 2, "seed": 8,
                                     "temperature": 0.9})
    assert b["ids"] == alone["generated_ids"]


def test_a_sampled_line_without_a_seed_reports_the_seed_that_reproduces_it(model, tmp_path) -> None:
    file = _write(tmp_path / "p.jsonl", [{"ids": [3, 7, 11], "temperature": 1.0}])
    res = _batch(model, file, "-q")
    assert res.exit_code == 0, res.output
    (rec,) = _results(res.stdout)
    alone = _alone(model, tmp_path, {"ids": [3, 7, 11], "temperature": 1.0, "seed": rec["seed"]})
    assert rec["ids"] == alone["generated_ids"]


def test_out_holds_every_result_in_the_files_order(model, tmp_path) -> None:
    file = _write(tmp_path / "p.jsonl", LINES[:4])
    out = tmp_path / "results.jsonl"
    res = _batch(model, file, "-q", "--out", str(out))
    assert res.exit_code == 0, res.output
    written = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["index"] for r in written] == [0, 1, 2, 3]
    assert written == _results(res.stdout)
    assert not [p for p in tmp_path.iterdir() if "partial" in p.name]


def test_out_may_not_be_the_batch_file(model, tmp_path) -> None:
    file = _write(tmp_path / "p.jsonl", LINES[:1])
    before = file.read_bytes()
    res = _batch(model, file, "--out", str(file))
    assert res.exit_code == 3, res.output
    assert res.stdout == "" and file.read_bytes() == before
    assert res.stderr.count("\n") == 1 and "--batch-file" in res.stderr


BAD = [
    ("bad JSON", [{"ids": [1]}, '{"ids": [1, 2'], "line 2: invalid JSON"),
    ("not an object", [{"ids": [1]}, "[1, 2]"], "line 2: a line is one JSON object, not an array"),
    ("unknown field", [{"ids": [1], "temprature": 0.5}], "line 1: unknown field 'temprature'"),
    ("prompt and ids", [{"ids": [1]}, {"ids": [1], "prompt": "x"}], "line 2: give exactly one of"),
    ("neither", [{"max_tokens": 3}], "line 1: give exactly one of"),
    ("a wrong type", [{"ids": [1], "max_tokens": "3"}], "line 1: max_tokens: Input should be a valid integer"),
    ("a bool for a number", [{"ids": [1], "temperature": True}], "line 1: temperature:"),
    ("ids not ints", [{"ids": [1, "2"]}], "line 1: ids: token ids are non-negative integers"),
    ("out of range", [{"ids": [1], "top_p": 1.5}], "line 1: top_p must be in (0, 1]"),
    ("a duplicate field", ['{"ids": [1], "ids": [2]}'], "line 1: duplicate key 'ids'"),
    ("NaN", ['{"ids": [1], "temperature": NaN}'], "line 1: NaN is not a JSON number"),
    ("nested too deeply", ['{"ids": ' + "[" * 100_000 + "]" * 100_000 + "}"],
     "line 1: JSON nested too deeply"),
    ("an id that is an object", [{"ids": [1], "id": {"a": 1}}], "line 1: id: a string or a number"),
    ("ids out of the vocabulary", [{"ids": [1]}, {"ids": [2]}, {"ids": [3, 1024]}],
     "line 3: ids: id 1024 is outside the vocabulary (0..1023)"),
    ("stop_ids out of the vocabulary", [{"ids": [1], "stop_ids": [5000]}],
     "line 1: stop_ids: id 5000 is outside the vocabulary"),
    ("an empty prompt", [{"prompt": ""}], "line 1: the prompt is empty"),
    ("a full context", [{"ids": [1, 2, 3], "context": 3}], "line 1: the sequence holds 3 ids"),
]


@pytest.mark.parametrize("lines, needle", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_a_bad_line_is_refused_before_anything_runs(model, tmp_path, lines, needle) -> None:
    file = _write(tmp_path / "prompts.jsonl", lines)
    res = _batch(model, file)
    assert res.exit_code == 2, res.output
    assert res.stdout == ""  # nothing generated
    assert res.stderr.count("\n") == 1, res.stderr  # one line, and nothing else on stderr
    assert res.stderr.startswith(f"k3: error: {file} ")
    assert needle in res.stderr, res.stderr


@pytest.mark.parametrize("raw, needle", [
    ("", "no prompts"), ("\n  \n\n", "no prompts"),
    ('{"ids": [1]}\n\xff\n', "line 2: not UTF-8"),
], ids=["empty", "blank", "not UTF-8"])
def test_a_file_without_prompts_or_text_is_refused(model, tmp_path, raw, needle) -> None:
    file = tmp_path / "prompts.jsonl"
    file.write_bytes(raw.encode("latin-1"))
    res = _batch(model, file)
    assert res.exit_code == 2, res.output
    assert res.stdout == "" and res.stderr.count("\n") == 1 and needle in res.stderr


@pytest.mark.parametrize("args, needle", [
    (["--ids", "3,7"], "--batch-file and --ids are mutually exclusive"),
    (["--prompt", "hi"], "--batch-file and --prompt are mutually exclusive"),
    (["--save-state", "s.k3"], "--batch-file does not take --save-state"),
    (["--max-batch", "0"], "--max-batch must be in 1..256"),
    (["--gen", "-2"], "--gen must be in 0..4096"),
])
def test_a_bad_flag_with_a_batch_file_is_refused(model, tmp_path, args, needle) -> None:
    file = _write(tmp_path / "prompts.jsonl", LINES[:2])
    res = _batch(model, file, *args)
    assert res.exit_code == 2, res.output
    assert res.stdout == "" and res.stderr.count("\n") == 1 and needle in res.stderr


def test_max_batch_needs_a_batch_file(model) -> None:
    res = runner.invoke(app, ["run", str(model), "--ids", "3", "--max-batch", "2"])
    assert res.exit_code == 2 and "--max-batch needs --batch-file" in res.stderr
    assert res.stdout == ""


def test_missing_batch_file(model, tmp_path) -> None:
    res = _batch(model, tmp_path / "nope.jsonl")
    assert res.exit_code == 2 and "no such file" in res.stderr and res.stdout == ""


def test_a_text_prompt_needs_a_tokenizer(model, tmp_path) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(model, bare, ignore=shutil.ignore_patterns("tiktoken.model",
                                                               "tokenizer_config.json"))
    file = _write(tmp_path / "p.jsonl", [{"ids": [3]}, {"prompt": "hi"}])
    res = _batch(bare, file)
    assert res.exit_code == 2, res.output
    assert res.stdout == "" and res.stderr.count("\n") == 1
    assert "line 2: a text prompt needs a tokenizer" in res.stderr
    # ids alone need none: the text is null
    file = _write(tmp_path / "p.jsonl", [{"ids": [3, 7, 11]}])
    res = _batch(bare, file, "-q")
    assert res.exit_code == 0, res.output
    (rec,) = _results(res.stdout)
    assert rec["text"] is None and len(rec["ids"]) == 8


def test_a_prompt_that_fails_while_running_gets_an_error_and_exit_1(model, tmp_path,
                                                                    monkeypatch) -> None:
    real = Session.generate

    def generate(self, prompt=(), params=None, **kw):
        if list(prompt) == [9, 9, 9]:
            raise StorageError("a read of the checkpoint failed")
        return real(self, prompt, params, **kw)

    monkeypatch.setattr(Session, "generate", generate)
    lines: list[dict[str, Any]] = [{"ids": [3, 7, 11]}, {"ids": [9, 9, 9], "id": "x"},
                                   {"ids": [5, 6]}]
    file = _write(tmp_path / "p.jsonl", lines)
    out = tmp_path / "out.jsonl"
    res = _batch(model, file, "--max-batch", "2", "--out", str(out))
    assert res.exit_code == 1, res.output
    recs = _results(res.stdout)
    assert recs[1] == {"index": 1, "line": 2, "id": "x", "error": "a read of the checkpoint failed"}
    for i in (0, 2):
        assert recs[i]["ids"] == _alone(model, tmp_path, lines[i])["generated_ids"]
    last = res.stderr.splitlines()[-1]
    assert last == (f"k3: error: 1 of 3 prompts failed (the first: {file} line 2: a read of "
                    "the checkpoint failed)")
    assert [json.loads(x) for x in out.read_text().splitlines()] == recs


def test_each_result_is_written_as_it_finishes(model, tmp_path, monkeypatch) -> None:
    """The second prompt starts only once the first's line is on stdout: written at the
    end, it would wait for ever (here: its timeout, and the assertion fails)."""
    from k3core.run.report import RunReport

    written = threading.Event()
    waited: list[bool] = []
    real_text, real_generate = RunReport.text, Session.generate

    def text(self, piece):
        real_text(self, piece)
        written.set()

    def generate(self, prompt=(), params=None, **kw):
        if list(prompt) == [5, 6]:
            waited.append(written.wait(60))
        return real_generate(self, prompt, params, **kw)

    monkeypatch.setattr(RunReport, "text", text)
    monkeypatch.setattr(Session, "generate", generate)
    file = _write(tmp_path / "p.jsonl", [{"ids": [3, 7, 11], "max_tokens": 2},
                                         {"ids": [5, 6], "max_tokens": 2}])
    res = _batch(model, file, "-q", "--max-batch", "2")
    assert res.exit_code == 0, res.output
    assert waited == [True]
    assert [r["index"] for r in map(json.loads, res.stdout.splitlines())] == [0, 1]
