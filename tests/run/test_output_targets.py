"""Output paths: streams, symlinks written through, the model never overwritten, two outputs
never at one path, the umask honoured, and unwritable places refused before the run."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from k3core.api.outputs import target
from k3core.cli.app import app
from k3core.experts.trace import HIST_NAME, TRACE_NAME
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.tools.synth.writer import synthesize

runner = CliRunner()
posix = pytest.mark.skipif(os.name != "posix", reason="POSIX file types")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return synthesize(tmp_path_factory.mktemp("targets") / "tiny",
                      ModelConfig.from_json_dict(size_config("tiny")), 4)


def k3(*args: object):
    return runner.invoke(app, [str(a) for a in args])


RUN = ("--ids", "3,7", "--gen", "1")


def test_dash_is_standard_output(model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = k3("run", model, *RUN, "--out", "-")
    assert res.exit_code == 0, res.output
    assert not (tmp_path / "-").exists()
    line = next(ln for ln in res.output.splitlines() if ln.startswith("{"))
    assert json.loads(line)["prompt_ids"] == [3, 7]


@posix
def test_a_symlink_is_written_through(model, tmp_path):
    real = tmp_path / "real.json"
    real.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    res = k3("run", model, *RUN, "--out", link)
    assert res.exit_code == 0, res.output
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert json.loads(real.read_text())["prompt_ids"] == [3, 7]
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "new.json")
    assert k3("run", model, *RUN, "--out", dangling).exit_code == 0
    assert dangling.is_symlink() and json.loads((tmp_path / "new.json").read_text())


@posix
def test_a_fifo_is_a_stream(model, tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    res = k3("run", model, *RUN, "--out", fifo)
    reader.join(30)
    assert res.exit_code == 0, res.output
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert json.loads(got[0])["prompt_ids"] == [3, 7]
    assert target(fifo, "--out").kind == "stream"
    assert target("/dev/null", "--out").kind == "stream"


@posix
@pytest.mark.skipif(not os.path.exists("/dev/stdout"), reason="no /dev/stdout")
def test_dev_stdout_redirected_to_a_file_keeps_the_link_and_the_text(model, tmp_path):
    before = os.lstat("/dev/stdout")
    log = tmp_path / "log.txt"
    with open(log, "wb") as fh:
        res = subprocess.run([sys.executable, "-m", "k3core.cli", "run", str(model), *RUN,
                              "--backend", "numpy", "--out", "/dev/stdout"], stdout=fh,
                             stderr=subprocess.PIPE, timeout=120)
    assert res.returncode == 0, res.stderr.decode()[-2000:]
    after = os.lstat("/dev/stdout")
    assert stat.S_IFMT(after.st_mode) == stat.S_IFMT(before.st_mode)
    text = log.read_text()
    printed, brace, rest = text.partition("{")
    record = json.loads(brace + rest)
    assert record["prompt_ids"] == [3, 7]
    # the generated text printed on stdout before the JSON is still there
    assert printed and printed == record["generated_text"]


def test_writing_into_model_dir_is_refused_before_the_run(model):
    config = (model / "config.json").read_bytes()
    for flag in ("--out", "--dump-logits"):
        res = k3("run", model, *RUN, flag, model / "config.json")
        assert res.exit_code == 3, res.output
        assert "inside" in res.output and "generated ids" not in res.output
    res = k3("run", model, *RUN, "--dump-cache-trace", model / "trace")
    assert res.exit_code == 3 and not (model / "trace").exists()
    assert (model / "config.json").read_bytes() == config


def test_writing_into_the_trunk_dir_is_refused(model, tmp_path):
    trunk = tmp_path / "trunk"
    assert k3("pack-trunk", model, trunk).exit_code == 0
    before = (trunk / "trunk.json").read_bytes()
    res = k3("run", model, *RUN, "--trunk", trunk, "--out", trunk / "trunk.json")
    assert res.exit_code == 3 and "inside" in res.output
    assert (trunk / "trunk.json").read_bytes() == before


def test_two_outputs_at_one_path_are_refused(model, tmp_path):
    x = tmp_path / "x"
    res = k3("run", model, *RUN, "--out", x, "--dump-logits", x)
    assert res.exit_code == 3 and "the same place" in res.output
    assert "generated ids" not in res.output and not x.exists()
    link = tmp_path / "y"
    link.symlink_to(x)
    res = k3("run", model, *RUN, "--out", x, "--dump-logits", link)
    assert res.exit_code == 3 and "the same place" in res.output
    res = k3("run", model, *RUN, "--out", tmp_path / "t" / TRACE_NAME,
             "--dump-cache-trace", tmp_path / "t")
    assert res.exit_code == 3 and "the same place" in res.output
    res = k3("run", model, *RUN, "--out", "-", "--dump-logits", "-")
    assert res.exit_code == 3 and "the same place" in res.output


@posix
def test_outputs_honour_the_umask_and_keep_a_replaced_files_mode(model, tmp_path):
    old = os.umask(0o027)
    try:
        assert k3("run", model, *RUN, "--out", tmp_path / "a.json", "--dump-logits",
                  tmp_path / "l.f32", "--dump-cache-trace", tmp_path / "t").exit_code == 0
        kept = tmp_path / "b.json"
        kept.write_text("x")
        kept.chmod(0o604)
        assert k3("run", model, *RUN, "--out", kept).exit_code == 0
    finally:
        os.umask(old)
    for made in ("a.json", "l.f32", f"t/{TRACE_NAME}", f"t/{HIST_NAME}"):
        assert stat.S_IMODE(os.stat(tmp_path / made).st_mode) == 0o640, made
    assert stat.S_IMODE(os.stat(kept).st_mode) == 0o604


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="no /proc")
def test_a_place_that_cannot_hold_a_file_is_refused_before_the_run(model):
    res = k3("run", model, *RUN, "--out", "/proc/x.json")
    assert res.exit_code == 3, res.output
    assert "cannot write --out /proc/x.json" in res.output
    assert "generated ids" not in res.output


def test_dump_cache_trace_creates_its_directory(model, tmp_path):
    d = tmp_path / "a" / "b"
    res = k3("run", model, *RUN, "--dump-cache-trace", d)
    assert res.exit_code == 0, res.output
    assert (d / TRACE_NAME).is_file() and (d / HIST_NAME).is_file()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    res = k3("run", model, *RUN, "--dump-cache-trace", blocker)
    assert res.exit_code == 3 and "not a directory" in res.output
