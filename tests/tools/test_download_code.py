"""Downloaded code is data: a model repository's ``*.py`` is never imported or executed.

A fake Hub (``fake_hub``, on 127.0.0.1) serves a real synthetic checkpoint (shards, index,
config, tokenizer) plus ``tokenization_kimi.py`` and friends that would create a marker
file the moment they ran. The model is downloaded and verified, then used the ways a person
uses it: ``k3 run`` with its tokenizer and a text prompt, from inside the downloaded
directory (so it is ``sys.path[0]``), and ``k3 doctor`` on it. The marker never appears.
Verification happens before the model is recorded as complete: a file served with other
bytes than the Hub published fails the download (exit 1) and leaves no record.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_hub import FakeHub, FakeRepo
from typer.testing import CliRunner

from k3core.cli.app import app
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.tools.download.fetch import RECORD
from k3core.tools.synth.writer import synthesize

runner = CliRunner()
REPO = "moonshot-fake/Kimi-K3-code"
COMMIT = "c" * 40
CODE_FILES = ("tokenization_kimi.py", "configuration_kimi.py", "modeling_kimi.py", "__init__.py")


@pytest.fixture(autouse=True)
def offline_except_localhost(tmp_path, monkeypatch):
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
    for var in ("HF_HUB_OFFLINE", "HF_TOKEN", "K3_REVISION"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # never the real Hub


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[dict[str, bytes], Path]:
    root = tmp_path_factory.mktemp("code")
    model = synthesize(root / "model", ModelConfig.from_json_dict(size_config("tiny")), 8)
    marker = root / "EXECUTED"
    payload = (f"import pathlib\npathlib.Path({str(marker)!r}).write_text(__name__)\n"
               "raise SystemExit('downloaded code ran')\n").encode()
    out = {p.name: p.read_bytes() for p in model.iterdir() if p.is_file()}
    out.update(dict.fromkeys(CODE_FILES, payload))
    return out, marker


@pytest.fixture
def hub(files, monkeypatch):
    data, _ = files
    with FakeHub() as h:
        h.repos[REPO] = FakeRepo(commits={COMMIT: data}, refs={"main": COMMIT},
                                 lfs={n for n in data if n.endswith(".safetensors")})
        monkeypatch.setenv("HF_ENDPOINT", h.endpoint)
        yield h


def test_downloaded_python_is_never_run(hub, files, tmp_path) -> None:
    data, marker = files
    out = tmp_path / "k3"
    res = runner.invoke(app, ["download", REPO, str(out)])
    assert res.exit_code == 0, res.output
    assert f"OK: {len(data)} files" in res.output and (out / RECORD).is_file()
    for name in CODE_FILES:
        assert (out / name).read_bytes() == data[name]
    assert not marker.exists()
    env = {k: v for k, v in os.environ.items() if not k.startswith("K3_")}
    for args in (["run", ".", "--tok", ".", "--prompt", "hello", "--gen", "2"],
                 ["doctor", ".", "--no-disk-probe"]):
        p = subprocess.run([sys.executable, "-m", "k3core.cli", *args], cwd=out, env=env,
                           capture_output=True, text=True, timeout=300)
        assert p.returncode in (0, 1), p.stderr  # doctor may find this machine wanting
        assert "Traceback" not in p.stderr and "downloaded code ran" not in p.stderr
        assert not marker.exists(), f"{args[0]} executed downloaded code"
    assert "generated ids" in runner.invoke(
        app, ["run", str(out), "--tok", str(out), "--prompt", "hi", "--gen", "1"]).output
    assert not marker.exists()
    assert not {"tokenization_kimi", "configuration_kimi", "modeling_kimi"} & set(sys.modules)


def test_other_bytes_than_published_fail_before_use(hub, files, tmp_path) -> None:
    data, _ = files
    shard = sorted(n for n in data if n.endswith(".safetensors"))[3]
    bad = bytearray(data[shard])
    bad[-1] ^= 0xFF  # same size, one flipped byte: only the checksum can tell
    hub.repos[REPO].served[shard] = bytes(bad)
    out = tmp_path / "k3"
    res = runner.invoke(app, ["download", REPO, str(out)])
    flat = " ".join(res.output.split())
    assert res.exit_code == 1 and "verification FAILED" in flat and shard in flat, flat
    assert not (out / RECORD).exists()
