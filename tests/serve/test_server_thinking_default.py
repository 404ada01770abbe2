"""A model trained to answer without thinking (the demo model) answers that way unless
asked; any other model thinks by default; ``--think``/``--no-think`` and ``reasoning_effort`` win.
``k3 serve`` and ``k3 chat`` alike."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
from conftest import K3, Served, cli_env

from k3core.serve.chat_format import Message, chat_format_for
from k3core.serve.loading import default_thinking
from k3core.tokenizer.encoding import Tokenizer

DEMO = Path(__file__).resolve().parents[2] / "demo-model"
MESSAGES = [{"role": "user", "content": "def add(a, b):"}]


def test_the_model_config_says_whether_it_thinks(tiny_model, tmp_path):
    assert default_thinking(DEMO / "config.json") is False  # its k3_demo section
    assert default_thinking(tiny_model / "config.json") is True  # random weights, Kimi K3's default
    assert default_thinking(tmp_path / "missing.json") is True


def _chat(s: Served, **extra) -> dict:
    r = httpx.post(f"{s.url}/v1/chat/completions", timeout=60,
                   json={"model": "demo-model", "messages": MESSAGES, "max_tokens": 12, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_the_demo_model_answers_without_thinking_unless_asked():
    tok = Tokenizer.from_dir(DEMO)
    plain = chat_format_for(tok, thinking=False).render([Message("user", MESSAGES[0]["content"])])
    thinking = chat_format_for(tok, thinking=True, effort="high").render(
        [Message("user", MESSAGES[0]["content"])])
    s = Served(DEMO, "--threads", "1", "--context", "512")
    try:
        assert "no thinking unless asked" in s.line
        body = _chat(s)
        assert body["k3"]["prompt_ids"] == plain
        assert body["choices"][0]["message"]["reasoning_content"] is None
        assert body["choices"][0]["message"]["content"]  # it answers in the response channel
        asked = _chat(s, reasoning_effort="high")
        assert asked["k3"]["prompt_ids"] == thinking
    finally:
        rc, err = s.stop()
    assert rc == 0 and "Traceback" not in err
    forced = Served(DEMO, "--threads", "1", "--context", "512", "--think", "--thinking-effort", "high")
    try:
        assert "no thinking" not in forced.line
        assert _chat(forced)["k3"]["prompt_ids"] == thinking
    finally:
        rc, err = forced.stop()
    assert rc == 0 and "Traceback" not in err


def test_k3_chat_takes_the_same_default(tiny_model):
    def banner(model: Path, *args: str) -> str:
        r = subprocess.run([*K3, "chat", str(model), "--max-tokens", "2", *args], input="/exit\n",
                           capture_output=True, text=True, env=cli_env(), timeout=120)
        assert r.returncode == 0, r.stderr
        return r.stderr.splitlines()[0]

    assert "no thinking" in banner(DEMO)
    assert "thinking max" in banner(DEMO, "--think")
    assert "thinking max" in banner(tiny_model)
