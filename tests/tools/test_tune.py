"""``k3 tune``: writes a valid user preset that ``k3 presets show`` lists and ``k3 run
--preset`` uses (same ids as ``--backend numpy``); refuses, and never keeps, a setting whose
ids differ (a real, deliberately wrong kernel backend registered as a plugin); never replaces
a preset without ``--force``; one-line refusals; budgets sized to the model and the machine;
a candidate kept only when it wins beyond the noise of repeated runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from k3core.cli.app import app
from k3core.model.config import ModelConfig
from k3core.model.forward import lookahead_mode
from k3core.model.shapes import size_config
from k3core.run.presets import check_preset_file
from k3core.testing.disk import disk_tmpdir
from k3core.testing.wrong_kernels import WRONG, register_wrong_kernels, unregister_wrong_kernels
from k3core.tools.synth.writer import synthesize
from k3core.tools.tune import KNOBS, thread_counts

runner = CliRunner()
IDS = "3,7,11,5,9"
CACHE_GB = f"{10 * 8192 / 1e9:.9f}"


@pytest.fixture(scope="module")
def model():
    with disk_tmpdir("k3-tune-") as d:
        cfg = ModelConfig.from_json_dict(size_config("tiny", {"num_experts": 32,
                                                              "num_experts_per_token": 4}))
        yield synthesize(d / "tiny32", cfg, 2)


@pytest.fixture()
def config_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("K3_CONFIG_DIR", str(tmp_path / "cfg"))
    return tmp_path / "cfg" / "presets"


@pytest.fixture()
def wrong():
    register_wrong_kernels()
    yield WRONG
    unregister_wrong_kernels()


def tune(model: Path, *extra: str) -> object:
    return runner.invoke(app, ["tune", str(model), "--cache-gb", CACHE_GB, "--gen", "2",
                               "--repeat", "2", "--threads", "1", "--expert-readers", "2",
                               "--expert-readers", "4", *extra])


@pytest.mark.slow
def test_tune_refuses_a_setting_whose_ids_differ_and_writes_a_preset_run_uses(
        model: Path, config_dir: Path, wrong: str, tmp_path: Path) -> None:
    res = tune(model, "--backend", wrong, "--backend", "numpy", "--name", "box", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert {"backend": wrong} in doc["refused"]
    refused = [t for t in doc["trials"] if t["setting"] == {"backend": wrong}]
    assert refused and not refused[0]["kept"] and "differ" in refused[0]["note"]
    assert all(t["ids"] == doc["reference"]["ids"] for t in doc["trials"] if t["kept"])
    assert doc["setting"]["backend"] == "numpy"
    path = config_dir / "box.yaml"
    assert Path(doc["preset_path"]) == path
    preset = check_preset_file(path, plugins=True)
    assert preset.backend == "numpy" and preset.threads == 1
    assert preset.lookahead in ("on", "off") and preset.expert_readers in (2, 4)
    assert "REFUSED" not in path.read_text()

    show = runner.invoke(app, ["presets", "show", "box"])
    assert show.exit_code == 0 and f"# from: {path}" in show.output
    listed = runner.invoke(app, ["presets", "--json"])
    assert "box" in [p["name"] for p in json.loads(listed.stdout)["presets"]]

    out = tmp_path / "run.json"
    ran = runner.invoke(app, ["run", str(model), "--preset", "box", "--ids", IDS, "--gen", "2",
                              "--out", str(out), "-v"])
    assert ran.exit_code == 0, ran.output
    rec = json.loads(out.read_text())
    assert rec["generated_ids"] == doc["reference"]["ids"]
    assert rec["backend"] == "numpy" and rec["lookahead"] == lookahead_mode(preset.lookahead or "")
    assert "expert_readers = " in ran.output and "(preset box)" in ran.output


@pytest.mark.slow
def test_tune_never_replaces_a_preset_without_force(model: Path, config_dir: Path) -> None:
    config_dir.mkdir(parents=True)
    mine = config_dir / "tuned.yaml"
    mine.write_text("name: tuned\ntrunk_gb: 1.0\ncache_gb: 1.0\n")
    res = tune(model, "--backend", "numpy")
    assert res.exit_code == 3 and "--force" in res.output and "Traceback" not in res.output
    assert mine.read_text() == "name: tuned\ntrunk_gb: 1.0\ncache_gb: 1.0\n"
    res = tune(model, "--backend", "numpy", "--force", "--lookahead", "off")
    assert res.exit_code == 0, res.output
    assert check_preset_file(mine).backend == "numpy"


def test_tune_refuses_when_no_backend_keeps_the_ids(model: Path, config_dir: Path,
                                                    wrong: str) -> None:
    res = tune(model, "--backend", wrong)
    assert res.exit_code == 1 and "no kernel backend decoded the reference's ids" in res.output
    assert not (config_dir / "tuned.yaml").exists()


@pytest.mark.parametrize("args, code, words", [
    (["--name", "Bad Name"], 2, "preset name"),
    (["--name", "auto"], 2, "not 'auto'"),
    (["--name", "laptop"], 3, "shipped"),
    (["--gen", "1"], 2, "--gen"),
    (["--ids", "1,x"], 2, "--ids"),
    (["--lookahead", "maybe"], 2, "--lookahead"),
    (["--expert-readers", "0"], 2, "--expert-readers"),
])
def test_tune_refusals_are_one_line(model: Path, config_dir: Path, args: list[str], code: int,
                                    words: str) -> None:
    res = runner.invoke(app, ["tune", str(model), *args])
    assert res.exit_code == code, res.output
    assert words in res.output and "Traceback" not in res.output


def test_the_candidate_table() -> None:
    assert [k.key for k in KNOBS][:1] == ["backend"]
    assert {"threads", "expert_readers", "lookahead"} <= {k.key for k in KNOBS}
    assert thread_counts(1) == [1] and thread_counts(6) == [1, 2, 4, 6] and thread_counts(8) == [1, 2, 4, 8]


def test_a_preset_carries_lookahead_and_expert_readers() -> None:
    from k3core.run.presets import PresetError, parse_preset

    base = "name: a\ntrunk_gb: 1\ncache_gb: 1\n"
    assert parse_preset(base + "lookahead: off\n").lookahead == "off"  # YAML's bare off
    assert parse_preset(base + "lookahead: on\nexpert_readers: 2\n").expert_readers == 2
    for bad in ("lookahead: maybe\n", "expert_readers: 0\n", "expert_readers: 65\n"):
        with pytest.raises(PresetError):
            parse_preset(base + bad)


@pytest.mark.slow
def test_tune_tries_spec_widths_and_the_preset_carries_them(
        model: Path, config_dir: Path, tmp_path: Path) -> None:
    res = tune(model, "--backend", "numpy", "--lookahead", "off", "--spec", "ngram",
               "--spec-width", "2", "--spec-width", "3", "--name", "specbox", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    tried = [t["setting"] for t in doc["trials"]]
    assert any(s.get("spec_width") == 2 for s in tried) and any(s.get("spec_width") == 3 for s in tried)
    assert all(t["ids"] == doc["reference"]["ids"] for t in doc["trials"] if t["kept"])
    preset = check_preset_file(config_dir / "specbox.yaml", plugins=True)
    assert preset.spec == "ngram" and preset.spec_width in (2, 3)
    out = tmp_path / "spec.json"
    ran = runner.invoke(app, ["run", str(model), "--preset", "specbox", "--ids", IDS, "--gen", "4",
                              "--out", str(out)])
    assert ran.exit_code == 0, ran.output
    assert "speculative decoding: ngram" in ran.output and "(preset specbox)" in ran.output
    rec = json.loads(out.read_text())
    plain = runner.invoke(app, ["run", str(model), "--ids", IDS, "--gen", "4", "--backend", "numpy",
                                "--spec", "off", "--out", str(tmp_path / "plain.json")])
    assert plain.exit_code == 0, plain.output
    assert rec["generated_ids"] == json.loads((tmp_path / "plain.json").read_text())["generated_ids"]
    # a flag still wins over the preset
    off = runner.invoke(app, ["run", str(model), "--preset", "specbox", "--ids", IDS, "--gen", "2",
                              "--spec", "off"])
    assert off.exit_code == 0 and "speculative decoding: ngram" not in off.output


@pytest.mark.parametrize("flags, message", [
    (["--spec", "maybe"], "--spec must be off, ngram or auto"),
    (["--spec-width", "0"], "--spec-width must be in 1..16"),
])
def test_tune_refuses_bad_spec_candidates(model: Path, config_dir: Path, flags: list[str],
                                          message: str) -> None:
    res = runner.invoke(app, ["tune", str(model), *flags])
    assert res.exit_code == 2 and message in res.output


DEMO = Path(__file__).resolve().parents[2] / "demo-model"


def _demo_sizes():
    from k3_storage.plain import PlainStorage

    from k3core.checkpoint.index import CheckpointIndex
    from k3core.model.config import load_config
    from k3core.model.sizes import sizes_from_index

    cfg = load_config(DEMO)
    with CheckpointIndex.open(DEMO, PlainStorage()) as index:
        return cfg, sizes_from_index(cfg, {n: t.nbytes for n, t in index.tensors.items()})


def test_tune_sizes_the_budgets_to_the_model_and_the_machine(config_dir: Path) -> None:
    """The 8 MB demo model used to get the engine's 16 GB / 64 GB defaults in its preset."""
    import psutil

    from k3core.api.units import ALIGN

    res = runner.invoke(app, ["tune", str(DEMO), "--gen", "2", "--repeat", "2", "--backend",
                              "numpy", "--threads", "1", "--expert-readers", "2",
                              "--lookahead", "off", "--spec", "off", "--name", "demo", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    preset = check_preset_file(config_dir / "demo.yaml")
    cfg, sizes = _demo_sizes()
    trunk_most = sizes.trunk_bytes + ALIGN * cfg.n_layers
    assert 0 < preset.trunk_gb * 1e9 <= trunk_most
    assert sizes.largest_layer <= preset.trunk_gb * 1e9  # one ring slot: it can stream
    assert 0 < preset.cache_gb * 1e9 <= sizes.expert_pool_bytes
    assert (preset.trunk_gb + preset.cache_gb) * 1e9 < psutil.virtual_memory().total
    b = doc["budgets"]
    assert b["trunk_gb"] == preset.trunk_gb and b["cache_gb"] == preset.cache_gb
    assert b["planned_bytes"] < b["available_bytes"]
    assert "budgets: trunk" in res.stderr and "sized to the model" in res.stderr

    # a budget larger than the model can use is cut to it, and the report says so
    res = runner.invoke(app, ["tune", str(DEMO), "--gen", "2", "--repeat", "2", "--backend",
                              "numpy", "--threads", "1", "--expert-readers", "2",
                              "--lookahead", "off", "--spec", "off", "--cache-gb", "64",
                              "--name", "demo", "--force"])
    assert res.exit_code == 0, res.output
    assert check_preset_file(config_dir / "demo.yaml").cache_gb * 1e9 == sizes.expert_pool_bytes
    assert "--cache-gb 64 is more than this model can use" in res.stderr
    assert "wrote preset 'demo'" in res.stdout and "budgets:" not in res.stdout


def test_budgets_never_exceed_the_machine() -> None:
    from k3core.api.errors import UsageError
    from k3core.tools.tune_budgets import size_budgets

    cfg, sizes = _demo_sizes()
    b = size_budgets(cfg, sizes, trunk_gb=None, cache_gb=None, prompt_len=5, gen=6,
                     available=8 * 10**9, total=16 * 10**9, baseline=100 * 10**6)
    assert b.trunk_bytes <= b.trunk_most and b.cache_bytes <= b.cache_most
    assert b.planned <= 0.95 * b.available
    # below auto's 2 GB reserve: what the memory plan leaves, still within the machine
    small = size_budgets(cfg, sizes, trunk_gb=None, cache_gb=None, prompt_len=5, gen=6,
                         available=10**9, total=2 * 10**9, baseline=100 * 10**6)
    assert small.trunk_bytes == small.trunk_most and small.planned <= 0.95 * 10**9
    with pytest.raises(UsageError, match="--trunk-gb and --cache-gb: a streamed run .* this "
                                         "machine has 60.00 MB available"):
        size_budgets(cfg, sizes, trunk_gb=0.002, cache_gb=0.004, prompt_len=5, gen=6,
                     available=60 * 10**6, total=16 * 10**9, baseline=55 * 10**6)
    tight = size_budgets(cfg, sizes, trunk_gb=None, cache_gb=None, prompt_len=5, gen=6,
                         available=60 * 10**6, total=16 * 10**9, baseline=55 * 10**6)
    assert tight.planned <= 0.95 * 60 * 10**6 and "below the auto preset's reserve" in tight.how
    assert tight.cache_bytes >= (sizes.topk + 1) * sizes.expert_slot_bytes
    with pytest.raises(UsageError, match="below one ring slot .* 57.00 MB available"):
        size_budgets(cfg, sizes, trunk_gb=None, cache_gb=None, prompt_len=5, gen=6,
                     available=57 * 10**6, total=16 * 10**9, baseline=55 * 10**6)


@pytest.mark.parametrize("timings, kept, won", [
    # ranges overlap: a 40 % noisy baseline and a candidate 10 % faster at the median
    ({"base": [1.0, 1.4, 1.1], "a": [0.9, 1.05, 1.3]}, "base", False),
    # the candidate's worst run beats the baseline's best
    ({"base": [1.0, 1.4, 1.1], "a": [0.5, 0.6, 0.55]}, "a", True),
    # two winners: the lower median
    ({"base": [1.0, 1.1], "a": [0.5, 0.98], "b": [0.7, 0.72]}, "b", True),
    # the slower candidates never win, however steady
    ({"base": [1.0, 1.2], "a": [1.5, 1.5]}, "base", False),
    # touching ranges are not a win
    ({"base": [1.0, 1.2], "a": [0.8, 1.0]}, "base", False),
    # one run each gives no spread to compare against: never a win
    ({"base": [1.0], "a": [0.1]}, "base", False),
])
def test_the_noise_rule(timings: dict[str, list[float]], kept: str, won: bool) -> None:
    from k3core.tools.tune_noise import pick

    assert pick("base", timings) == (kept, won)


def test_rotated_runs_every_option_in_every_position() -> None:
    from k3core.tools.tune_noise import rotated

    rounds = [rotated(["a", "b", "c"], r) for r in range(3)]
    assert rounds == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]


@pytest.mark.slow
def test_each_decision_follows_the_runs_it_reports(model: Path, config_dir: Path) -> None:
    """Whatever this machine's noise, a kept candidate's worst run beats the baseline's best
    in the JSON it reports, and a knob that nothing won keeps its baseline."""
    res = tune(model, "--backend", "numpy", "--backend", "avx2", "--lookahead", "off",
               "--spec", "off", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    for d in doc["decisions"]:
        options = [t for t in doc["trials"] if t["knob"] == d["knob"] and t["kept"]]
        assert all(len(t["runs"]) == 2 and t["median"] is not None for t in options)
        assert all(t["worst"] - t["best"] == pytest.approx(t["spread"]) for t in options)
        kept = next(t for t in options if t["setting"] == d["kept"])
        others = [t for t in options if t is not kept]
        if d["won"]:
            assert "won beyond noise" in d["message"]
            assert any(kept["worst"] < t["best"] for t in others)
        else:
            assert "no candidate won beyond noise" in d["message"]
            assert not any(t["worst"] < kept["best"] for t in others)
    assert "alternating runs each" in res.stderr and "median" in res.stderr


def test_repeat_is_checked(model: Path, config_dir: Path) -> None:
    res = runner.invoke(app, ["tune", str(model), "--repeat", "1"])
    assert res.exit_code == 2 and "--repeat must be in 2..20" in res.output
