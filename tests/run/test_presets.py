"""Presets: the shipped files, the table, lookup order, refusals, and ``auto``."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from k3core.api.errors import UsageError
from k3core.cli.app import app
from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.model.sizes import sizes_from_config
from k3core.run.preset_auto import auto_budget, auto_preset
from k3core.run.presets import (
    SHIPPED,
    PresetError,
    check_plugins,
    list_presets,
    load_preset,
    parse_preset,
    shipped_preset_dir,
    table_lines,
)

runner = CliRunner()
GB = 1_000_000_000
#: the reference's table (docs/engine-behaviours.md §2): trunk GB, cache GB, ultra
REFERENCE = {
    "ultra": (2.5, 0.31, True),
    "laptop": (3.0, 1.0, False),
    "desktop": (16.0, 10.0, False),
    "workstation": (60.0, 30.0, False),
    "server": (110.0, 13.0, False),
    "max": (110.0, 109.0, False),
}


@pytest.fixture(autouse=True)
def user_dir(tmp_path, monkeypatch):
    """An empty user preset directory, so the machine's own presets never leak in."""
    d = tmp_path / "k3config"
    monkeypatch.setenv("K3_CONFIG_DIR", str(d))
    return d / "presets"


def k3(*args: str):
    return runner.invoke(app, list(args))


def test_every_shipped_file_validates():
    files = sorted(shipped_preset_dir().glob("*.yaml"))
    assert {f.stem for f in files} == set(SHIPPED)
    for f in files:
        res = k3("presets", "validate", str(f))
        assert res.exit_code == 0, res.output
        assert "valid preset" in res.output


def test_shipped_budgets_are_the_reference_table():
    for name, (trunk, cache, ultra) in REFERENCE.items():
        p = load_preset(name)
        assert (p.trunk_gb, p.cache_gb, p.ultra_low_memory) == (trunk, cache, ultra)
        assert p.notes and p.peak_rss_gb


def test_table_lists_seven_presets_in_the_reference_format():
    res = k3("presets")
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[0] == "presets (trunk / expert-cache, in GB):"
    rows = [ln for ln in lines[1:] if ln.startswith("  ")]
    assert [r.split()[0] for r in rows] == [*SHIPPED, "auto"]
    assert rows[1].startswith("  laptop         3.00 /    1.00  ")
    assert rows[-1].startswith("  auto            fit /     fit  ")
    assert len(lines) == 1 + 7 + 2
    assert "--trunk" in lines[-2] and "k3 doctor" in lines[-1]


def test_unknown_preset_exits_2_listing_choices():
    res = k3("presets", "show", "lapton")
    assert res.exit_code == 2
    assert "unknown preset 'lapton'" in res.output and "did you mean 'laptop'" in res.output
    for name in (*SHIPPED, "auto"):
        assert name in res.output


def test_unknown_key_exits_2_naming_it(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("name: mine\ntrunk_gb: 4\ncache_gb: 1\ntrunk_gib: 3\n")
    res = k3("presets", "validate", str(f))
    assert res.exit_code == 2
    assert "unknown key 'trunk_gib'" in res.output
    assert "Traceback" not in res.output


def test_python_object_tag_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    f = tmp_path / "evil.yaml"
    f.write_text(f"name: !!python/object/apply:os.system ['touch {marker}']\n"
                 "trunk_gb: 1\ncache_gb: 1\n")
    res = k3("presets", "validate", str(f))
    assert res.exit_code == 2
    assert "tag" in res.output and "not allowed" in res.output
    assert not marker.exists()
    with pytest.raises(PresetError, match="tag"):
        parse_preset("!!python/object:builtins.dict {}")


@pytest.mark.parametrize("text, words", [
    ("", "empty"),
    ("- 1\n- 2\n", "mapping"),
    ("name: a\nname: b\ntrunk_gb: 1\ncache_gb: 1\n", "appears twice"),
    ("base: &b 1\nname: a\ntrunk_gb: *b\ncache_gb: 1\n", "aliases"),
    ("name: a\ntrunk_gb: [1]\ncache_gb: 1\n", "nested"),
    ("name: a\ntrunk_gb: 0\ncache_gb: 1\n", "trunk_gb"),
    ("name: a\ntrunk_gb: .inf\ncache_gb: 1\n", "trunk_gb"),
    ("name: a\ntrunk_gb: 1\ncache_gb: -1\n", "cache_gb"),
    ("name: A B\ntrunk_gb: 1\ncache_gb: 1\n", "name"),
    ("name: a\ntrunk_gb: '1'\ncache_gb: 1\n", "trunk_gb"),
    ("name: a\ntrunk_gb: 1\ncache_gb: 1\nthreads: 0\n", "threads"),
    ("name: a\ntrunk_gb: 1\n", "missing key 'cache_gb'"),
    ("name: a\ntrunk_gb: 1\ncache_gb: 1\nbackend: 'rm -rf'\n", "backend"),
    ("name: \"unclosed\n", "not valid YAML"),
    ("1: 2\n", "string"),
])
def test_bad_documents_are_refused_by_name(text, words):
    with pytest.raises(PresetError) as exc:
        parse_preset(text, "t.yaml")
    assert words in str(exc.value)
    assert exc.value.exit_code == 2


def test_size_cap_and_encoding():
    with pytest.raises(PresetError, match="limit"):
        parse_preset(b"# " + b"x" * 70_000)
    with pytest.raises(PresetError, match="UTF-8"):
        parse_preset(b"name: \xff\n")


def test_user_preset_overrides_shipped_and_adds_new(user_dir):
    user_dir.mkdir(parents=True)
    (user_dir / "laptop.yaml").write_text("name: laptop\ntrunk_gb: 5\ncache_gb: 2\n")
    (user_dir / "tiny-box.yaml").write_text("name: tiny-box\ntrunk_gb: 1.5\ncache_gb: 0.5\n"
                                           "notes: my 6 GB box\nthreads: 4\n")
    assert load_preset("laptop").trunk_gb == 5.0
    assert load_preset("laptop").origin == str(user_dir / "laptop.yaml")
    names = [p.name for p in list_presets()]
    assert names == [*SHIPPED, "tiny-box"]
    assert any("tiny-box" in ln and "my 6 GB box" in ln for ln in table_lines(list_presets()))
    assert load_preset(str(user_dir / "tiny-box.yaml")).threads == 4


def test_user_file_whose_name_disagrees_is_refused(user_dir):
    user_dir.mkdir(parents=True)
    (user_dir / "fast.yaml").write_text("name: slow\ntrunk_gb: 5\ncache_gb: 2\n")
    with pytest.raises(PresetError, match="make them agree"):
        load_preset("fast")
    res = k3("presets")  # a broken user file does not break the table
    assert res.exit_code == 0 and "skipped a user preset" in res.output


def test_preset_plugins_are_checked_against_the_registry(tmp_path):
    ok = parse_preset("name: a\ntrunk_gb: 1\ncache_gb: 1\nbackend: numpy\n")
    assert check_plugins(ok) == []  # a plugin that resolves is no problem
    bad = parse_preset("name: a\ntrunk_gb: 1\ncache_gb: 1\nbackend: cuda\n")
    assert check_plugins(bad) == [check_plugins(bad)[0]]
    assert "kernel backend 'cuda' is not registered" in check_plugins(bad)[0]
    f = tmp_path / "p.yaml"
    f.write_text("name: a\ntrunk_gb: 1\ncache_gb: 1\nstorage: nosuch\n")
    res = k3("presets", "validate", str(f))
    assert res.exit_code == 2 and "storage backend 'nosuch' is not registered" in res.output


# ---- auto ---------------------------------------------------------------------------------
def k3_sizes():
    return sizes_from_config(ModelConfig.from_json_dict(size_config("real")))


def test_auto_reproduces_the_reference_thresholds():
    sz = k3_sizes()
    big = auto_budget(sz, overhead=int(1.7 * GB), available=200 * GB, total=256 * GB)
    assert big.full_trunk and round(big.trunk / GB) == 111  # 108.81 GB + 2 % headroom
    assert big.cache == big.usable - big.trunk
    mid = auto_budget(sz, overhead=int(1.7 * GB), available=64 * GB, total=128 * GB)
    assert not mid.full_trunk and mid.cache == 17 * sz.expert_slot_bytes
    assert mid.trunk + sz.tables_bytes + int(1.7 * GB) + mid.cache <= 0.55 * 128 * GB
    with pytest.raises(UsageError, match="below the floor"):
        auto_budget(sz, overhead=int(1.7 * GB), available=8 * GB, total=16 * GB)


def test_auto_keeps_a_small_model_entirely_resident():
    cfg = ModelConfig.from_json_dict(size_config("tiny"))
    p = auto_preset(cfg=cfg, available=4 * GB, total=8 * GB, overhead=50_000_000)
    sz = sizes_from_config(cfg)
    assert p.trunk_bytes >= sz.trunk_bytes and p.cache_bytes >= sz.expert_pool_bytes - 1
    assert "every expert cached" in p.notes and p.origin == "computed"


def test_show_auto_prints_the_budget_line():
    res = k3("presets", "show", "auto")
    assert res.exit_code in (0, 2), res.output  # 2 only on a machine below the floor
    assert ("auto budget:" in res.output) or ("below the floor" in res.output)
