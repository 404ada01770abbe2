"""``k3 run`` behaves like the tools people know: text on stdout, diagnostics on stderr,
``-q``/``-v``, the tokenizer found in MODEL_DIR, greedy at temperature 0, end-of-sequence
and ``--stop`` stops, ``--prompt-file -``, short aliases, session files, Ctrl-C at import."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from k3core.cli.app import app
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.tokenizer.encoding import Tokenizer
from k3core.tools.synth.writer import synthesize

runner = CliRunner()
IDS = "3,7,11"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return synthesize(tmp_path_factory.mktemp("out") / "tiny",
                      ModelConfig.from_json_dict(size_config("tiny")), seed=1)


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """The same architecture with other weights (a session of one must not resume on it)."""
    return synthesize(tmp_path_factory.mktemp("out") / "other",
                      ModelConfig.from_json_dict(size_config("tiny")), seed=2)


@pytest.fixture(scope="module")
def tok(model):
    return Tokenizer.from_dir(model, vocab_size=1024)


def k3(*args, **kw):
    return runner.invoke(app, [str(a) for a in args], **kw)


def record(tmp_path, *args, name="r.json", **kw):
    out = tmp_path / name
    res = k3("run", *args, "--out", out, **kw)
    assert res.exit_code == 0, res.output
    return res, json.loads(out.read_text())


def test_stdout_is_the_text_alone_and_stderr_the_report(model, tok, tmp_path):
    res, rec = record(tmp_path, model, "--ids", IDS, "--gen", "6", "--ignore-eos")
    assert res.stdout == tok.decode(rec["generated_ids"])  # --ids runs print text too
    for needle in ("memory plan", "STEP", "generated ids: ", "PEAK RSS", "k3: kernel="):
        assert needle in res.stderr and needle not in res.stdout


def test_quiet_leaves_only_the_text_and_verbose_adds_detail(model, tok, tmp_path):
    q, rec = record(tmp_path, model, "--ids", IDS, "-n", "4", "-q", "--ignore-eos")
    assert q.stderr == "" and q.stdout == tok.decode(rec["generated_ids"])
    v = k3("run", model, "--ids", IDS, "-n", "4", "-v", "--ignore-eos")
    assert v.exit_code == 0
    normal = k3("run", model, "--ids", IDS, "-n", "4", "--ignore-eos")
    assert "setting: backend = auto  (default)" in v.stderr
    assert "setting: backend = auto" not in normal.stderr
    assert "request: " in v.stderr and "--- generated text ---" in v.stderr
    assert v.stdout == normal.stdout == q.stdout


def test_text_is_streamed_whole_characters_only(model, tok, tmp_path):
    """Every piece written is whole UTF-8, even when one character spans several ids."""
    text = "Grüße, 世界 👩‍💻 café"
    ids = tok.encode(text)
    assert any(tok.id_to_token_bytes(i).decode("utf-8", "replace") != tok.id_to_token_bytes(i)
               .decode("utf-8", "ignore") for i in ids)  # some id holds part of a character
    from k3core.run.stops import TextStream

    ts = TextStream(tok)
    pieces = [ts.push(i) for i in ids] + [ts.finish()]
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)


def test_stop_text_cuts_before_it_and_never_prints_it(model, tok, tmp_path):
    _, full = record(tmp_path, model, "--ids", IDS, "-n", "12", "--ignore-eos", name="f.json")
    text = full["generated_text"]
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip()
    res, rec = record(tmp_path, model, "--ids", IDS, "-n", "12", "--ignore-eos", "--stop", stop)
    assert rec["stop_reason"] == "stop" and rec["generated_text"] == text[: text.find(stop)]
    assert res.stdout == rec["generated_text"] and stop not in res.stdout
    assert full["generated_ids"][: len(rec["generated_ids"])] == rec["generated_ids"]


def test_stops_at_end_of_sequence_unless_ignore_eos(tmp_path):
    probe = synthesize(tmp_path / "probe", ModelConfig.from_json_dict(size_config("tiny")), seed=1)
    first = json.loads((lambda o: (k3("run", probe, "--ids", IDS, "-n", "3", "--ignore-eos",
                                      "--out", o), o.read_text())[1])(tmp_path / "p.json"))
    eos = first["generated_ids"][1]
    cfg = size_config("tiny")
    m = synthesize(tmp_path / "eos", ModelConfig.from_json_dict({**cfg, "eos_token_id": eos}),
                   seed=1)
    res, rec = record(tmp_path, m, "--ids", IDS, "-n", "3")
    assert rec["generated_ids"] == first["generated_ids"][:2] and rec["stop_reason"] == "eos"
    assert f"end-of-sequence id {eos} reached after 2 of 3 tokens" in res.stderr
    _, rec = record(tmp_path, m, "--ids", IDS, "-n", "3", "--ignore-eos")
    assert rec["generated_ids"] == first["generated_ids"]


def test_tokenizer_end_of_sequence_id_is_a_stop(model, tok):
    import k3

    with k3.load(model) as engine:
        assert tok.special_token_id("[EOS]") in engine.eos_ids


def test_temperature_zero_is_greedy(model, tmp_path):
    _, greedy = record(tmp_path, model, "--ids", IDS, "-n", "5", "--ignore-eos", name="g.json")
    res, zero = record(tmp_path, model, "--ids", IDS, "-n", "5", "--ignore-eos",
                       "--temperature", "0", "--top-k", "5", "--seed", "3")
    assert zero["generated_ids"] == greedy["generated_ids"] and zero["sampling"] is None
    assert "sampling:" not in res.stderr


def test_prompt_file_dash_reads_stdin_and_short_aliases(model, tmp_path):
    text = "Hello from stdin, ünïcode"
    _, a = record(tmp_path, model, "-f", "-", "-n", "2", "-t", "1", input=text.encode(),
                  name="a.json")
    _, b = record(tmp_path, model, "-p", text, "-n", "2", name="b.json")
    assert a["prompt_ids"] == b["prompt_ids"] and a["generated_ids"] == b["generated_ids"]
    assert a["threads"] == 1


def test_out_records_the_request_and_the_plan_with_sources(model, tmp_path):
    _, rec = record(tmp_path, model, "--ids", IDS, "-n", "1", "--cache-gb", "0.01",
                    env={"K3_THREADS": "1"})
    assert rec["request"]["engine"]["cache_gb"] == 0.01
    assert rec["request"]["generation"]["max_tokens"] == 1
    s = rec["plan"]["settings"]
    assert s["cache_gb"] == {"value": 0.01, "source": "flag --cache-gb"}
    assert s["threads"] == {"value": 1, "source": "env K3_THREADS"}
    assert s["incremental"] == {"value": True, "source": "default"}
    assert rec["plan"]["memory"]["rows"]["TOTAL"] == rec["memory_plan"]["total"]
    assert rec["plan"]["tokenizer"] == str(model)  # found in MODEL_DIR


def test_incremental_is_the_default_and_full_recompute_gives_the_same_ids(model, tmp_path):
    res, inc = record(tmp_path, model, "--ids", IDS, "-n", "5", "--ignore-eos", name="i.json")
    assert inc["incremental"] is True and "(incremental)" in res.stderr
    res, full = record(tmp_path, model, "--ids", IDS, "-n", "5", "--ignore-eos",
                       "--full-recompute")
    assert full["incremental"] is False and "(full recompute)" in res.stderr
    assert full["generated_ids"] == inc["generated_ids"]


# ---- session files ------------------------------------------------------------------------
def test_save_state_then_load_state_continues_the_sequence(model, tmp_path):
    state = tmp_path / "s.k3s"
    res, a = record(tmp_path, model, "--ids", "3,7", "-n", "3", "--ignore-eos", "--save-state",
                    state, name="a.json")
    assert f"wrote {state} (" in res.stderr and state.stat().st_size > 0
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    _, b = record(tmp_path, model, "--load-state", state, "--ids", "11,5", "-n", "3",
                  "--ignore-eos", "--dump-logits", tmp_path / "b.f32", name="b.json")
    whole = ",".join(map(str, [3, 7, *a["generated_ids"], 11, 5]))
    _, c = record(tmp_path, model, "--ids", whole, "-n", "3", "--ignore-eos",
                  "--dump-logits", tmp_path / "c.f32", name="c.json")
    assert b["generated_ids"] == c["generated_ids"]
    assert (tmp_path / "b.f32").read_bytes() == (tmp_path / "c.f32").read_bytes()


def test_load_state_refusals(model, other, tmp_path):
    state = tmp_path / "s.k3s"
    assert k3("run", model, "--ids", "3,7", "-n", "2", "--save-state", state).exit_code == 0
    res = k3("run", other, "--ids", "5", "-n", "1", "--load-state", state)
    assert res.exit_code == 2 and "another model or config" in res.stderr
    res = k3("run", model, "--ids", "5", "-n", "1", "--layers", "3", "--load-state", state)
    assert res.exit_code == 2 and "another model or config" in res.stderr
    bad = tmp_path / "bad.k3s"
    data = bytearray(state.read_bytes())
    data[-3] ^= 0xFF
    bad.write_bytes(bytes(data))
    res = k3("run", model, "--ids", "5", "-n", "1", "--load-state", bad)
    assert res.exit_code == 2 and "damaged" in res.stderr
    bad.write_bytes(state.read_bytes()[:40])
    res = k3("run", model, "--ids", "5", "-n", "1", "--load-state", bad)
    assert res.exit_code == 2 and "session file" in res.stderr
    bad.write_bytes(b"not a state file at all")
    res = k3("run", model, "--ids", "5", "-n", "1", "--load-state", bad)
    assert res.exit_code == 2 and "bad magic" in res.stderr
    res = k3("run", model, "--ids", "5", "-n", "1", "--load-state", tmp_path / "missing")
    assert res.exit_code == 2 and "no such file" in res.stderr
    for res in [k3("run", model, "--ids", "5", "--load-state", state, "--full-recompute")]:
        assert res.exit_code == 2 and "--load-state needs incremental" in res.stderr
    assert "Traceback" not in res.output


def test_save_state_with_full_recompute_writes_nothing(model, tmp_path):
    state = tmp_path / "s.k3s"
    res = k3("run", model, "--ids", "3", "-n", "1", "--full-recompute", "--save-state", state)
    assert res.exit_code == 0 and "nothing written" in res.stderr and not state.exists()


# ---- Ctrl-C while the command line is still importing -------------------------------------
def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.2])
def test_ctrl_c_during_import_is_one_line(model, delay):
    """SIGINT once the command line has started importing its libraries (typer is among the
    first), while typer, numpy and the kernels import (``-X importtime`` reports each import
    on stderr as it completes). The run asks for 200 tokens, so that however fast the
    machine, the signal lands before the process has gone (during the imports, the run, or
    the interpreter's shutdown: the same line and exit 130 in each)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("K3_")}
    p = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "k3core.cli", "run",
                          str(model), "--ids", IDS, "-n", "200"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env, preexec_fn=_default_sigint)
    assert p.stderr is not None
    seen = []
    for raw in p.stderr:
        seen.append(raw.decode("utf-8", "replace"))
        if seen[-1].split()[-1:] and seen[-1].split()[-1].startswith("typer."):
            break
    else:
        pytest.fail("typer was never imported:\n" + "".join(seen))
    time.sleep(delay)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    text = err.decode("utf-8", "replace")
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    assert p.returncode == 130, text
    assert text.strip().splitlines()[-1] == "k3: error: interrupted"


def test_quiet_handler_before_the_command_exits_130_at_once():
    """The import-time handler itself, without relying on timing."""
    code = ("import os, signal\nfrom k3core.cli.interrupts import quiet_until_command\n"
            "quiet_until_command()\nos.kill(os.getpid(), signal.SIGINT)\nimport time\n"
            "time.sleep(5)\nprint('not reached')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                       preexec_fn=_default_sigint)
    assert p.returncode == 130 and p.stderr == "k3: error: interrupted\n" and p.stdout == ""


@pytest.mark.parametrize("how", ["-m", "script"])
def test_ctrl_c_inside_exec_of_a_string_is_still_exit_130(tmp_path, how):
    """A KeyboardInterrupt that leaves code run by ``exec`` of a string (as it can while a
    dataclass is defined during the command's imports) makes CPython end a ``python -m``
    process that handled it by SIGINT (-2); the command line still exits 130 with its one
    line. Without relying on timing: the stand-in command raises it from inside ``exec``,
    through the guard, run as a module (``python -m k3core``) and as a script (``k3``)."""
    body = ("import sys\nimport k3core.cli.app as app\nfrom k3core.cli.guard import guarded\n"
            "from k3core.cli.__main__ import main\n"
            "@guarded\ndef cmd():\n    print('working', flush=True)\n"
            "    exec('raise KeyboardInterrupt')\n"
            "def fake():\n    try:\n        cmd()\n    except SystemExit as e:\n"
            "        sys.exit(e.code)\n    except BaseException as e:\n"
            "        sys.exit(getattr(e, 'exit_code', 1))\n"
            "app.main = fake\nmain()\nprint('not reached')\n")
    script = tmp_path / "stand_in.py"
    script.write_text(body)
    argv = [sys.executable, str(script)] if how == "script" else [sys.executable, "-m", "stand_in"]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=30, cwd=tmp_path,
                       preexec_fn=_default_sigint)
    assert p.returncode == 130, (p.returncode, p.stderr)
    assert p.stderr == "k3: error: interrupted\n" and p.stdout == "working\n"


def test_ctrl_c_after_the_command_returned_is_one_line():
    """Once the command line's command has returned (its files closed), SIGINT is the quiet
    handler's again, so Ctrl-C while the interpreter shuts down is one line and exit 130, not
    the traceback of a finaliser; without relying on timing (the app is a stand-in that
    checks it runs with Python's own handler, as a guarded command does)."""
    code = ("import os, signal, sys\nimport k3core.cli.app as app\n"
            "from k3core.cli.__main__ import main\nfrom k3core.cli.interrupts import restore\n"
            "def fake():\n    restore()\n"
            "    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler\n"
            "    print('done', flush=True)\n    sys.exit(0)\n"
            "app.main = fake\ntry:\n    main()\nexcept SystemExit:\n    pass\n"
            "os.kill(os.getpid(), signal.SIGINT)\nimport time\ntime.sleep(5)\nprint('not reached')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                       preexec_fn=_default_sigint)
    assert p.returncode == 130 and p.stderr == "k3: error: interrupted\n" and p.stdout == "done\n"
