"""Ctrl-C during ``k3 run``: exit 130, "interrupted", what was made kept, threads stopped, fast.

The subprocess test sends a real SIGINT to ``python -m k3core.cli run`` once the first decode
step has been printed, with a streamed trunk (reader thread) and an expert cache (reader
pool) busy, and ``--out``/``--dump-logits``/``--dump-cache-trace`` requested: the text and
ids so far are printed and ``--out`` is written marked as interrupted. The in-process
test interrupts the decode loop from inside and checks that ``Engine.close`` really stopped
the trunk reader thread and the expert reader pool.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from k3core.cli.app import app
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.run.engine import open_engine
from k3core.run.generate import generate
from k3core.run.request import EngineRequest
from k3core.testing.faulty_backend import disk_backed_dir
from k3core.tokenizer.encoding import Tokenizer
from k3core.tools.synth.writer import synthesize

PROMPT_SECONDS = 10.0  # generous: the measured figure is about 0.1 s


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return disk_backed_dir(tmp_path_factory.mktemp("interrupt"))


@pytest.fixture(scope="module")
def model(work) -> Path:
    return synthesize(work / "m", ModelConfig.from_json_dict(size_config("tiny")), 5)


@pytest.fixture(scope="module")
def trunk(model, work) -> Path:
    out = work / "t"
    assert CliRunner().invoke(app, ["pack-trunk", str(model), str(out)]).exit_code == 0
    return out


def _all_entries(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


def _default_sigint() -> None:
    """A shell that starts the suite in the background ignores SIGINT, and children inherit
    that; give the child the default disposition so Python installs its handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("mode", [
    ["--trunk", "{t}", "--trunk-gb", "0.0005", "--incremental", "--cache-gb", "0.0001"],
    ["--full-recompute"],
])
@pytest.mark.parametrize("delay", [0.0, 0.05])
def test_sigint_while_decoding(model, trunk, tmp_path, mode, delay) -> None:
    """Ctrl-C after some tokens keeps what was made: the text so far is on stdout, the ids on
    stderr, ``--out`` is written whole and marked interrupted, the other outputs are whole,
    no temporary file is left, and the exit code is still 130."""
    out = tmp_path / "out"
    (out / "trace").mkdir(parents=True)
    args = [a.replace("{t}", str(trunk)) for a in mode]
    env = {k: v for k, v in os.environ.items() if not k.startswith("K3_")}
    p = subprocess.Popen(
        [sys.executable, "-m", "k3core.cli", "run", str(model), "--ids", "3,7,11", "--gen", "4096",
         "--ignore-eos", *args, "--out", str(out / "run.json"), "--dump-logits",
         str(out / "logits.bin"), "--dump-cache-trace", str(out / "trace")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, preexec_fn=_default_sigint)
    try:
        assert p.stderr is not None
        seen = []
        for raw in p.stderr:  # wait for the first decode step of the live table (on stderr)
            line = raw.decode("utf-8", "replace")
            seen.append(line)
            if line.split()[:1] == ["0"]:
                break
        else:
            pytest.fail("the run ended before a step was printed:\n" + "".join(seen))
        time.sleep(delay)
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        text, rest = p.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    err = rest.decode("utf-8", "replace")
    assert p.returncode == 130, err
    assert err.strip().splitlines()[-1] == "k3: error: interrupted", err
    assert "Traceback" not in err
    assert took < PROMPT_SECONDS, f"took {took:.1f} s to stop"
    assert _all_entries(out) == ["logits.bin", "run.json", "trace", "trace/expert_hist.json",
                                 "trace/expert_trace.bin"]  # whole files, no temporary one
    rec = json.loads((out / "run.json").read_text())
    assert rec["interrupted"] is True and 1 <= len(rec["generated_ids"]) < 4096
    assert rec["stop_reason"] == "interrupted"  # not "length": it did not run to --gen
    shown = [ln for ln in err.splitlines() if ln.startswith("generated ids: ")]
    assert shown == ["generated ids: " + ",".join(map(str, rec["generated_ids"]))]
    tok = Tokenizer.from_dir(model, vocab_size=1024)
    assert text == tok.decode(rec["generated_ids"]).encode()[: len(text)]  # the text so far
    assert rec["generated_text"].encode() == text
    assert (out / "logits.bin").stat().st_size == 4 * 1024


def test_interrupt_stops_every_thread(model, trunk) -> None:
    before = set(threading.enumerate())
    engine = open_engine(EngineRequest(model_dir=model, trunk=trunk, trunk_gb=0.0005,
                                       trunk_ring=3, cache_gb=0.0001))
    trunk_src = engine.model.trunk
    assert trunk_src.has_reader  # type: ignore[attr-defined]
    reader_threads = trunk_src.threads  # type: ignore[attr-defined]
    assert reader_threads

    def stop(step: int) -> None:
        if step == 2:
            raise KeyboardInterrupt

    try:
        with pytest.raises(KeyboardInterrupt):
            generate(engine.model, [3, 7, 11], 50, incremental=True, before_step=stop)
        pool_threads = list(engine.experts._pool._threads)  # type: ignore[attr-defined]
        assert pool_threads, "the expert reader pool never started"
    finally:
        t0 = time.monotonic()
        engine.close()
        took = time.monotonic() - t0
    assert took < PROMPT_SECONDS
    assert not any(t.is_alive() for t in reader_threads)
    assert not any(t.is_alive() for t in pool_threads)
    assert {t for t in threading.enumerate() if t.is_alive()} <= before


def test_ctrl_c_while_waiting_for_an_expert_read_is_an_interrupt(model, monkeypatch) -> None:
    """Ctrl-C while the decode loop waits on a routed-expert read is an interrupt (exit
    130), not a failed read: it must not be counted as a drop (exit 4), and no slot may keep
    the unfinished read."""
    from k3core.model import names
    from k3core.testing.faulty_backend import register_faulty, unregister_faulty

    cfg = ModelConfig.from_json_dict(size_config("tiny"))
    moe = next(L for L in range(cfg.n_layers) if not cfg.is_dense(L))
    register_faulty()
    monkeypatch.setenv("K3_FAULT_INNER", "plain")
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started ignored
    try:
        engine = open_engine(EngineRequest(model_dir=model, storage="faulty"))
        shard = engine.index.info(names.layer_name(moe, "input_layernorm.weight")).path
        storage = engine.storage
        storage.match = shard.name  # type: ignore[attr-defined]
        gate = threading.Event()
        for e in range(cfg.n_experts):  # every expert read of the first MoE layer waits
            storage.gates[engine.experts.locator.ref(moe, e).offset] = gate  # type: ignore
        timer = threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT))
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                generate(engine.model, [3, 7, 11], 2, incremental=True)
        finally:
            gate.set()
            timer.cancel()
            engine.close()
        cache = engine.experts
        assert cache.stats.drops == 0  # type: ignore[attr-defined]
        assert not any(k >> 20 == moe for k in cache.slot_of)  # type: ignore[attr-defined]
    finally:
        signal.signal(signal.SIGINT, previous)
        unregister_faulty()


def test_an_interrupted_session_says_why_it_stopped(model) -> None:
    """The Python API: ``Session.last`` after a Ctrl-C says ``stop_reason="interrupted"``."""
    engine = open_engine(EngineRequest(model_dir=model))
    try:
        session = engine.session()

        def stop(step: int) -> None:
            if step == 2:
                raise KeyboardInterrupt

        session.before_step = stop  # type: ignore[method-assign]
        with pytest.raises(KeyboardInterrupt):
            session.generate([3, 7, 11], max_tokens=8, ignore_eos=True)
        assert session.last is not None and len(session.last.ids) == 2
        assert session.last.interrupted and session.last.stop_reason == "interrupted"
        again = session.generate([5], max_tokens=2, ignore_eos=True)  # the session goes on
        assert again.stop_reason == "length" and not again.interrupted
    finally:
        engine.close()
