"""``k3 bench decode`` and ``k3 perplexity`` open their engines as ``k3 run`` does
(``open_engine``): a preset applies, the environment layer (``K3_*``) applies, and a memory
plan that does not fit is refused before anything large is allocated."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

import k3core.run.memory_plan
from k3core.cli.app import app
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.plugins.registry import get_registry
from k3core.run.prompt import TOKENIZER_FILES
from k3core.tools.synth.writer import synthesize

runner = CliRunner()
TEXT = b"def add(a, b):\n    return a + b\n" * 4
#: bench decode at its smallest: two tokens, one run, no prefill, no numpy check
BENCH = ["--gen", "2", "--prefill", "0", "--repeat", "1", "--no-check", "--bandwidth-mb", "1",
         "--json", "-q"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return synthesize(tmp_path_factory.mktemp("opening") / "tiny",
                      ModelConfig.from_json_dict(size_config("tiny")), 1)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("opening-text") / "code.py"
    p.write_bytes(TEXT)
    return p


def _other_kernel() -> str:
    """An available kernel backend that ``auto`` would not pick here."""
    reg = get_registry()
    auto = reg.resolve("kernel", "auto")[0].name
    others = [n for n in reg.available("kernel") if n not in (auto, "timed")]
    if not others:
        pytest.skip("one kernel backend only: a preset's choice cannot differ from auto's")
    return "numpy" if "numpy" in others else others[0]


def _threaded_kernel() -> str:
    """An available kernel backend that runs on more than one thread when asked."""
    reg = get_registry()
    for name in ("avx2", "numba"):
        if name in reg.available("kernel"):
            return name
    pytest.skip("no multi-threaded kernel backend here")


def _preset(tmp_path: Path, **settings: object) -> Path:
    lines = ["name: mine", "trunk_gb: 1", "cache_gb: 1",
             *(f"{k}: {v}" for k, v in settings.items())]
    path = tmp_path / "mine.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _bench(model: Path, *args: str, env: dict[str, str] | None = None) -> dict[str, object]:
    res = runner.invoke(app, ["bench", "decode", str(model), *BENCH, *args], env=env)
    assert res.exit_code == 0, res.output
    return json.loads(res.output.strip().splitlines()[-1])


@pytest.mark.slow
def test_bench_decode_takes_a_preset(model, tmp_path):
    kernel = _other_kernel()
    assert _bench(model, "--preset", str(_preset(tmp_path, backend=kernel)))["backend"] == kernel
    threaded = _threaded_kernel()
    preset = str(_preset(tmp_path, backend=threaded, threads=1))
    assert _bench(model, "--preset", preset)["threads"] == 1
    assert _bench(model, "--preset", preset, "--threads", "2")["threads"] == 2  # a flag wins


def test_bench_decode_takes_the_environment(model):
    threaded = _threaded_kernel()
    plain = _bench(model, "--backend", threaded)["threads"]
    want = 1 if plain != 1 else 2
    doc = _bench(model, "--backend", threaded, env={"K3_THREADS": str(want)})
    assert doc["threads"] == want


def test_bench_decode_refuses_a_plan_that_does_not_fit(model, monkeypatch):
    monkeypatch.setattr(k3core.run.memory_plan, "available_bytes", lambda: 20_000_000)
    res = runner.invoke(app, ["bench", "decode", str(model), *BENCH])
    assert res.exit_code == 1, res.output
    assert "k3: error: REFUSING TO START" in res.output and "--cache-gb" in res.output


def _perplexity(model: Path, text: Path, *args: str,
                env: dict[str, str] | None = None) -> tuple[int, str]:
    res = runner.invoke(app, ["perplexity", str(model), str(text), "--ctx", "16", "-q", *args],
                        env=env)
    return res.exit_code, res.output


@pytest.mark.slow
def test_perplexity_takes_a_preset(model, text_file, tmp_path):
    kernel = _other_kernel()
    code, out = _perplexity(model, text_file, "--preset",
                            str(_preset(tmp_path, backend=kernel, cache_policy="lru")))
    assert code == 0, out
    assert f"k3: kernel={kernel} " in out and "cache=lru" in out, out
    code, out = _perplexity(model, text_file, "--json", "--preset", str(_preset(tmp_path,
                            backend=kernel)))
    assert code == 0 and json.loads(out)["kernel"] == kernel, out


@pytest.mark.slow
def test_perplexity_takes_the_environment(model, text_file, tmp_path):
    """A model directory without tokenizer files: ``$K3_TOK_FILES`` names where they are."""
    bare = tmp_path / "bare"
    bare.mkdir()
    for p in model.iterdir():
        if p.name not in TOKENIZER_FILES:
            shutil.copy(p, bare / p.name)
    code, out = _perplexity(bare, text_file)
    assert code == 2 and "tokenizer" in out, out
    code, with_env = _perplexity(bare, text_file, env={"K3_TOK_FILES": str(model)})
    assert code == 0, with_env
    code, beside = _perplexity(model, text_file)
    assert code == 0 and with_env.splitlines()[1:] == beside.splitlines()[1:]


def test_perplexity_refuses_a_plan_that_does_not_fit(model, text_file, monkeypatch):
    monkeypatch.setattr(k3core.run.memory_plan, "available_bytes", lambda: 20_000_000)
    code, out = _perplexity(model, text_file)
    assert code == 1 and "k3: error: REFUSING TO START" in out, out

