"""``k3 run`` through the real CLI: every refusal with its exit code and message, and the
flags that change what runs (tokenizer, presets, environment, sampling, stop ids)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from typer.testing import CliRunner

from k3core.cli.app import app
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.tokenizer.encoding import Tokenizer
from k3core.tools.synth.writer import synthesize

runner = CliRunner()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "tiny"
    synthesize(out, ModelConfig.from_json_dict(size_config("tiny")), seed=1)
    return out


@pytest.fixture(scope="module")
def bare(model, tmp_path_factory):
    """The model without its tokenizer files (a copy: shards may not link outside it)."""
    out = tmp_path_factory.mktemp("cli") / "bare"
    out.mkdir()
    for p in model.iterdir():
        if p.name not in ("tiktoken.model", "tokenizer_config.json"):
            shutil.copy(p, out / p.name)
    return out


def k3(*args, env=None):
    return runner.invoke(app, [str(a) for a in args], env=env)


def err(res):
    return res.output + (res.stderr if hasattr(res, "stderr") and res.stderr_bytes else "")


@pytest.mark.parametrize(
    "args, code, needle",
    [
        ([], 2, "Usage"),
        (["run", "{m}", "--gen", "2"], 2, "one of --prompt, --prompt-file or --ids is required"),
        (["run", "{m}", "--ids", "3", "--prompt", "hi", "--tok", "{m}"], 2, "mutually exclusive"),
        (["run", "{bare}", "--prompt", "hi"], 2, "need --tok"),
        (["run", "{m}", "--ids", "3,99999"], 2, "outside the vocabulary"),
        (["run", "{m}", "--ids", "3,x"], 2, "bad --ids"),
        (["run", "{m}", "--ids", ""], 2, "no prompt ids"),
        (["run", "{m}", "--ids", "3", "--gen", "5000"], 2, "--gen must be in 0..4096"),
        (["run", "{m}", "--ids", "3", "--preset", "nosuch"], 2, "unknown preset"),
        (["run", "{m}", "--ids", "3", "--backend", "nosuch"], 2, "unknown kernel backend 'nosuch'"),
        (["run", "{m}", "--ids", "3", "--storage", "nosuch"], 2, "unknown storage backend"),
        (["run", "{m}", "--ids", "3", "--cache-policy", "nosuch"], 2, "unknown cache policy"),
        (["run", "{m}", "--ids", "3", "--ultra-low-memory"], 2, "--ultra-low-memory needs --trunk"),
        (["run", "{m}", "--ids", "3", "--trunk-gb", "4"], 2, "--trunk-gb needs --trunk"),
        (["run", "{m}", "--ids", "3", "--out", "/nonexistent-dir/x.json"], 3, "does not exist"),
        (["run", "{m}", "--ids", "3", "--stop-id", "5000"], 2, "outside the vocabulary"),
        (["run", "{m}", "--ids", "3", "--layers", "99"], 2, "--layers must be in 1..13"),
        (["run", "{m}", "--ids", "3", "--temperature", "-1"], 2, "--temperature must be"),
        (["run", "{m}", "--ids", "3", "--temperature", "nan"], 2, "--temperature must be"),
        (["run", "{m}", "--ids", "3", "--stop", ""], 2, "--stop needs a non-empty text"),
        (["run", "{bare}", "--ids", "3", "--full-recompute", "--load-state", "{m}/config.json"], 2,
         "--load-state needs incremental"),
        (["run", "{m}", "--ids", "3", "--top-p", "1.5"], 2, "--top-p must be"),
        (["run", "{m}", "--ids", "3", "--threads", "0"], 2, "--threads must be >= 1"),
        (["run", "{m}", "--ids", "3", "--prefill-chunk", "0"], 2, "--prefill-chunk must be >= 1"),
        (["run", "{m}", "--ids", "3", "--cache-gb", "0.0000001"], 2, "top-k + 1"),
        (["run", "/nonexistent-model", "--ids", "3"], 2, "model directory /nonexistent-model does not exist"),
        (["run", "{m}", "--prompt-file", "/nonexistent-file", "--tok", "{m}"], 2, "cannot read"),
    ],
)
def test_refusals(model, bare, args, code, needle):
    res = k3(*[a.replace("{m}", str(model)).replace("{bare}", str(bare)) for a in args])
    assert res.exit_code == code, res.output
    assert needle in res.output
    assert "Traceback" not in res.output


def test_stop_id_more_than_eight(model):
    args = ["run", model, "--ids", "3"]
    for i in range(9):
        args += ["--stop-id", i]
    res = k3(*args)
    assert res.exit_code == 2 and "at most 8" in res.output


def test_preset_file_with_unknown_key(model, tmp_path):
    p = tmp_path / "mine.yaml"
    p.write_text("name: mine\ntrunk_gb: 2\ncache_gb: 1\nturbo: true\n")
    res = k3("run", model, "--ids", "3", "--preset", p)
    assert res.exit_code == 2 and "turbo" in res.output


def test_unwritable_out_leaves_nothing(model, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        res = k3("run", model, "--ids", "3", "--gen", "1", "--out", ro / "r.json")
        if os.geteuid() == 0:  # root writes anyway; the check is then about the missing dir
            assert res.exit_code == 0
        else:
            assert res.exit_code == 3 and "not writable" in res.output
    finally:
        ro.chmod(0o700)


def test_prompt_text_round_trip_and_out_json(model, tmp_path):
    out = tmp_path / "r.json"
    res = k3("run", model, "--prompt", "Hello, k3!", "--tok", model, "--gen", "3", "--incremental", "--out", out, "-v")
    assert res.exit_code == 0, res.output
    rec = json.loads(out.read_text())
    tok = Tokenizer.from_dir(model, vocab_size=1024)
    assert rec["prompt_ids"] == tok.encode("Hello, k3!")
    assert rec["generated_text"] == tok.decode(rec["generated_ids"])
    for key in ("full_ids", "layers", "seconds_per_token", "wall_seconds", "peak_rss_bytes",
                "expert_drops", "backend", "storage", "cache_policy"):
        assert key in rec
    assert "k3: kernel=" in res.output and "--- generated text ---" in res.output


def test_prompt_file_bytes_verbatim_equal_prompt(model, tmp_path):
    text = "Grüße, 世界 👩‍💻"
    f = tmp_path / "p.txt"
    f.write_bytes(text.encode())
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert k3("run", model, "--prompt-file", f, "--tok", model, "--gen", "2", "--out", a).exit_code == 0
    assert k3("run", model, "--prompt", text, "--tok", model, "--gen", "2", "--out", b).exit_code == 0
    assert json.loads(a.read_text())["prompt_ids"] == json.loads(b.read_text())["prompt_ids"]


def test_environment_supplies_model_tok_and_threads(model, tmp_path):
    out = tmp_path / "r.json"
    env = {"K3_MODEL_DIR": str(model), "K3_TOK_FILES": str(model), "K3_THREADS": "2"}
    res = k3("run", "--prompt", "hi", "--gen", "1", "--out", out, env=env)
    assert res.exit_code == 0, res.output
    assert "env K3_THREADS" in res.output


def test_bos_and_stop_id(model, tmp_path):
    out = tmp_path / "r.json"
    first = json.loads((lambda: (k3("run", model, "--ids", "3,7", "--gen", "4", "--out", out), out.read_text())[1])())
    stop = first["generated_ids"][1]
    res = k3("run", model, "--ids", "3,7", "--gen", "4", "--stop-id", stop, "--out", out)
    assert res.exit_code == 0 and f"stop id {stop} reached" in res.output
    assert json.loads(out.read_text())["generated_ids"] == first["generated_ids"][:2]
    res = k3("run", model, "--ids", "3", "--gen", "1", "--bos", "--tok", model, "--out", out)
    tok = Tokenizer.from_dir(model, vocab_size=1024)
    assert json.loads(out.read_text())["prompt_ids"] == [tok.special_token_id("[BOS]"), 3]


def test_seeded_sampling_is_reproducible_and_greedy_is_default(model, tmp_path):
    outs = []
    for i in range(2):
        out = tmp_path / f"s{i}.json"
        res = k3("run", model, "--ids", "3,7", "--gen", "5", "--temperature", "1.5", "--top-k", "50", "--seed", "9", "--out", out)
        assert res.exit_code == 0, res.output
        outs.append(json.loads(out.read_text())["generated_ids"])
    assert outs[0] == outs[1]


def test_preset_sets_budgets_and_flag_wins(model, tmp_path):
    res = k3("run", model, "--ids", "3", "--gen", "1", "--preset", "server", "--cache-gb", "0.001")
    assert res.exit_code == 0, res.output
    assert "cache_gb = 0.001  (flag --cache-gb)" in res.output
    assert "trunk_gb = 110.0  (preset server)" in res.output


def test_prefill_only(model, tmp_path):
    dump = tmp_path / "l.f32"
    res = k3("run", model, "--ids", "3,7", "--gen", "0", "--incremental", "--dump-logits", dump)
    assert res.exit_code == 0 and "prefill only" in res.output
    assert dump.stat().st_size == 4 * 1024


def test_without_a_tokenizer_stdout_gets_the_ids(bare, tmp_path):
    out = tmp_path / "r.json"
    res = k3("run", bare, "--ids", "3,7", "--gen", "3", "--ignore-eos", "--out", out)
    assert res.exit_code == 0, res.output
    rec = json.loads(out.read_text())
    assert rec["generated_text"] is None
    assert res.stdout == ",".join(map(str, rec["generated_ids"])) + "\n"


def test_version_and_help():
    assert k3("--version").output.strip().startswith("k3 ")
    res = k3("run", "--help")
    assert res.exit_code == 0 and "--ultra-low-memory" in res.output
