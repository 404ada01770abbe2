"""``k3 chat`` driven as a person would, in a terminal (pexpect): turns, /save, /load in a new
process, /reset, Ctrl-C during a reply, and the refusals."""

from __future__ import annotations

import re

import pexpect
import pytest
from conftest import K3, cli_env, k3_inprocess

PROMPT = "user> "
STATUS = re.compile(r"\((\d+) tokens, ([^;]+); fed (\d+) prompt tokens after (\d+) carried; "
                    r"the conversation holds (\d+); [0-9.]+ s\)")


def spawn(model, *args: str) -> pexpect.spawn:
    child = pexpect.spawn(K3[0], [*K3[1:], "chat", str(model), *args], env=cli_env(),
                          encoding="utf-8", codec_errors="replace", timeout=60)
    child.expect_exact(PROMPT)
    return child


def turn(child: pexpect.spawn, text: str) -> tuple[str, tuple[str, ...]]:
    """Type a line; the reply as printed (timing removed) and its status fields."""
    child.sendline(text)
    child.expect_exact(PROMPT)
    out = child.before.replace("\r\n", "\n")
    out = out.split("\n", 1)[1] if "\n" in out else out  # drop the echoed line
    m = STATUS.search(out)
    assert m is not None, out
    return STATUS.sub("(status)", out), m.groups()


def command(child: pexpect.spawn, text: str) -> str:
    child.sendline(text)
    child.expect_exact(PROMPT)
    return child.before.replace("\r\n", "\n")


def finish(child: pexpect.spawn) -> int:
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    return child.exitstatus


def test_two_turns_save_load_third_turn_identical(tiny_model, tmp_path):
    saved = tmp_path / "conv.k3s"
    a = spawn(tiny_model, "--max-tokens", "6", "--system", "Be brief.")
    r1, s1 = turn(a, "Hello there")
    r2, s2 = turn(a, "And then?")
    assert s1[3] == "0" and int(s2[3]) == int(s1[4]) - 1  # turn 2 carries turn 1's state
    assert int(s2[2]) < int(s1[2])  # and feeds only its own tokens
    assert "saved" in command(a, f"/save {saved}")
    r3, s3 = turn(a, "A third thing")
    assert finish(a) == 0

    b = spawn(tiny_model, "--max-tokens", "6", "--system", "Be brief.")
    assert "loaded" in command(b, f"/load {saved}")
    r3b, s3b = turn(b, "A third thing")
    assert r3b == r3 and s3b == s3
    assert "conversation reset" in command(b, "/reset")
    again, s_again = turn(b, "Hello there")
    assert again == r1 and s_again == s1  # a reset conversation starts exactly like a new one
    b.sendeof()  # end of input leaves like /exit
    b.expect(pexpect.EOF)
    b.close()
    assert b.exitstatus == 0


def _cut(child: pexpect.spawn, text: str) -> tuple[str, int, int]:
    """Send a turn, Ctrl-C once its reply is under way; (how it ended, carried, held)."""
    child.sendline(text)
    child.expect_exact("think> ")
    child.sendintr()
    child.expect(r"(stopped by Ctrl-C|ended); fed \d+ prompt tokens after (\d+) carried; "
                 r"the conversation holds (\d+)")
    how, carried, held = child.match.group(1), int(child.match.group(2)), int(child.match.group(3))
    child.expect_exact(PROMPT)
    return how, carried, held


@pytest.mark.slow
def test_ctrl_c_stops_the_reply_and_keeps_the_session(tiny_model):
    child = spawn(tiny_model, "--max-tokens", "4000", "--context", "16384")
    how, carried, held = _cut(child, "Tell me everything")  # greedy: no end id for 354 tokens
    assert how == "stopped by Ctrl-C" and carried == 0 and held < 4000
    # (the second reply starts where the first was cut, so it may meet an end id first)
    _, carried2, held2 = _cut(child, "Shorter please")
    assert carried2 == held - 1 and held2 > held  # the cut reply's state carried on
    _interrupt_at_prompt(child)  # at the prompt: only clears the line
    assert finish(child) == 0


def _interrupt_at_prompt(child: pexpect.spawn) -> None:
    """Ctrl-C at the prompt, and its hint. Python's readline can miss a SIGINT that lands
    just before it waits for a key (the handler runs, its select() is not interrupted), so a
    person would press it again: up to five times, three seconds apart."""
    for _ in range(5):
        child.sendintr()
        if child.expect_exact(["/exit or Ctrl-D", pexpect.TIMEOUT], timeout=3) == 0:
            child.expect_exact(PROMPT)
            return
    raise AssertionError("Ctrl-C at the prompt never printed its hint")


def test_bad_commands_and_files_keep_the_conversation(tiny_model, tmp_path):
    junk = tmp_path / "junk.k3s"
    junk.write_bytes(b"not a session")
    child = spawn(tiny_model, "--max-tokens", "3")
    out = command(child, "/bogus")
    assert "k3: error: unknown command /bogus" in out
    assert "k3: error:" in command(child, f"/load {junk}")
    assert "k3: error:" in command(child, f"/load {tmp_path / 'missing.k3s'}")
    assert "nothing to save" in command(child, f"/save {tmp_path / 'empty.k3s'}")
    _, status = turn(child, "Hi")
    assert status[3] == "0"
    assert "k3: error:" in command(child, f"/save {tmp_path / 'no' / 'dir' / 'x.k3s'}")
    _, status = turn(child, "Still here?")
    assert int(status[3]) > 0
    assert finish(child) == 0


def test_a_conversation_from_another_format_is_refused(tiny_model, tmp_path):
    saved = tmp_path / "plain.k3s"
    a = spawn(tiny_model, "--max-tokens", "3", "--chat-format", "plain")
    turn(a, "Hi")
    command(a, f"/save {saved}")
    assert finish(a) == 0
    r = k3_inprocess("chat", tiny_model, "--load", saved, input="")
    assert r.exit_code == 2 and "not a conversation in this chat format" in r.stderr
    c = spawn(tiny_model, "--max-tokens", "3", "--chat-format", "plain", "--load", str(saved))
    _, status = turn(c, "Again")  # --load resumes at start: the turn carries the saved state
    assert int(status[3]) > 0
    assert finish(c) == 0


@pytest.mark.parametrize("args,code,words", [
    (["--max-tokens", "0"], 2, "--max-tokens"),
    (["--context", "0"], 2, "--context"),
    (["--thinking-effort", "medium"], 2, "low, high, max"),
    (["--chat-format", "chatml"], 2, "chat format"),
    (["--spec", "always"], 2, "--spec"),
])
def test_bad_chat_flags_are_refused(tiny_model, args, code, words):
    r = k3_inprocess("chat", tiny_model, *args, input="")
    assert r.exit_code == code, r.output
    assert r.stderr.startswith("k3: error:") and words in r.stderr and "Traceback" not in r.output


def test_a_file_that_is_not_a_session_is_refused_as_bad_input(tiny_model, tmp_path):
    junk = tmp_path / "junk.k3s"
    junk.write_bytes(b"not a session file")
    r = k3_inprocess("chat", tiny_model, "--load", junk, input="")
    assert r.exit_code == 2 and "not a k3 session file" in r.stderr and "Traceback" not in r.output
    r = k3_inprocess("chat", tmp_path / "nothing", input="")
    assert r.exit_code == 2 and "does not exist" in r.stderr and "Traceback" not in r.output
