"""``k3 perplexity``: the windows score every token once, the figure equals a direct
computation from the logits, it is bit-identical across kernel backends, and every refusal
exits 2 with one line."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from typer.testing import CliRunner

from k3core.api.errors import UsageError
from k3core.cli.app import app
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.model.state import SequenceState
from k3core.plugins.registry import get_registry
from k3core.run.engine import open_engine
from k3core.run.request import EngineRequest
from k3core.tools.perplexity import check_window, perplexity, token_nll, windows
from k3core.tools.synth.writer import synthesize

runner = CliRunner()
TEXT = b"def add(a, b):\n    return a + b\n\n\nclass Point:\n    x = 1\n    y = 2\n" * 3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("ppl") / "tiny"
    synthesize(out, ModelConfig.from_json_dict(size_config("tiny", {"num_hidden_layers": 5,
               "full_attn_layers": [4, 5]})), seed=2)
    return out


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("ppl-text") / "code.py"
    p.write_bytes(TEXT)
    return p


@pytest.mark.parametrize("n, ctx, stride", [(2, 2, 1), (10, 4, 2), (10, 4, 1), (10, 4, 3),
                                            (37, 8, 5), (5, 16, 8), (64, 16, 15), (3, 2, 1)])
def test_windows_score_every_target_once(n, ctx, stride):
    seen = []
    for begin, end, first in windows(n, ctx, stride):
        assert 0 <= begin < first <= end <= n and end - begin <= ctx
        assert first - begin >= ctx - stride or begin == 0
        seen.extend(range(first, end))
    assert seen == list(range(1, n))


def _ids(model):
    from k3core.tokenizer.encoding import Tokenizer

    return Tokenizer.from_dir(model, vocab_size=1024).encode_bytes(TEXT, allow_special=False)


def _engine(model, backend):
    return open_engine(EngineRequest(model_dir=model, backend=backend))


def test_one_window_equals_direct_computation(model):
    ids = _ids(model)
    eng = _engine(model, "numpy")
    try:
        res = perplexity(eng.model, ids, ctx=len(ids) + 1)
        logits = eng.model.forward(np.array(ids), SequenceState(eng.cfg, len(ids)), all_logits=True)
    finally:
        eng.close()
    want = math.fsum(token_nll(logits[:-1], np.array(ids[1:])).tolist()) / (len(ids) - 1)
    assert res.windows == 1 and res.scored == len(ids) - 1
    assert res.mean_nll == want
    assert res.perplexity == math.exp(want)
    # the loss is the negative log softmax of the target
    x = logits[0].astype(np.float64)
    p = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
    assert token_nll(logits[:1], np.array(ids[1:2]))[0] == pytest.approx(-math.log(p[ids[1]]))


def _available():
    reg = get_registry()
    return [n for n in reg.names("kernel") if reg.probe("kernel", n).ok]


def test_bit_identical_across_backends(model):
    ids = _ids(model)
    results = {}
    for name in _available():
        eng = _engine(model, name)
        try:
            results[name] = perplexity(eng.model, ids, ctx=24, stride=16)
        finally:
            eng.close()
    ref = results["numpy"]
    assert ref.windows > 2
    for name, res in results.items():
        assert res.nll_sum.hex() == ref.nll_sum.hex(), name
        assert res == ref, name


@pytest.mark.slow
def test_more_context_changes_the_figure_but_not_the_count(model):
    ids = _ids(model)
    eng = _engine(model, "numpy")
    try:
        a = perplexity(eng.model, ids, ctx=16, stride=15)
        b = perplexity(eng.model, ids, ctx=16, stride=4)
    finally:
        eng.close()
    assert a.scored == b.scored == len(ids) - 1
    assert a.windows < b.windows
    assert a.mean_nll != b.mean_nll


def test_cli_text_and_json(model, text_file):
    res = runner.invoke(app, ["perplexity", str(model), str(text_file), "--ctx", "32",
                              "--backend", "numpy", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    eng = _engine(model, "numpy")
    try:
        direct = perplexity(eng.model, _ids(model), ctx=32)
    finally:
        eng.close()
    assert doc["mean_nll"] == direct.mean_nll and doc["kernel"] == "numpy"
    res = runner.invoke(app, ["perplexity", str(model), str(text_file), "--ctx", "32"])
    assert res.exit_code == 0 and "perplexity :" in res.output


@pytest.mark.parametrize("args, needle", [
    (["--ctx", "1"], "--ctx must be in 2.."),
    (["--ctx", "8", "--stride", "8"], "--stride must be in 1..ctx-1"),
    (["--ctx", "8", "--stride", "0"], "--stride must be in 1..ctx-1"),
    (["--threads", "0"], "--threads must be >= 1"),
])
def test_cli_refusals(model, text_file, args, needle):
    res = runner.invoke(app, ["perplexity", str(model), str(text_file), *args])
    assert res.exit_code == 2
    assert needle in res.output
    assert "Traceback" not in res.output


def test_cli_refuses_missing_short_and_unreadable_inputs(model, text_file, tmp_path):
    res = runner.invoke(app, ["perplexity", str(model), str(tmp_path / "none.txt")])
    assert res.exit_code == 2 and "no such file" in res.output
    res = runner.invoke(app, ["perplexity", str(model), str(tmp_path)])
    assert res.exit_code == 2 and "not a regular file" in res.output
    one = tmp_path / "one.txt"
    one.write_bytes(b"a")
    res = runner.invoke(app, ["perplexity", str(model), str(one)])
    assert res.exit_code == 2 and "at least 2" in res.output
    res = runner.invoke(app, ["perplexity", str(tmp_path / "nomodel"), str(text_file)])
    assert res.exit_code == 2 and "does not exist" in res.output


def test_check_window_defaults_to_half():
    assert check_window(8, None) == 4
    with pytest.raises(UsageError):
        check_window(8, -1)


class _ScaledModel:
    """The real model with its logits multiplied: drives the loss past exp's range or to NaN."""

    def __init__(self, model, scale: float):
        self.model, self.cfg, self.scale = model, model.cfg, scale

    def forward(self, ids, state, *, all_logits=False):
        with np.errstate(all="ignore"):
            return self.model.forward(ids, state, all_logits=all_logits) * np.float32(self.scale)


def test_a_loss_past_exp_range_is_an_infinite_perplexity_and_json_null(model):
    eng = _engine(model, "numpy")
    try:
        res = perplexity(_ScaledModel(eng.model, 1e35), _ids(model), 16, 8)
    finally:
        eng.close()
    assert res.mean_nll > 709 and res.perplexity == math.inf
    assert json.loads(json.dumps(res.to_json(), allow_nan=False))["perplexity"] is None
    assert "past a float's range" in res.lines()[-1]


def test_non_finite_logits_are_refused_not_averaged(model):
    from k3core.api.errors import K3Error

    eng = _engine(model, "numpy")
    try:
        with pytest.raises(K3Error, match="not finite"):
            perplexity(_ScaledModel(eng.model, float("inf")), _ids(model), 16, 8)
    finally:
        eng.close()
