"""A prompt too long for the limit is refused before the work it would cost: a file larger
than the limit could spell is not read, and tokenizing stops at the limit (one ``k3: error:``
line, exit 2, bounded time and memory)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from k3core.cli.app import app
from k3core.run.prompt import MAX_PROMPT
from k3core.tokenizer.encoding import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "demo-model"
K3 = [sys.executable, "-m", "k3core.cli"]


def one_error(res_output: str) -> str:
    lines = [ln for ln in res_output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("k3: error: "), res_output
    assert "Traceback" not in res_output
    return lines[0]


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.pop("K3_MODEL_DIR", None)
    e.setdefault("K3_THREADS", "1")
    return e


def test_a_60_mb_prompt_file_is_refused_before_it_is_read(tmp_path):
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:  # 60 MB of text, cheap to write
        chunk = b"hello world " * 100_000
        for _ in range(50):
            f.write(chunk)
    assert big.stat().st_size == 60_000_000
    t0 = time.monotonic()
    r = subprocess.run([*K3, "run", str(DEMO), "--prompt-file", str(big), "--gen", "1"],
                       capture_output=True, text=True, timeout=120, env=env(),
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30)))
    took = time.monotonic() - t0
    assert r.returncode == 2, r.stderr
    line = one_error(r.stderr)
    assert "60,000,000 bytes cannot fit" in line and "refused before reading it" in line
    assert r.stdout == ""
    assert took < 60, took  # generous; the message above is the structural check


def test_standard_input_is_read_no_further_than_the_bound(tmp_path):
    longest = Tokenizer.from_dir(DEMO).max_token_bytes()
    most = MAX_PROMPT * longest
    p = subprocess.Popen([*K3, "run", str(DEMO), "--prompt-file", "-", "--gen", "1"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env())
    assert p.stdin is not None
    sent = 0
    try:
        while sent < 60_000_000:
            p.stdin.write(b"a" * 65536)
            sent += 65536
    except BrokenPipeError:
        pass  # it stopped reading and left: what is asked
    try:
        p.stdin.close()
    except BrokenPipeError:
        pass
    assert p.stderr is not None
    err = p.stderr.read()
    p.wait(timeout=120)
    assert p.returncode == 2, err
    line = one_error(err.decode())
    assert "standard input" in line and f"over {most:,} bytes" in line
    assert sent < 60_000_000  # the writer was cut off long before the end


def test_tokenizing_stops_at_the_limit():
    # within the length bound (no token is longer than the demo's 320 bytes), over the limit
    text = "hello world\n" * 60_000
    r = CliRunner().invoke(app, ["run", str(DEMO), "--prompt", text, "--gen", "1"], env={"K3_THREADS": "1"})
    assert r.exit_code == 2, r.output
    line = one_error(r.output)
    assert f"more than {MAX_PROMPT:,} ids" in line and "tokenizing stopped at" in line
    stopped = int(line.split("after ")[1].split(" characters")[0].replace(",", ""))
    assert stopped < len(text) // 2  # the rest was never tokenized


def test_a_long_prompt_argument_is_refused_before_tokenizing():
    r = CliRunner().invoke(app, ["run", str(DEMO), "-p", "x" * 11_000_000, "--gen", "1"], env={"K3_THREADS": "1"})
    assert r.exit_code == 2, r.output
    assert "refused before tokenizing" in one_error(r.output)


@pytest.mark.parametrize("bos", [False, True])
def test_a_prompt_at_the_limit_still_runs_its_plan(tmp_path, bos):
    # exactly MAX_PROMPT ids (with --bos one fewer from the text) is not refused by the limit
    tok = Tokenizer.from_dir(DEMO)
    text = "hello world\n" * 20_000
    ids = tok.encode_bytes(text.encode())
    n = MAX_PROMPT - 1 if bos else MAX_PROMPT
    while len(ids) > n:
        text = text[: len(text) * n // len(ids)]
        ids = tok.encode_bytes(text.encode())
    from k3core.run.prompt import PromptSpec, prompt_ids

    got, _ = prompt_ids(PromptSpec(text=text, bos=bos), tok, tok.vocab_size, 1)
    assert got[bos:] == ids
