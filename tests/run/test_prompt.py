"""``--prompt`` text that is not valid UTF-8: the argv bytes are taken as given."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from k3core.api.errors import UsageError
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.run.prompt import prompt_text_bytes
from k3core.tokenizer.encoding import Tokenizer
from k3core.tools.synth.writer import synthesize


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("prompt") / "tiny"
    synthesize(out, ModelConfig.from_json_dict(size_config("tiny")), seed=1)
    return out


def test_argv_surrogates_become_the_original_bytes():
    assert prompt_text_bytes("café") == "café".encode()
    assert prompt_text_bytes(os.fsdecode(b"caf\xe9")) == b"caf\xe9"


def test_a_lone_surrogate_not_from_argv_is_refused_with_the_fix():
    with pytest.raises(UsageError, match="--prompt-file"):
        prompt_text_bytes("a\ud800b")


@pytest.mark.skipif(os.name != "posix", reason="argv as bytes is POSIX")
def test_non_utf8_prompt_runs_and_equals_the_prompt_file(model, tmp_path):
    out_a, out_b = tmp_path / "a.json", tmp_path / "b.json"
    raw = b"caf\xe9 \xff"
    f = tmp_path / "p.bin"
    f.write_bytes(raw)
    base = [sys.executable, "-m", "k3core.cli", "run", str(model), "--tok", str(model),
            "--gen", "1", "--backend", "numpy"]
    env = {**os.environ, "LC_ALL": "C.UTF-8", "PYTHONUTF8": "0"}
    a = subprocess.run([*base, "--prompt", raw, "--out", str(out_a)], capture_output=True,
                       env=env, timeout=120)
    assert a.returncode == 0, a.stderr.decode(errors="replace")[-2000:]
    assert b"Traceback" not in a.stderr
    b = subprocess.run([*base, "--prompt-file", str(f), "--out", str(out_b)],
                       capture_output=True, env=env, timeout=120)
    assert b.returncode == 0, b.stderr.decode(errors="replace")[-2000:]
    ids_a = json.loads(out_a.read_text())["prompt_ids"]
    assert ids_a == json.loads(out_b.read_text())["prompt_ids"]
    assert Tokenizer.from_dir(model, vocab_size=1024).decode_bytes(ids_a) == raw
