"""Shared fixtures for the serve tests: a tiny synthetic model, its engine, a live server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.tools.synth.writer import synthesize

K3 = [sys.executable, "-m", "k3core.cli"]


def k3_inprocess(*args: str, input: str | None = None):
    """Run a ``k3`` command in this process (for refusals that come before any server starts)."""
    from typer.testing import CliRunner

    from k3core.cli.app import app

    return CliRunner().invoke(app, [str(a) for a in args], input=input, env={"K3_THREADS": "1"})


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("K3_MODEL_DIR", None)
    env.setdefault("K3_THREADS", "1")
    env.setdefault("K3_CHAT_HISTORY", "")  # no chat history file in the user's home
    return env


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``k3 synth --size tiny --seed 0``, written once for the session."""
    out = tmp_path_factory.mktemp("serve") / "tiny"
    cfg = ModelConfig.from_json_dict(size_config("tiny", {}), source="--size tiny")
    synthesize(out, cfg, 0)
    return out


@pytest.fixture(scope="session")
def engine(tiny_model: Path) -> Iterator[object]:
    """The Python API's engine on the same model (the reference the server must match)."""
    import k3

    eng = k3.load(tiny_model, threads=1)
    yield eng
    eng.close()


class Served:
    """A ``k3 serve`` subprocess on a free loopback port.

    Its stderr (the start banner, one line per request, warnings) is read as it comes by a
    thread, so a long test never fills the pipe; :meth:`wait_line` waits for a line."""

    def __init__(self, model: Path, *args: str, preexec_fn: Callable[[], object] | None = None):
        self.proc = subprocess.Popen(
            [*K3, "serve", str(model), "--port", "0", *args], stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env=cli_env(), preexec_fn=preexec_fn)
        self.lines: list[str] = []
        self._eof = False
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        try:
            line = self.wait_line(lambda s: "http://" in s and "/v1" in s, timeout=120)
        except AssertionError as exc:
            self.proc.kill()
            self._reader.join(30)
            raise AssertionError(f"k3 serve did not start: {exc}") from None
        self.base = line.split("http://", 1)[1].split()[0]  # host:port/v1
        self.url = "http://" + self.base.removesuffix("/v1")
        self.line = line

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    @property
    def log(self) -> str:
        """Everything the server has written to stderr so far."""
        with self._cond:
            return "".join(self.lines)

    def wait_line(self, pred: Callable[[str], bool], timeout: float = 30.0) -> str:
        """The first stderr line (from the start) that ``pred`` accepts, waiting for it."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines:
                    if pred(line):
                        return line
                left = deadline - time.monotonic()
                if self._eof or left <= 0:
                    raise AssertionError(f"no such line on stderr ({'it ended' if self._eof else 'timed out'}): "
                                         f"{''.join(self.lines)!r}")
                self._cond.wait(left)

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return json.loads(r.read())

    def wait_health(self, pred=lambda h: True, timeout: float = 30.0) -> dict:
        t0 = time.monotonic()
        while True:
            h = self.get("/health")
            if pred(h):
                return h
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"health never satisfied: {h}")
            time.sleep(0.05)

    def stop(self) -> tuple[int, str]:
        """Ctrl-C, then the exit code and all of stderr (stdout must stay empty: a server
        writes no generated text there)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(30)
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.proc.stderr.close()
        out = self.proc.stdout.read()
        self.proc.stdout.close()
        assert out == "", f"k3 serve wrote to stdout: {out!r}"
        return self.proc.returncode, self.log


@pytest.fixture(scope="session")
def server(tiny_model: Path) -> Iterator[Served]:
    s = Served(tiny_model, "--context", "1024", "--threads", "1")
    yield s
    rc, err = s.stop()
    assert "Traceback" not in err, err
    assert rc == 0, err


@pytest.fixture(scope="session")
def client(server: Served):
    import openai

    return openai.OpenAI(base_url=f"http://{server.base}", api_key="unused", max_retries=0, timeout=60)
