"""Progress of the long commands: on stderr, never on stdout; a plain line every
``K3_PROGRESS_EVERY`` seconds when stderr is a pipe (none for a short run by default), one
line redrawn with ``\\r`` and ended with a newline in a terminal; ``-q`` silences it.

Each command runs as a user runs it (a subprocess of the ``k3`` command line), with stdout
and stderr captured apart; ``K3_PROGRESS_EVERY=0`` makes every update a line, so the short
runs here show what a long run's log would.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pexpect
import pytest

from k3core.cli.progress import Progress
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.tools.synth.writer import synthesize

K3 = [sys.executable, "-m", "k3core.cli"]
#: one progress line: ``label: done[/total] unit (pct%), rate, ETA|time``
LINE = re.compile(r"^[a-z][\w -]*(?: \([a-z ]+\))?: [\d.,]+(?: [kMGT]?B)?(?:/[\d.,]+)?\b.*"
                  r"(ETA|done in|so far)", re.M)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return synthesize(tmp_path_factory.mktemp("progress") / "tiny",
                      ModelConfig.from_json_dict(size_config("tiny")), seed=1)


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("text") / "t.txt"
    p.write_bytes(b"def add(a, b):\n    return a + b\n\nclass Point:\n    x = 1\n" * 2)
    return p


def k3(*args: object, every: str | None = "0", timeout: float = 120,
       env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, K3_THREADS="1", **(env or {}))
    env.pop("K3_PROGRESS_EVERY", None)
    if every is not None:
        env["K3_PROGRESS_EVERY"] = every
    return subprocess.run([*K3, *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=timeout)


def progress_lines(stream: str, label: str) -> list[str]:
    return [ln for ln in stream.splitlines() if LINE.match(ln) and ln.startswith(label)]


def check(res: subprocess.CompletedProcess, label: str) -> list[str]:
    """Progress lines of ``label`` on stderr, none on stdout, and a closing line."""
    assert res.returncode == 0, res.stderr
    lines = progress_lines(res.stderr, label)
    assert lines, res.stderr
    assert not LINE.search(res.stdout) and "ETA" not in res.stdout, res.stdout
    assert "\r" not in res.stderr  # not a terminal: whole lines only
    assert "done in" in lines[-1]
    return lines


def quiet(res: subprocess.CompletedProcess, label: str) -> None:
    assert res.returncode == 0, res.stderr
    assert not progress_lines(res.stderr, label) and "ETA" not in res.stderr, res.stderr


def test_perplexity_reports_windows_on_stderr_and_json_stays_clean(model, text):
    res = k3("perplexity", model, text, "--ctx", "16", "--json")
    lines = check(res, "perplexity:")
    assert re.match(r"perplexity: \d+/(\d+) windows \(\d+%\)", lines[0])
    total = int(re.search(r"/(\d+) windows", lines[0]).group(1))
    assert json.loads(res.stdout)["windows"] == total
    assert f"{total}/{total} windows (100%)" in lines[-1]
    quiet(k3("perplexity", model, text, "--ctx", "16", "-q"), "perplexity:")


def test_a_short_run_logs_no_progress_by_default(model, text):
    """Not a terminal and under K3_PROGRESS_EVERY's default 5 s: not one progress line."""
    res = k3("perplexity", model, text, "--ctx", "16", every=None)
    assert res.returncode == 0 and not progress_lines(res.stderr, "perplexity"), res.stderr


@pytest.mark.slow
def test_bench_decode_reports_each_stage(model):
    args = ("bench", "decode", model, "--gen", "2", "--repeat", "1", "--bandwidth-mb", "1",
            "--backend", "numpy")
    lines = check(k3(*args, "--prefill", "2"), "bench decode")
    stages = {re.match(r"bench decode \((\w+)\)", ln).group(1) for ln in lines}
    assert stages == {"timed", "prefill", "yardsticks", "check"}
    assert any("2/2 tokens (100%)" in ln for ln in lines if "(timed)" in ln), lines
    quiet(k3(*args, "--prefill", "0", "--no-check", "-q"), "bench decode")


def test_synth_reports_shards(tmp_path):
    lines = check(k3("synth", tmp_path / "a", "--size", "tiny"), "synth:")
    assert "14/14 shards (100%)" in lines[-1] and "written" in lines[-1], lines
    quiet(k3("synth", tmp_path / "b", "--size", "tiny", "-q"), "synth:")


def test_pack_trunk_reports_bytes(model, tmp_path):
    lines = check(k3("pack-trunk", model, tmp_path / "t"), "pack-trunk:")
    assert re.search(r"MB/[\d.]+ MB \(100%\)", lines[-1]) and "layer 13/13" in lines[-1]
    quiet(k3("pack-trunk", model, tmp_path / "u", "-q"), "pack-trunk:")


def test_doctor_reports_checks_scratch_bytes_and_read_tests(tmp_path):
    args = ("doctor", "--probe-mb", "4", "--probe-dir", tmp_path, "--json")
    res = k3(*args)
    assert res.returncode in (0, 1), res.stderr
    json.loads(res.stdout)  # the report alone on stdout
    res = subprocess.CompletedProcess(res.args, 0, res.stdout, res.stderr)
    lines = check(res, "doctor")
    assert {re.match(r"doctor \(([\w ]+)\)", ln).group(1) for ln in lines} >= {
        "checks", "scratch file", "read tests"}
    q = k3(*args, "-q")
    assert not progress_lines(q.stderr, "doctor") and "k3 doctor:" not in q.stderr, q.stderr


def test_download_reports_bytes_fetched_and_hashed(tmp_path):
    from fake_hub import FakeHub, FakeRepo

    files = {"model-00001-of-00001.safetensors": os.urandom(3_000_000), "config.json": b"{}"}
    with FakeHub() as hub:
        hub.repos["org/m"] = FakeRepo(commits={"b" * 40: files}, refs={"main": "b" * 40},
                                      lfs={"model-00001-of-00001.safetensors"})
        env = dict(os.environ, HF_ENDPOINT=hub.endpoint, HF_HOME=str(tmp_path / "hf"),
                   HF_HUB_DISABLE_TELEMETRY="1", K3_PROGRESS_EVERY="0")
        env.pop("HF_HUB_OFFLINE", None)
        res = subprocess.run([*K3, "download", "org/m", str(tmp_path / "m")], env=env,
                             capture_output=True, text=True, timeout=120)
        lines = check(res, "download")
        fetch = [ln for ln in lines if ln.startswith("download (fetch)")]
        verify = [ln for ln in lines if ln.startswith("download (verify)")]
        assert "3.00 MB/3.00 MB (100%)" in fetch[-1] and "3.00 MB/3.00 MB (100%)" in verify[-1]
        assert res.stdout.startswith("OK: 2 files") and res.stdout.count("\n") == 1
        q = subprocess.run([*K3, "download", "org/m", str(tmp_path / "q"), "-q"], env=env,
                           capture_output=True, text=True, timeout=120)
        assert q.returncode == 0 and q.stderr == "" and q.stdout.startswith("OK: 2 files")


def tune_args(model: Path) -> tuple[object, ...]:
    """The shortest tune: one option a knob, two runs each (about 7 s here)."""
    return ("tune", model, "--backend", "numpy", "--threads", "1", "--expert-readers", "1",
            "--lookahead", "off", "--spec", "off", "--repeat", "2", "--gen", "2", "--force")


@pytest.mark.slow
def test_tune_reports_timed_runs(model, tmp_path):
    res = k3(*tune_args(model), "--json", env={"K3_CONFIG_DIR": str(tmp_path)})
    lines = check(res, "tune:")
    done = re.search(r"tune: (\d+)/(\d+) runs \(100%\)", lines[-1])
    assert done is not None and done.group(1) == done.group(2), lines
    assert json.loads(res.stdout)["preset"] == "tuned"


@pytest.mark.slow
def test_tune_quiet(model, tmp_path):
    q = k3(*tune_args(model), "-q", env={"K3_CONFIG_DIR": str(tmp_path)})
    quiet(q, "tune:")
    assert "tune: trying" not in q.stderr and "reference (--backend" not in q.stderr


def test_terminal_redraws_one_line_and_ends_it(model, text):
    """In a terminal: carriage returns, the final figures, then a newline before the result."""
    env = dict(os.environ, K3_THREADS="1", TERM="xterm")
    env.pop("K3_PROGRESS_EVERY", None)
    child = pexpect.spawn(K3[0], [*K3[1:], "perplexity", str(model), str(text), "--ctx", "16"],
                          env=env, encoding="utf-8", timeout=120, dimensions=(24, 200))
    child.expect(pexpect.EOF)
    child.close()
    out = child.before
    assert child.exitstatus == 0, out
    bar = re.search(r"\rperplexity: (\d+)/\1 windows \(100%\)[^\r\n]*done in \d+ s\x1b\[K\r\n", out)
    assert bar is not None, repr(out)
    before = out[: bar.start()]
    assert before.count("\n") == 0  # every earlier draw went back over the same line
    assert out[bar.end():].splitlines()[0].startswith("k3: kernel=")  # results on a fresh line


def test_terminal_redraws_at_most_ten_times_a_second():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    now = [0.0]
    out = Tty()
    old = os.environ.pop("TERM", None)
    try:
        os.environ["TERM"] = "xterm"
        with Progress("work", 1000, unit="step", stream=out, clock=lambda: now[0]) as bar:
            for i in range(1000):  # 1000 updates in 2 s
                now[0] = i * 0.002
                bar.update(i + 1)
    finally:
        os.environ.pop("TERM")
        if old is not None:
            os.environ["TERM"] = old
    text = out.getvalue()
    assert 15 <= text.count("\r") <= 22  # about 10 a second over 2 s, and the final draw
    assert text.endswith("\x1b[K\n") and text.count("\n") == 1
    assert "work: 1,000/1,000 steps (100%)" in text.rsplit("\r", 1)[1]
