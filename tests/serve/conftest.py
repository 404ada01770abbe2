"""Shared fixtures for the serve tests: a tiny synthetic model, its engine, a live server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
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
    """A ``k3 serve`` subprocess on a free loopback port."""

    def __init__(self, model: Path, *args: str, preexec_fn: Callable[[], object] | None = None):
        self.proc = subprocess.Popen(
            [*K3, "serve", str(model), "--port", "0", *args], stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env=cli_env(), preexec_fn=preexec_fn)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if "http://" not in line:
            self.proc.kill()
            raise AssertionError(f"k3 serve did not start: {line!r} {self.proc.stderr.read()!r}")  # type: ignore[union-attr]
        self.base = line.split("http://", 1)[1].split()[0]  # host:port/v1
        self.url = "http://" + self.base.removesuffix("/v1")
        self.line = line

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
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            _, err = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return self.proc.returncode, err


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
