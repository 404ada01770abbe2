"""No output may replace an input or a special file (docs/cli.md, "Outputs").

Every output path goes through one check (:mod:`k3core.api.outputs`): an output that is, or
lands inside, something the command reads (the prompt file, ``--config``, the tokenizer,
MODEL_DIR, the packed trunk, the trace, the session being loaded) is refused with one
``k3: error:`` line and exit 3, and the input is left byte for byte as it was. A FIFO or
``/dev/null`` given as an output is written in place and stays what it was; given as a
directory output it is refused. Each case here exited 0 and clobbered its input before.
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

import k3 as k3api
from k3core.api.errors import OutputError
from k3core.cli.app import app
from k3core.experts.trace import HIST_NAME, TRACE_NAME
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.tools.synth.writer import synthesize

runner = CliRunner()
posix = pytest.mark.skipif(os.name != "posix", reason="POSIX file types")
RUN = ("--ids", "3,7", "--gen", "1", "--backend", "numpy")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return synthesize(tmp_path_factory.mktemp("inputs") / "tiny",
                      ModelConfig.from_json_dict(size_config("tiny")), 4)


@pytest.fixture(scope="module")
def trace_dir(model, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("trace")
    (root / "model").symlink_to(model)
    d = root / "t"
    assert k3("run", model, *RUN, "--dump-cache-trace", d).exit_code == 0
    return d


@pytest.fixture
def dev_null():
    """``/dev/null``, checked afterwards: a writer that renamed a file over it (as root) fails
    the test, and the device is made again at once so nothing else on the machine breaks."""
    before = os.stat("/dev/null")
    yield Path("/dev/null")
    after = os.lstat("/dev/null")
    if not stat.S_ISCHR(after.st_mode):
        os.unlink("/dev/null")
        os.mknod("/dev/null", 0o666 | stat.S_IFCHR, before.st_rdev)
        os.chmod("/dev/null", 0o666)
        pytest.fail("/dev/null was replaced by a regular file (made again)")
    assert after.st_rdev == before.st_rdev
    assert stat.S_IMODE(after.st_mode) == stat.S_IMODE(before.st_mode)


def k3(*args: object, input: str | None = None):
    return runner.invoke(app, [str(a) for a in args], input=input, env={"K3_THREADS": "1"})


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tree(d: Path) -> dict[str, str]:
    """Every file under ``d`` and its digest (hidden ones too)."""
    return {str(p.relative_to(d)): digest(p) for p in sorted(d.rglob("*")) if p.is_file()}


def refused(res, *needles: str) -> str:
    """Exit 3 and one ``k3: error: cannot write ...`` line (other stderr lines are notes)."""
    assert res.exit_code == 3, res.output
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("k3: error:")]
    assert len(errors) == 1 and errors[0].startswith("k3: error: cannot write"), res.stderr
    assert "Traceback" not in res.output
    for n in needles:
        assert n in errors[0], (n, errors[0])
    return errors[0]


# ---- k3 run: an output onto what the run reads ---------------------------------------------
def test_out_onto_the_prompt_file(model, tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("hello there")
    before = digest(prompt)
    for flag in ("--out", "--dump-logits", "--save-state"):
        res = k3("run", model, "-f", prompt, "-n", "1", "--backend", "numpy", flag, prompt)
        refused(res, f"{flag} {prompt}", "--prompt-file", "which this command reads")
        assert "generated" not in res.stdout  # refused before the run
    assert digest(prompt) == before


def test_out_onto_the_config(model, tmp_path):
    config = tmp_path / "c.json"
    config.write_bytes((model / "config.json").read_bytes())
    before = digest(config)
    res = k3("run", model, "--config", config, *RUN, "--out", config)
    refused(res, "--config")
    assert digest(config) == before
    # MODEL_DIR's own config, reached through a link from elsewhere
    link = tmp_path / "link.json"
    link.symlink_to(model / "config.json")
    res = k3("run", model, *RUN, "--out", link)
    refused(res, "MODEL_DIR")
    assert link.is_symlink()


def test_out_into_the_tokenizer_directory(model, tmp_path):
    tok = tmp_path / "tok"
    tok.mkdir()
    for name in ("tiktoken.model", "tokenizer_config.json"):
        (tok / name).write_bytes((model / name).read_bytes())
    before = tree(tok)
    res = k3("run", model, "--tok", tok, "-p", "hi", "-n", "1", "--backend", "numpy",
             "--out", tok / "tiktoken.model")
    refused(res, "tokenizer directory")
    res = k3("run", model, "--tok", tok, "-p", "hi", "-n", "1", "--backend", "numpy",
             "--dump-cache-trace", tok)
    refused(res, "tokenizer directory")
    assert tree(tok) == before


def test_save_state_onto_the_state_it_loads(model, tmp_path):
    state = tmp_path / "s.k3s"
    assert k3("run", model, *RUN, "--save-state", state).exit_code == 0
    before = digest(state)
    res = k3("run", model, *RUN, "--load-state", state, "--save-state", state)
    refused(res, "--load-state")
    assert digest(state) == before


def test_dump_cache_trace_onto_the_replayed_trace(model, trace_dir, tmp_path):
    before = tree(trace_dir)
    res = k3("run", model, *RUN, "--cache-policy", "replay", "--cache-trace",
             trace_dir / TRACE_NAME, "--dump-cache-trace", trace_dir)
    refused(res, "--cache-trace", "would replace")
    res = k3("run", model, *RUN, "--cache-policy", "replay", "--cache-trace",
             trace_dir / TRACE_NAME, "--out", trace_dir / TRACE_NAME)
    refused(res, "--cache-trace")
    assert tree(trace_dir) == before


@posix
def test_a_fifo_inside_the_trace_directory_is_refused_not_replaced(model, tmp_path):
    d = tmp_path / "t"
    d.mkdir()
    os.mkfifo(d / TRACE_NAME)
    res = k3("run", model, *RUN, "--dump-cache-trace", d)
    refused(res, "not a regular file")
    assert stat.S_ISFIFO(os.lstat(d / TRACE_NAME).st_mode)
    assert not (d / HIST_NAME).exists()


@posix
def test_dev_null_is_an_output_and_stays_a_device(model, dev_null):
    for flag in ("--out", "--dump-logits", "--save-state"):
        res = k3("run", model, *RUN, flag, dev_null)
        assert res.exit_code == 0, res.output


# ---- sessions: Session.save and k3 chat's /save ----------------------------------------------
def test_session_save_into_the_model_is_refused(model, tmp_path):
    config = model / "config.json"
    before = tree(model)
    with k3api.load(model, backend="numpy", threads=1) as engine:
        s = engine.session()
        s.generate([3, 7], max_tokens=1)
        for target in (config, model / "new.k3s", model):
            with pytest.raises(OutputError) as err:
                s.save(target)
            assert err.value.exit_code == 3
        assert "which this command reads" in str(err.value) or "directory" in str(err.value)
        assert s.save(tmp_path / "ok.k3s") > 0  # elsewhere it saves
    assert tree(model) == before


def test_chat_save_onto_the_models_config_is_refused(model):
    before = tree(model)
    res = k3("chat", model, "--max-tokens", "2", "--backend", "numpy",
             input=f"Hi\n/save {model / 'config.json'}\n/exit\n")
    assert res.exit_code == 0, res.output  # the conversation goes on after the refusal
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("k3: error:")]
    assert len(lines) == 1 and "cannot write the session file" in lines[0], res.stderr
    assert "MODEL_DIR" in lines[0] and "Traceback" not in res.output
    assert tree(model) == before


# ---- k3 sim-cache --plot ----------------------------------------------------------------
def plot_args(trace_dir: Path) -> tuple[str, ...]:
    """Replay the trace recorded from ``model`` with its own shape (``--model``)."""
    return ("--slots", "40", "--model", str(trace_dir.parent / "model"))


def test_plot_onto_the_trace_or_its_histogram(trace_dir):
    before = tree(trace_dir)
    for victim in (TRACE_NAME, HIST_NAME):
        res = k3("sim-cache", trace_dir / TRACE_NAME, *plot_args(trace_dir), "--plot", trace_dir / victim)
        refused(res, "which this command reads")
    assert tree(trace_dir) == before


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="no /proc")
def test_plot_where_no_file_can_be_made_is_one_line(trace_dir):
    res = k3("sim-cache", trace_dir / TRACE_NAME, *plot_args(trace_dir), "--plot", "/proc/x.png")
    refused(res, "--plot /proc/x.png")
    assert "replaying" not in res.stdout  # refused before the replay


@posix
def test_plot_to_a_fifo_is_written_in_place(trace_dir, tmp_path):
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    res = k3("sim-cache", trace_dir / TRACE_NAME, *plot_args(trace_dir), "--plot", fifo)
    reader.join(30)
    assert res.exit_code == 0, res.output
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert got and got[0].startswith(b"\x89PNG")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe.png"]  # no partial left


@posix
def test_plot_to_dev_null_stays_a_device(trace_dir, dev_null):
    res = k3("sim-cache", trace_dir / TRACE_NAME, *plot_args(trace_dir), "--plot", dev_null)
    assert res.exit_code == 0, res.output


# ---- directory outputs: pack-trunk, synth, bench-ladder, tune -----------------------------------
def test_pack_trunk_into_the_model_is_refused(model):
    before = tree(model)
    for dest in (model, model / "trunk"):
        res = k3("pack-trunk", model, dest)
        refused(res, "MODEL_DIR")
    assert tree(model) == before and not (model / "trunk").exists()


def test_pack_trunk_over_its_config_is_refused(model, tmp_path):
    trunk = tmp_path / "trunk"
    trunk.mkdir()
    config = trunk / "trunk.json"
    config.write_bytes((model / "config.json").read_bytes())
    res = k3("pack-trunk", model, trunk, "--config", config, "--force")
    refused(res, "--config", "would replace")
    assert config.read_bytes() == (model / "config.json").read_bytes()


@posix
@pytest.mark.parametrize("special", ["fifo", "/dev/null"])
def test_a_special_file_as_a_directory_output_is_refused(model, tmp_path, special, dev_null):
    path = dev_null
    if special == "fifo":
        path = tmp_path / "fifo"
        os.mkfifo(path)
    for args in (("synth", path, "--force"), ("pack-trunk", model, path, "--force")):
        res = k3(*args)
        refused(res, "not a directory")
    st = os.lstat(path)
    assert stat.S_ISFIFO(st.st_mode) if special == "fifo" else stat.S_ISCHR(st.st_mode)


def test_bench_ladder_out_dir_inside_the_trunk_is_refused(model, tmp_path):
    trunk = tmp_path / "trunk"
    assert k3("pack-trunk", model, trunk).exit_code == 0
    before = tree(trunk)
    res = k3("bench-ladder", model, trunk, "--out-dir", trunk / "ladder", "--budgets", "0.01")
    refused(res, "TRUNK_DIR")
    assert tree(trunk) == before and not (trunk / "ladder").exists()


def test_tune_preset_inside_the_model_is_refused(model, monkeypatch):
    monkeypatch.setenv("K3_CONFIG_DIR", str(model / "conf"))
    res = runner.invoke(app, ["tune", str(model), "--name", "mine"])
    refused(res, "preset", "MODEL_DIR")
    assert not (model / "conf").exists()
