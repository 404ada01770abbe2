"""``k3 run`` in a real terminal (a pseudo-terminal): the text comes out clean on stdout and
a short summary after it on stderr; the per-step table only with ``-v`` or when stdout and
stderr are not the same terminal, so a redirected run and a script capturing stderr keep it.
It used to interleave the table's rows (stderr) with the text (stdout) line by line."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "demo-model"
K3 = [sys.executable, "-m", "k3core.cli"]
RUN = ["run", str(DEMO), "-p", "def fibonacci(n):", "-n", "12"]
ROW = re.compile(r"^\s*\d+\s+\d+\s+\d+\.\d{3}\s")  # a per-step row: STEP TOKEN SECONDS ...
SUMMARY = ("prefill : ", "decode  : ", "total   : ", "experts : ", "peak RSS: ")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("K3_")}
    env.update(K3_THREADS="1", COLUMNS="200", TERM="xterm")
    return env


def _in_pty(args: list[str], stdout_pty: bool = True, stderr_pty: bool = True
            ) -> tuple[str, str, str, int]:
    """Run ``k3 ARGS`` with stdout and/or stderr on one pseudo-terminal (the other a pipe).
    Returns what the terminal showed (``\\r\\n`` made ``\\n``), the piped stdout, the piped
    stderr, and the exit code."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
    p = subprocess.Popen(K3 + args, stdin=subprocess.DEVNULL,
                         stdout=slave if stdout_pty else subprocess.PIPE,
                         stderr=slave if stderr_pty else subprocess.PIPE, env=_env(), cwd=ROOT)
    os.close(slave)
    shown = b""
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # the child closed the terminal (EIO)
                    break
                if not chunk:
                    break
                shown += chunk
            elif p.poll() is not None:
                break
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        os.close(master)
    return (shown.decode("utf-8", "replace").replace("\r\n", "\n"),
            (out or b"").decode("utf-8", "replace"), (err or b"").decode("utf-8", "replace"),
            p.returncode)


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> str:
    """The text of the run, from its ``--out`` record (no terminal involved)."""
    out = tmp_path_factory.mktemp("terminal") / "run.json"
    r = subprocess.run(K3 + [*RUN, "-q", "--out", str(out)], capture_output=True, env=_env(),
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    return str(json.loads(out.read_text())["generated_text"])


def test_one_terminal_shows_the_text_clean_then_a_short_summary(text) -> None:
    shown, _, _, code = _in_pty(RUN)
    assert code == 0, shown
    assert "STEP" not in shown and not any(ROW.match(ln) for ln in shown.splitlines()), shown
    assert text.rstrip("\n") in shown, (text, shown)  # one contiguous run: nothing inside it
    after = shown[shown.index(text.rstrip("\n")) + len(text.rstrip("\n")):]
    lines = [ln for ln in after.splitlines() if ln.strip()]
    assert [ln[:10] for ln in lines if ln.startswith(SUMMARY)] == list(SUMMARY), after
    assert len(lines) <= 8, after  # a short summary
    before = shown[: shown.index(text.rstrip("\n"))]
    assert "memory : " in before and "  TOTAL" not in before  # the plan, short
    assert len(before.splitlines()) <= 8, before


def test_verbose_in_a_terminal_shows_everything() -> None:
    shown, _, _, code = _in_pty([*RUN, "-v"])
    assert code == 0, shown
    assert "STEP" in shown  # the rows, asked for, share lines with the text
    assert "  TOTAL" in shown and "PEAK RSS for the whole run" in shown


def test_stdout_redirected_keeps_the_table_on_the_terminal(text) -> None:
    """``k3 run ... > answer.txt`` typed in a terminal: the text alone in the file, the live
    table and the short summary on the terminal."""
    shown, out, _, code = _in_pty(RUN, stdout_pty=False)
    assert code == 0, shown
    assert out == text
    assert "STEP" in shown and sum(bool(ROW.match(ln)) for ln in shown.splitlines()) == 12
    assert "total   : 12 tokens" in shown


def test_stderr_captured_keeps_the_table_and_the_full_report(text) -> None:
    """A script capturing stderr (``2> log``) gets what it always got."""
    shown, _, err, code = _in_pty(RUN, stderr_pty=False)
    assert code == 0, err
    assert shown.rstrip("\n") == text.rstrip("\n")  # the terminal shows the text alone
    assert "STEP" in err and sum(bool(ROW.match(ln)) for ln in err.splitlines()) == 12
    for needle in ("memory plan", "  TOTAL", "generated ids: ", "PEAK RSS for the whole run"):
        assert needle in err, err
