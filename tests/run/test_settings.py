"""Settings precedence: flag > environment > preset > default, with the source of each."""

from __future__ import annotations

from pathlib import Path

import pytest

from k3core.api.errors import UsageError
from k3core.run.presets import load_preset, parse_preset
from k3core.run.settings import DEFAULTS, env_layer, merge_settings

PRESET = parse_preset("name: p\ntrunk_gb: 5\ncache_gb: 2\nthreads: 3\nincremental: true\n")


# (layer that sets threads: default/preset/env/flag) -> expected value and source
@pytest.mark.parametrize("preset, env, flags, value, source", [
    (None, {}, {}, None, "default"),
    (PRESET, {}, {}, 3, "preset p"),
    (PRESET, {"OMP_NUM_THREADS": "6"}, {}, 6, "env OMP_NUM_THREADS"),
    (PRESET, {"OMP_NUM_THREADS": "6", "K3_THREADS": "5"}, {}, 5, "env K3_THREADS"),
    (PRESET, {"K3_THREADS": "5"}, {"threads": 9}, 9, "flag --threads"),
    (None, {"K3_THREADS": "5"}, {"threads": None}, 5, "env K3_THREADS"),  # None = not given
    (None, {}, {"threads": 2}, 2, "flag --threads"),
    (PRESET, {"K3_THREADS": " "}, {}, 3, "preset p"),  # blank env is unset
])
def test_threads_precedence_table(preset, env, flags, value, source):
    m = merge_settings(None, preset, env, flags)
    assert m.settings.threads == value
    assert m.sources["threads"] == source


def test_every_layer_at_once():
    env = {"K3_MODEL_DIR": "/m/env", "K3_TOK_FILES": "/t/env", "K3_THREADS": "4"}
    m = merge_settings({"trunk_gb": 20.0}, PRESET, env, {"model_dir": Path("/m/flag"),
                                                         "cache_gb": 40.0})
    s = m.settings
    assert s.model_dir == Path("/m/flag") and m.sources["model_dir"] == "argument MODEL_DIR"
    assert s.tok == Path("/t/env") and m.sources["tok"] == "env K3_TOK_FILES"
    assert s.trunk_gb == 5.0 and m.sources["trunk_gb"] == "preset p"  # preset beats default
    assert s.cache_gb == 40.0 and m.sources["cache_gb"] == "flag --cache-gb"
    assert s.incremental is True and s.preset == "p"
    assert s.backend == DEFAULTS["backend"] and m.sources["backend"] == "default"
    assert any(line.startswith("cache_gb = 40.0") for line in m.describe())


def test_reference_example_server_then_cache_flag():
    m = merge_settings(None, load_preset("server"), {}, {"cache_gb": 40.0})
    assert (m.settings.trunk_gb, m.settings.cache_gb) == (110.0, 40.0)


def test_defaults_without_any_layer():
    m = merge_settings(None, None, {}, {})
    assert m.settings.model_dump() == DEFAULTS
    assert set(m.sources.values()) == {"default"}


def test_bad_environment_value_is_named():
    with pytest.raises(UsageError, match="K3_THREADS='many' is not a positive integer"):
        merge_settings(None, None, {"K3_THREADS": "many"}, {})
    with pytest.raises(UsageError, match="OMP_NUM_THREADS"):
        env_layer({"OMP_NUM_THREADS": "0"})


def test_bad_flag_value_names_its_source():
    with pytest.raises(UsageError, match=r"threads \(from flag --threads\)"):
        merge_settings(None, None, {}, {"threads": 0})
    with pytest.raises(UsageError, match="unknown setting"):
        merge_settings(None, None, {}, {"trunk_gib": 1})


def test_ultra_with_auto_is_refused():
    auto = {"name": "auto", "trunk_gb": 10.0, "cache_gb": 1.0}
    with pytest.raises(UsageError, match="auto"):
        merge_settings(None, auto, {}, {"ultra_low_memory": True})


def test_preset_module_reexports_merge():
    from k3core.run import presets

    assert presets.merge_settings is merge_settings
