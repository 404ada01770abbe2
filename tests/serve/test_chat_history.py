"""``k3 chat``'s line editing and history, driven in a real terminal (pexpect): Up recalls the
last line, the history file is written and read again by the next session, ``--no-history``
and ``K3_CHAT_HISTORY=`` keep no file, and piped input or a Python without ``readline`` read
lines as before."""

from __future__ import annotations

import re
import stat
import subprocess
import sys

import pexpect
from conftest import K3, cli_env

PROMPT = "user> "
UP = "\x1b[A"
STATUS = re.compile(r"\((\d+) tokens, [^;]+; fed (\d+) prompt tokens after (\d+) carried; "
                    r"the conversation holds (\d+); [0-9.]+ s\)")


def env_for(state_home, **extra: str) -> dict[str, str]:
    env = cli_env()
    env.pop("K3_CHAT_HISTORY", None)
    env["XDG_STATE_HOME"] = str(state_home)
    env.update(extra)
    return env


def spawn(model, env: dict[str, str], *args: str, argv: list[str] | None = None) -> pexpect.spawn:
    cmd = argv or K3
    child = pexpect.spawn(cmd[0], [*cmd[1:], "chat", str(model), "--max-tokens", "3", *args],
                          env=env, encoding="utf-8", codec_errors="replace", timeout=60)
    child.expect_exact(PROMPT)
    return child


def reply(child: pexpect.spawn, keys: str) -> tuple[str, tuple[str, ...]]:
    """Send keys ending a line; (what the terminal showed up to the next prompt, status)."""
    child.send(keys)
    child.expect_exact(PROMPT)
    shown = child.before.replace("\r\n", "\n")
    m = STATUS.search(shown)
    assert m is not None, shown
    return shown, m.groups()


def leave(child: pexpect.spawn) -> None:
    child.sendeof()  # Ctrl-D: the last line typed stays the last in the history
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_up_arrow_resends_the_last_line_and_history_survives_a_restart(tiny_model, tmp_path):
    a = spawn(tiny_model, env_for(tmp_path))
    first, s1 = reply(a, "Hello there\r")
    again, s2 = reply(a, UP + "\r")
    assert "^[[A" not in again and "Hello there" in again.split("think>")[0]
    assert s2[2] != "0"  # a second turn of the same conversation: it carried the first
    leave(a)
    history = tmp_path / "k3" / "chat_history"
    assert history.read_text().splitlines()[-1] == "Hello there"
    assert stat.S_IMODE(history.stat().st_mode) == 0o600

    # a new session: Up recalls the line typed in the last one; a fresh conversation given
    # the same text replies exactly as the first session's first turn did
    b = spawn(tiny_model, env_for(tmp_path))
    shown, s3 = reply(b, UP + "\r")
    assert s3 == s1 and STATUS.sub("", shown) == STATUS.sub("", first)
    leave(b)


def test_no_history_flag_and_empty_variable_keep_no_file(tiny_model, tmp_path):
    c = spawn(tiny_model, env_for(tmp_path), "--no-history")
    reply(c, "Hi\r")
    _, status = reply(c, UP + "\r")  # the session's own line is still under Up
    assert status[2] != "0"
    leave(c)
    d = spawn(tiny_model, env_for(tmp_path, K3_CHAT_HISTORY=""))
    reply(d, "Hi\r")
    leave(d)
    assert not (tmp_path / "k3").exists()


def test_k3_chat_history_names_the_file(tiny_model, tmp_path):
    named = tmp_path / "mine.hist"
    e = spawn(tiny_model, env_for(tmp_path / "state", K3_CHAT_HISTORY=str(named)))
    reply(e, "Named file\r")
    leave(e)
    assert named.read_text().splitlines()[-1] == "Named file"
    assert not (tmp_path / "state").exists()


def test_piped_input_is_read_as_before_and_records_nothing(tiny_model, tmp_path):
    out = subprocess.run([*K3, "chat", str(tiny_model), "--max-tokens", "3"],
                         input="Hello there\n/exit\n", capture_output=True, text=True,
                         env=env_for(tmp_path), timeout=120)
    assert out.returncode == 0, out.stderr
    assert "think> " in out.stdout and STATUS.search(out.stderr)
    assert not (tmp_path / "k3").exists()


def test_without_readline_the_chat_still_reads_lines(tiny_model, tmp_path):
    """A Python built without ``readline``: plain lines, no history file, no traceback."""
    argv = [sys.executable, "-c",
            "import sys; sys.modules['readline'] = None; "
            "from k3core.cli.__main__ import main; sys.argv[0] = 'k3'; main()"]
    f = spawn(tiny_model, env_for(tmp_path), argv=argv)
    _, status = reply(f, "Hello there\r")
    assert status[2] == "0"
    leave(f)
    assert not (tmp_path / "k3").exists()
