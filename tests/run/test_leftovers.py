"""No leftovers: a writer removes its own partial file on every exit it can catch, and the
next writer removes the partials of processes that died (docs/exit-codes.md, exit 3).

``k3 pack-trunk`` is stopped mid-write at a known point: the ``faulty`` storage backend
holds the first read of layer 1's run (``K3_FAULT_HOLD``, which changes no byte), after
layer 0 was copied into ``.trunk.bin.partial-PID``. Then the process is killed (SIGKILL:
the partial stays, and the next pack removes it and says so), terminated (SIGTERM, SIGHUP:
the handler removes it and the directory the pack made, then the signal ends the process)
or interrupted (Ctrl-C: exit 130, nothing left). A partial of a live process is left alone;
on a full disk the refusal names it with the bytes the trunk needs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from k3_storage.plain import PlainStorage
from typer.testing import CliRunner

from k3core.api.partials import parse_partial, pid_alive
from k3core.checkpoint.index import CheckpointIndex
from k3core.cli.app import app
from k3core.model.config import ModelConfig, load_config
from k3core.model.shapes import size_config
from k3core.tools.synth.writer import synthesize
from k3core.trunk.pack import layer_run

runner = CliRunner()
posix = pytest.mark.skipif(os.name != "posix", reason="POSIX signals")
pytestmark = posix

# a pack-trunk (or any command) with the test-only `faulty` storage backend registered
# The writer starts with SIGHUP's default action, as from a terminal: a run under ``nohup``
# hands its children SIGHUP ignored, and k3 rightly leaves an ignored signal ignored.
HELD = """
import signal, sys
if hasattr(signal, "SIGHUP"):
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
from k3core.testing.faulty_backend import register_faulty
register_faulty()
from k3core.cli.__main__ import main
sys.argv = ["k3", *sys.argv[1:]]
main()
"""
# k3 synth through the Python API, its progress callback holding after the first shard
SYNTH_HELD = """
import sys, time
from pathlib import Path
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.tools.synth.writer import synthesize

def hold(done, total, nbytes):
    Path(sys.argv[2]).touch()
    time.sleep(120)

synthesize(sys.argv[1], ModelConfig.from_json_dict(size_config("tiny")), 0, progress=hold)
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return synthesize(tmp_path_factory.mktemp("leftovers") / "tiny",
                      ModelConfig.from_json_dict(size_config("tiny")), 4)


@pytest.fixture(scope="module")
def hold_env(model) -> dict[str, str]:
    """Hold the first read of layer 1's trunk run (layer 0 is in the partial by then)."""
    with CheckpointIndex.open(model, PlainStorage()) as index:
        run = layer_run(index, load_config(model / "config.json"), 1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("K3_")}
    env.update(K3_FAULT_MATCH=run.path.name, K3_FAULT_HOLD_OFFSET=str(run.start),
               K3_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    return env


def k3(*args: object):
    return runner.invoke(app, [str(a) for a in args])


def partials(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if parse_partial(p.name)) if d.is_dir() else []


def wait_for(flag: Path, proc: subprocess.Popen, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not flag.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the writer ended early ({proc.returncode}): "
                                 f"{proc.stderr.read() if proc.stderr else ''}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("the writer never reached the held read")
        time.sleep(0.02)


@contextlib.contextmanager
def held_pack(model: Path, trunk: Path, env: dict[str, str], tmp_path: Path
              ) -> Iterator[subprocess.Popen]:
    """``k3 pack-trunk MODEL TRUNK`` stopped inside its write, layer 0 already copied."""
    flag = tmp_path / "held"
    proc = subprocess.Popen([sys.executable, "-c", HELD, "pack-trunk", str(model), str(trunk),
                             "--storage", "faulty"], env={**env, "K3_FAULT_HOLD": str(flag)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(flag, proc)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=60)


def dead_pid() -> int:
    """The PID of a process that has ended."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# ---- SIGKILL: the partial stays, the next pack removes it and says so ----------------------
def test_a_killed_pack_leaves_a_partial_the_next_pack_removes(model, hold_env, tmp_path):
    trunk = tmp_path / "trunk"
    with held_pack(model, trunk, hold_env, tmp_path) as proc:
        left = partials(trunk)
        assert left == [f".trunk.bin.partial-{proc.pid}"]
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert partials(trunk) == left and (trunk / left[0]).stat().st_size > 0  # SIGKILL: stays
    res = k3("pack-trunk", model, trunk)
    assert res.exit_code == 0, res.output
    assert f"removed {trunk / left[0]}" in res.stderr and "no longer running" in res.stderr
    assert partials(trunk) == [] and sorted(p.name for p in trunk.iterdir()) == [
        "trunk.bin", "trunk.json"]


# ---- signals it can catch: nothing left ----------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_terminated_pack_removes_its_partial_and_directory(model, hold_env, tmp_path, sig):
    trunk = tmp_path / "trunk"
    with held_pack(model, trunk, hold_env, tmp_path) as proc:
        assert partials(trunk)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == -sig, err  # the signal still ends the process
    assert not trunk.exists(), list(trunk.iterdir())
    lines = [ln for ln in err.splitlines() if ln.startswith("k3: error:")]
    assert len(lines) == 1 and f"stopped by {sig.name}" in lines[0], err
    assert f".trunk.bin.partial-{proc.pid}" in lines[0] and "Traceback" not in err


def test_an_interrupted_pack_leaves_nothing(model, hold_env, tmp_path):
    trunk = tmp_path / "trunk"
    trunk.mkdir()  # a directory the pack did not make stays, empty
    with held_pack(model, trunk, hold_env, tmp_path) as proc:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err
    assert list(trunk.iterdir()) == []
    assert "k3: error: interrupted" in err and "Traceback" not in err


# ---- other processes' partials -------------------------------------------------------------------
def test_a_live_processs_partial_is_left_alone(model, tmp_path):
    trunk = tmp_path / "trunk"
    trunk.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        theirs = trunk / f".trunk.bin.partial-{sleeper.pid}"
        theirs.write_bytes(b"still being written")
        gone = trunk / f".trunk.bin.partial-{dead_pid()}"
        gone.write_bytes(b"x" * 5000)
        # the sleeper's PID on a partial last written an hour before it started: a reused PID
        reused = trunk / f".trunk.json.partial-{sleeper.pid}"
        reused.write_bytes(b"{")
        os.utime(reused, (time.time() - 3600, time.time() - 3600))
        res = k3("pack-trunk", model, trunk)
        assert res.exit_code == 0, res.output
        assert theirs.read_bytes() == b"still being written"
        assert f"{theirs} is the partial output of process {sleeper.pid}" in res.stderr
        assert "still running; left alone" in res.stderr
        assert not gone.exists() and f"removed {gone}" in res.stderr
        assert not reused.exists() and f"removed {reused}" in res.stderr
    finally:
        sleeper.kill()
        sleeper.wait()
    assert pid_alive(os.getpid()) and not pid_alive(dead_pid())


def test_a_stale_partial_of_a_file_output_is_swept(model, tmp_path):
    out = tmp_path / "run.json"
    stale = tmp_path / f".run.json.partial-{dead_pid()}-ab12cd34"
    stale.write_bytes(b"{")
    res = k3("run", model, "--ids", "3,7", "--gen", "1", "--backend", "numpy", "--out", out)
    assert res.exit_code == 0, res.output
    assert not stale.exists() and f"removed {stale}" in res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]


# ---- a full disk: the refusal names what takes the room ----------------------------------------
@pytest.fixture
def small_disk() -> Iterator[Path]:
    """A 1 MiB tmpfs (root only): less than the tiny model's packed trunk (3 MB)."""
    if os.geteuid() != 0 or not sys.platform.startswith("linux"):
        pytest.skip("mounting a small tmpfs needs root on Linux")
    d = Path(tempfile.mkdtemp(prefix="k3-tmpfs-"))
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "k3test", str(d)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        d.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=False)
        with contextlib.suppress(OSError):
            d.rmdir()


def test_no_space_names_the_partials_and_the_bytes_needed(model, small_disk):
    trunk = small_disk / "trunk"
    trunk.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        theirs = trunk / f".trunk.bin.partial-{sleeper.pid}"
        theirs.write_bytes(b"\1" * 600_000)
        res = k3("pack-trunk", model, trunk)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert res.exit_code == 3, res.output
    err = [ln for ln in res.stderr.splitlines() if ln.startswith("k3: error:")]
    assert len(err) == 1 and "No space left on device" in err[0], res.stderr
    assert "it needs 2.93 MB" in err[0] and "free" in err[0]
    assert f"{theirs} (6" in err[0] and f"process {sleeper.pid}, still running" in err[0]
    assert partials(trunk) == [theirs.name]  # ours removed, theirs kept


# ---- k3 synth: the same for a partial directory --------------------------------------------------
def test_synth_partial_directory_on_sigterm_and_after_sigkill(tmp_path):
    out = tmp_path / "m"
    for sig in (signal.SIGTERM, signal.SIGKILL):
        flag = tmp_path / f"held-{sig.name}"
        proc = subprocess.Popen([sys.executable, "-c", SYNTH_HELD, str(out), str(flag)],
                                stderr=subprocess.PIPE, text=True)
        wait_for(flag, proc)
        assert partials(tmp_path) == [f".m.partial-{proc.pid}"]
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == -sig, err
        if sig == signal.SIGTERM:
            assert partials(tmp_path) == [] and "stopped by SIGTERM" in err
    assert partials(tmp_path) == [f".m.partial-{proc.pid}"]  # SIGKILL: it stays
    res = k3("synth", out, "--size", "tiny")
    assert res.exit_code == 0, res.output
    assert f"removed {tmp_path / f'.m.partial-{proc.pid}'}" in res.stderr
    assert partials(tmp_path) == [] and (out / "config.json").is_file()
