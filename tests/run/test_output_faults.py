"""Outputs that cannot be written: a full disk, a file-size limit, a read-only directory.

For ``--out``, ``--dump-logits``, ``--dump-cache-trace``, ``k3 pack-trunk`` and ``k3 synth``:
exit 3, one message naming the path and the system's reason, and nothing left behind (no
partial file, no temporary file, no directory the command made). Three real ways to fail:

* a full disk: a small tmpfs mounted for the test (needs root; skipped otherwise);
* a per-process file-size limit (``RLIMIT_FSIZE``; writes past it fail with EFBIG): works
  for any user, so the refusal is exercised everywhere;
* a read-only filesystem (a tmpfs mounted ``ro``; root only) and a parent that is a file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

import k3core.trunk.pack
from k3core.cli.app import app
from k3core.experts.trace import HIST_NAME, TRACE_NAME
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.tools.synth.writer import synthesize

runner = CliRunner()
FILLER = "filler"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return synthesize(tmp_path_factory.mktemp("outfaults") / "tiny",
                      ModelConfig.from_json_dict(size_config("tiny")), 4)


@contextlib.contextmanager
def _tmpfs(options: str) -> Iterator[Path]:
    if os.geteuid() != 0 or not sys.platform.startswith("linux"):
        pytest.skip("mounting a small tmpfs needs root on Linux")
    d = Path(tempfile.mkdtemp(prefix="k3-tmpfs-"))
    try:
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "k3test", str(d)],
                             capture_output=True, text=True)
        if res.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
        try:
            yield d
        finally:
            subprocess.run(["umount", str(d)], check=False)
    finally:
        with contextlib.suppress(OSError):
            d.rmdir()


@pytest.fixture
def full_disk() -> Iterator[Path]:
    """A 64 KiB tmpfs filled to the last byte."""
    with _tmpfs("size=64k") as d:
        with open(d / FILLER, "wb", buffering=0) as fh, contextlib.suppress(OSError):
            while True:
                fh.write(b"\0" * 4096)
        assert shutil.disk_usage(d).free == 0
        yield d


@pytest.fixture
def small_disk() -> Iterator[Path]:
    """A 1 MiB tmpfs: less than the tiny model (4 MB) or its packed trunk (3 MB)."""
    with _tmpfs("size=1m") as d:
        yield d


@pytest.fixture
def read_only() -> Iterator[Path]:
    with _tmpfs("ro,size=64k") as d:
        yield d


def k3(*args: object):
    return runner.invoke(app, [str(a) for a in args])


def exit3(res, *needles: str) -> str:
    out = " ".join(res.output.split())
    assert isinstance(res.exception, SystemExit), f"escaped: {res.exception!r}\n{res.output}"
    assert res.exit_code == 3, out
    assert "Traceback" not in out and "k3: error: cannot write" in out
    for n in needles:
        assert n in out, (n, out)
    return out


def entries(d: Path) -> list[str]:
    """Every name under ``d`` (hidden temporary files included), relative, sorted."""
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


# ---- a full disk ---------------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["--out", "--dump-logits"])
def test_run_output_on_a_full_disk(model, full_disk, flag) -> None:
    res = k3("run", model, "--ids", "3,7", "--gen", "2", flag, full_disk / "result")
    exit3(res, f"{flag} {full_disk / 'result'}", "No space left on device")
    assert "generated ids" in res.output  # the run finished; only the file failed
    assert entries(full_disk) == [FILLER]


def test_cache_trace_on_a_full_disk(model, full_disk) -> None:
    (full_disk / "trace").mkdir()
    res = k3("run", model, "--ids", "3,7", "--gen", "2", "--dump-cache-trace", full_disk / "trace",
             "--out", full_disk / "run.json")
    exit3(res, TRACE_NAME, "No space left on device")
    assert entries(full_disk) == [FILLER, "trace"]


def test_cache_trace_second_file_fails_leaves_neither(model, tmp_path, monkeypatch) -> None:
    """The histogram cannot be staged after the trace was: neither file appears."""
    import k3core.experts.trace as trace

    real = trace._stage

    def stage(path: Path, data: bytes, parts) -> Path:
        if path.name == HIST_NAME:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, data, parts)

    monkeypatch.setattr(trace, "_stage", stage)
    res = k3("run", model, "--ids", "3,7", "--gen", "1", "--dump-cache-trace", tmp_path)
    exit3(res, HIST_NAME, "No space left on device")
    assert entries(tmp_path) == []


@pytest.mark.parametrize("preallocate", [True, False])
def test_pack_trunk_on_a_small_disk(model, small_disk, monkeypatch, preallocate) -> None:
    """With preallocation the disk says no before any byte is copied; without it (a
    filesystem that cannot preallocate) a write fails part-way through."""
    if not preallocate:
        monkeypatch.setattr(k3core.trunk.pack, "_reserve", lambda fd, offset, length: None)
    res = k3("pack-trunk", model, small_disk / "trunk")
    exit3(res, f"packed trunk to {small_disk / 'trunk'}", "No space left on device")
    assert entries(small_disk) == []


def test_synth_on_a_small_disk(small_disk) -> None:
    res = k3("synth", small_disk / "m", "--size", "tiny")
    exit3(res, f"synthetic checkpoint to {small_disk / 'm'}", "No space left on device")
    assert entries(small_disk) == []


# ---- a read-only directory, a parent that is a file ---------------------------------------
@pytest.mark.parametrize("what", ["--out", "--dump-logits", "--dump-cache-trace", "pack-trunk",
                                  "synth"])
def test_read_only_filesystem(model, read_only, what) -> None:
    target = read_only if what == "--dump-cache-trace" else read_only / "x"
    if what == "pack-trunk":
        res = k3("pack-trunk", model, target)
    elif what == "synth":
        res = k3("synth", target, "--size", "tiny")
    else:
        res = k3("run", model, "--ids", "3", "--gen", "1", what, target)
        assert "generated ids" not in res.output  # refused before the run, not after it
    exit3(res, str(read_only))
    assert entries(read_only) == []


@pytest.mark.parametrize("what", ["--out", "--dump-logits", "pack-trunk", "synth"])
def test_parent_is_a_file(model, tmp_path, what) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"x")
    target = blocker / "sub"
    if what == "pack-trunk":
        res = k3("pack-trunk", model, target)
    elif what == "synth":
        res = k3("synth", target, "--size", "tiny")
    else:
        res = k3("run", model, "--ids", "3", "--gen", "1", what, target)
    exit3(res)
    assert entries(tmp_path) == ["file"] and blocker.read_bytes() == b"x"


# ---- a file-size limit (any user) -------------------------------------------------------------
def _limited(limit: int):
    def preexec() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return preexec


def k3_limited(limit: int, *args: object) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("K3_")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return subprocess.run([sys.executable, "-m", "k3core.cli", *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=300,
                          preexec_fn=_limited(limit))


@pytest.mark.skipif(not hasattr(resource, "RLIMIT_FSIZE"), reason="no RLIMIT_FSIZE here")
@pytest.mark.parametrize("what", ["--out", "--dump-logits", "--dump-cache-trace", "pack-trunk",
                                  "synth"])
def test_file_size_limit(model, tmp_path, what) -> None:
    out = tmp_path / "out"
    out.mkdir()
    run = ["run", model, "--ids", "3,7", "--gen", "2", "--backend", "numpy"]
    args = {
        "--out": [*run, "--out", out / "r.json"],
        "--dump-logits": [*run, "--dump-logits", out / "l.bin"],
        "--dump-cache-trace": [*run, "--dump-cache-trace", out],
        "pack-trunk": ["pack-trunk", model, out / f"t-{uuid.uuid4().hex[:6]}"],
        "synth": ["synth", out / "m", "--size", "tiny"],
    }[what]
    res = k3_limited(100, *args)
    err = " ".join(res.stderr.split())
    assert res.returncode == 3, err + res.stdout[-2000:]
    assert "Traceback" not in err and "k3: error: cannot write" in err
    assert "File too large" in err, err
    assert entries(out) == []
