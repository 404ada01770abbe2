"""config.json: both shapes, one model; every refusal is one ConfigError (exit 2)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from k3core.api.errors import ConfigError, Exit
from k3core.model import config as config_mod
from k3core.model.config import ModelConfig, load_config
from k3core.testing.fixtures import fixtures_dir

FIX = fixtures_dir()


def flat() -> dict[str, Any]:
    return json.loads((FIX / "tiny-flat" / "config.json").read_text())


def nested() -> dict[str, Any]:
    return json.loads((FIX / "tiny-released" / "config.json").read_text())


def refused(d: Any, *needles: str) -> str:
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_json_dict(d)
    err = info.value
    assert err.exit_code == Exit.USAGE == 2
    assert str(err).startswith("config.json: cannot be read with confidence: ")
    for needle in needles:
        assert needle in str(err), (needle, str(err))
    return str(err)


def released_full() -> dict[str, Any]:
    """The published full-size config (docs/model.md §1-2), with the keys k3 asserts."""
    full = [4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60, 64, 68, 72, 76, 80,
            84, 88, 92, 93]
    text = {
        "model_type": "kimi_linear", "dtype": "bfloat16", "hidden_size": 7168,
        "num_hidden_layers": 93, "vocab_size": 163840, "rms_norm_eps": 1e-05,
        "num_attention_heads": 96, "num_key_value_heads": 96, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "mla_use_output_gate": True, "mla_use_nope": True,
        "num_experts": 896, "num_experts_per_token": 16, "num_shared_experts": 2,
        "routed_expert_hidden_size": 3584, "moe_intermediate_size": 3072,
        "routed_scaling_factor": 1.0, "moe_renormalize": True, "latent_moe_use_norm": True,
        "first_k_dense_replace": 1, "intermediate_size": 33792, "attn_res_block_size": 12,
        "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "hidden_act": "situ", "moe_router_activation_func": "sigmoid",
        "topk_method": "noaux_tc", "use_grouped_topk": True, "num_expert_group": 1,
        "topk_group": 1, "moe_layer_freq": 1, "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False, "max_position_embeddings": 1048576, "top_k": 50,
        "linear_attn_config": {
            "num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0, "use_full_rank_gate": True, "full_attn_layers": full,
            "kda_layers": [i for i in range(1, 94) if i not in full],
        },
    }
    return {
        "architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
        "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
        "media_placeholder_token_id": 163605,
        "quantization_config": {"format": "mxfp4-pack-quantized", "ignore": ["lm_head"]},
        "vision_config": {"num_heads": 16, "hidden_size": 1152, "head_dim": 72},
        "text_config": text,
    }


# ---- the fixtures ----------------------------------------------------------------------
def test_flat_and_released_fixtures_are_one_model() -> None:
    a = load_config(FIX / "tiny-flat")
    b = load_config(FIX / "tiny-released" / "config.json")
    assert a == b and hash(a) == hash(b)
    assert (a.shape, b.shape) == ("flat", "nested")
    assert a.full_attn_layers == (4, 8, 12, 13)
    assert a.layer_map == "KKKMKKKMKKKMM"
    assert (a.n_mla, a.n_kda) == (4, 9)
    assert [a.is_mla(i) for i in (0, 2, 3, 11, 12)] == [False, False, True, True, True]
    assert a.is_dense(0) and not a.is_dense(1)
    assert (a.hidden, a.n_layers, a.vocab, a.kda_heads, a.kda_head_dim) == (128, 13, 256, 4, 16)
    assert (a.conv_k, a.gate_lb, a.n_heads, a.q_lora, a.kv_lora) == (4, -5.0, 4, 64, 32)
    assert (a.qk_nope, a.qk_rope, a.v_head, a.n_experts, a.topk) == (24, 8, 16, 8, 2)
    assert (a.n_shared, a.latent, a.moe_inter, a.dense_inter) == (2, 64, 64, 96)
    assert (a.attn_res_block, a.situ_b1, a.situ_b2, a.rms_eps) == (3, 4.0, 25.0, 1e-5)
    assert a.mla_out_gate and a.moe_renorm and a.latent_norm and a.routed_scale == 1.0
    assert a.first_dense == 1 and a.bos_token_id is None
    assert a.fingerprint() == (128, 13, 256, 4, 16, 4, 4, 24, 8, 16, 8, 2)
    assert b.kda_layers == (1, 2, 3, 5, 6, 7, 9, 10, 11)


def test_oracle_config_loads() -> None:
    doc = json.loads((FIX / "oracle" / "ref_k3.json").read_text())["config"]
    c = ModelConfig.from_json_dict(doc, source="ref_k3.json")
    assert c.moe_inter == 48 and c.attn_res_block == 3 and c.layer_map == "KKKMKKKMKKKMM"
    assert c.fingerprint() == load_config(FIX / "tiny-flat").fingerprint()
    assert c.describe() == ("config: ref_k3.json (flat): hidden 128, 13 layers, vocab 256, "
                            "4 MLA + 9 KDA, 8 experts top-2 + 2 shared, latent 64")


@pytest.mark.parametrize("name, needles", [
    ("no_layermap", ["missing keys: full_attn_layers", "never defaulted"]),
    ("bad_layer_index", ["999", "outside 1..13", "one-based"]),
    ("bad_topk", ["top-k", "128", "num_experts 8", "maximum 64"]),
])
def test_refused_fixture_configs(name: str, needles: list[str]) -> None:
    path = FIX / "cfg" / f"{name}.json"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.exit_code == 2
    assert str(info.value).startswith(f"{path}: cannot be read with confidence: ")
    for needle in needles:
        assert needle in str(info.value)


def test_released_full_size_config() -> None:
    c = ModelConfig.from_json_dict(released_full())
    assert (c.n_mla, c.n_kda, c.shape) == (24, 69, "nested")
    assert c.is_mla(91) and c.is_mla(92) and c.is_mla(3) and not c.is_mla(0)
    assert [i for i in range(93) if c.is_dense(i)] == [0]
    assert (c.kda_heads, c.kda_head_dim, c.topk, c.n_experts) == (96, 128, 16, 896)
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (163584, 163586, 163839)
    assert c.fingerprint() == (7168, 93, 163840, 96, 128, 4, 96, 128, 64, 128, 896, 16)


# ---- missing keys are never defaulted ----------------------------------------------------
def test_nested_without_linear_attn_config_is_refused_not_defaulted() -> None:
    d = nested()
    del d["text_config"]["linear_attn_config"]
    refused(d, "missing keys: num_heads (or kda_num_heads), head_dim (or kda_head_dim), "
               "short_conv_kernel_size, gate_lower_bound, full_attn_layers", "never defaulted")


def test_every_missing_key_reported_at_once() -> None:
    d = flat()
    for k in ("hidden_size", "situ_beta", "kda_num_heads", "num_experts"):
        del d[k]
    msg = refused(d, "hidden_size", "activation_situ_beta (or situ_beta)",
                  "num_heads (or kda_num_heads)", "num_experts")
    assert msg.count("missing keys") == 2  # the list, then the reason


def test_only_three_booleans_default_true() -> None:
    d = flat()
    for k in ("mla_use_output_gate", "moe_renormalize", "latent_moe_use_norm"):
        del d[k]
    c = ModelConfig.from_json_dict(d)
    assert c.mla_out_gate and c.moe_renorm and c.latent_norm
    d["moe_renormalize"] = 0
    d["mla_use_output_gate"] = 1
    c = ModelConfig.from_json_dict(d)
    assert c.moe_renorm is False and c.mla_out_gate is True


def test_empty_document_lists_everything() -> None:
    msg = refused({}, "hidden_size", "full_attn_layers", "attn_res_block_size")
    assert "mla_use_output_gate" not in msg


# ---- types and ranges --------------------------------------------------------------------
@pytest.mark.parametrize("key, value, needle", [
    ("hidden_size", "128", "must be a JSON number, not a string"),
    ("hidden_size", True, "must be a JSON number, not a boolean"),
    ("num_hidden_layers", 13.5, "must be a whole number"),
    ("vocab_size", 0, "must be in 1.."),
    ("vocab_size", -5, "must be in 1.."),
    ("hidden_size", 2**40, "must be in 1.."),
    ("rms_norm_eps", 0, "must be > 0"),
    ("rms_norm_eps", float("nan"), "must be finite"),
    ("gate_lower_bound", float("-inf"), "must be finite"),
    ("situ_beta", None, "not null"),
    ("moe_renormalize", 2, "must be true/false or 0/1"),
    ("moe_renormalize", "true", "must be true/false or 0/1"),
    ("num_shared_experts", -1, "must be in 0.."),
    ("short_conv_kernel_size", 0, "must be in 1.."),
    ("attn_res_block_size", 0, "must be in 1.."),
    ("full_attn_layers", [4, 8, "12"], "entry 2 must be a JSON number"),
    ("full_attn_layers", [4, True], "entry 1 must be a JSON number, not a boolean"),
    ("full_attn_layers", "4,8", "must be an array"),
    ("full_attn_layers", [], "full_attn_layers is empty"),
    ("full_attn_layers", [0, 4], "entry 0 is outside 1..13"),
    ("full_attn_layers", [4, 4, 8], "repeats layer 4"),
    ("full_attn_layers", list(range(1, 14)), "at least one layer must be KDA"),
    ("num_experts_per_token", 9, "top-k (num_experts_per_token) 9 is more than num_experts 8"),
    ("num_experts_per_token", 0, "must be in 1.."),
    ("first_k_dense_replace", 14, "first_k_dense_replace 14 is more than the 13 layers"),
    ("eos_token_id", 256, "eos_token_id 256 is outside the vocabulary"),
    ("bos_token_id", "1", "bos_token_id must be a JSON number"),
])
def test_bad_values(key: str, value: Any, needle: str) -> None:
    d = flat()
    d[key] = value
    refused(d, "top-k" if key == "num_experts_per_token" and value else key, needle)


def test_whole_floats_and_token_ids_accepted() -> None:
    d = flat()
    d["hidden_size"] = 128.0
    d.update(bos_token_id=1, eos_token_id=2, pad_token_id=None)
    c = ModelConfig.from_json_dict(d)
    assert c.hidden == 128 and type(c.hidden) is int
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (1, 2, None)


def test_topk_above_64_refused() -> None:
    d = flat()
    d.update(num_experts=100, num_experts_per_token=65)
    refused(d, "top-k (num_experts_per_token) 65 is above the maximum 64")


def test_layer_list_order_does_not_matter() -> None:
    d = flat()
    d["full_attn_layers"] = [13, 4, 12, 8]
    assert ModelConfig.from_json_dict(d).full_attn_layers == (4, 8, 12, 13)


# ---- kda_layers and the released keys ----------------------------------------------------
@pytest.mark.parametrize("kda, needle", [
    ([1, 2, 3, 5, 6, 7, 9, 10], "layer 11 is in neither"),
    ([1, 2, 3, 4, 5, 6, 7, 9, 10, 11], "layer 4 is in both"),
    ([1, 2, 3, 5, 6, 7, 9, 10, 11, 11], "repeats layer 11"),
    ([1, 2, 3, 5, 6, 7, 9, 10, 11, 14], "entry 14 is outside 1..13"),
    ([0, 1, 2, 3, 5, 6, 7, 9, 10, 11], "entry 0 is outside"),
])
def test_kda_layers_must_partition(kda: list[int], needle: str) -> None:
    d = nested()
    d["text_config"]["linear_attn_config"]["kda_layers"] = kda
    refused(d, "kda_layers and full_attn_layers do not partition 1..13", needle)


def test_kda_layers_wrong_type() -> None:
    d = nested()
    d["text_config"]["linear_attn_config"]["kda_layers"] = {"1": True}
    refused(d, "text_config.linear_attn_config.kda_layers must be an array")


@pytest.mark.parametrize("where, key, value, needle", [
    ("text", "hidden_act", "silu", "'silu', but this engine implements only 'situ'"),
    ("text", "mla_use_nope", False, "rotary"),
    ("text", "moe_router_activation_func", "softmax", "sigmoid"),
    ("text", "topk_method", "greedy", "noaux_tc"),
    ("text", "moe_layer_freq", 2, "moe_layer_freq is 2"),
    ("text", "moe_layer_freq", True, "moe_layer_freq is true"),
    ("lin", "use_full_rank_gate", False, "low-rank"),
    ("text", "num_nextn_predict_layers", 1, "multi-token"),
    ("root", "tie_word_embeddings", True, "tied"),
    ("text", "num_key_value_heads", 2, "num_key_value_heads is 2, but num_attention_heads is 96"),
    ("text", "num_expert_group", 8, "num_expert_group is 8 with topk_group 1"),
    ("text", "num_expert_group", 4.5, "num_expert_group is 4.5 with topk_group 1"),
])
def test_released_keys_that_would_change_the_model(where: str, key: str, value: Any,
                                                   needle: str) -> None:
    d = released_full()
    target = {"text": d["text_config"], "lin": d["text_config"]["linear_attn_config"],
              "root": d}[where]
    if where == "root":
        d["text_config"].pop(key, None)
    target[key] = value
    refused(d, key, needle)


def test_grouped_routing_without_topk_group() -> None:
    d = released_full()
    del d["text_config"]["topk_group"]
    d["text_config"]["num_expert_group"] = 8
    refused(d, "num_expert_group is 8 with topk_group absent")
    d["text_config"]["num_expert_group"] = 1
    ModelConfig.from_json_dict(d)


def test_absurd_layer_count() -> None:
    d = flat()
    d["num_hidden_layers"] = 2**31 - 1
    d["text_config"] = {"linear_attn_config": {"kda_layers": [1]}}
    refused(d, "num_hidden_layers 2147483647 is more than this engine supports (4096)")


def test_degenerate_grouped_routing_accepted() -> None:
    d = released_full()
    d["text_config"].update(num_expert_group=8, topk_group=8)
    ModelConfig.from_json_dict(d)
    d["text_config"].update(use_grouped_topk=False, num_expert_group=8, topk_group=4)
    ModelConfig.from_json_dict(d)


def test_kda_keys_come_from_linear_attn_config_first() -> None:
    d = released_full()
    d["text_config"]["head_dim"] = 72  # some other head_dim in text_config is not the KDA one
    d["text_config"]["num_heads"] = 7
    c = ModelConfig.from_json_dict(d)
    assert (c.kda_heads, c.kda_head_dim) == (96, 128)


def test_primary_and_alias_disagreeing_is_refused() -> None:
    d = flat()
    d["num_heads"] = 8
    refused(d, "num_heads = 8 and kda_num_heads = 4 disagree")
    d["num_heads"] = 4
    assert ModelConfig.from_json_dict(d).kda_heads == 4


def test_bad_scopes() -> None:
    d = nested()
    d["text_config"]["linear_attn_config"] = [1]
    refused(d, "text_config.linear_attn_config is an array, not an object")
    refused({"text_config": None}, "text_config is null, not an object")
    refused([1, 2], "the top level is an array")


# ---- files -------------------------------------------------------------------------------
def write(tmp_path: Path, data: bytes) -> Path:
    p = tmp_path / "config.json"
    p.write_bytes(data)
    return p


@pytest.mark.parametrize("data, needle", [
    (b"", "invalid JSON"),
    (b'{"hidden_size": 128,', "invalid JSON"),
    (b"[1, 2]", "the top level is an array"),
    (b"\xff\xfe{}", "not UTF-8"),
    (b'{"hidden_size": NaN}', "NaN is not a JSON number"),
    (b'{"hidden_size": -Infinity}', "-Infinity is not a JSON number"),
    (b'{"a": 1, "a": 2}', "duplicate key 'a'"),
    (b"[" * 100000 + b"]" * 100000, "nested too deeply"),
    (b'{"x": 1' + b"0" * 5000 + b"}", "invalid JSON"),
])
def test_unreadable_files(tmp_path: Path, data: bytes, needle: str) -> None:
    p = write(tmp_path, data)
    with pytest.raises(ConfigError) as info:
        load_config(p)
    assert info.value.exit_code == 2 and needle in str(info.value), str(info.value)


def test_huge_float_is_non_finite(tmp_path: Path) -> None:
    d = json.dumps(flat()).replace('"situ_beta": 4.0', '"situ_beta": 1e999')
    with pytest.raises(ConfigError, match="situ_beta must be finite, not inf"):
        load_config(write(tmp_path, d.encode()))


def test_size_cap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = write(tmp_path, json.dumps(flat()).encode())
    monkeypatch.setattr(config_mod, "MAX_CONFIG_BYTES", 100)
    with pytest.raises(ConfigError, match="larger than the"):
        load_config(p)
    with pytest.raises(ConfigError, match="larger than the"):
        ModelConfig.from_json_bytes(p.read_bytes())


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope.json")
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path)  # a directory without config.json


# ---- writing -----------------------------------------------------------------------------
@pytest.mark.parametrize("shape", ["flat", "nested"])
def test_written_shapes_read_back(tmp_path: Path, shape: str) -> None:
    c = ModelConfig.from_json_dict(released_full())
    d = c.to_flat_dict() if shape == "flat" else c.to_nested_dict()
    back = load_config(write(tmp_path, json.dumps(d).encode()))
    assert back == c and back.shape == shape and back.fingerprint() == c.fingerprint()
    assert back.bos_token_id == 163584
    if shape == "nested":
        lin = d["text_config"]["linear_attn_config"]
        assert lin["kda_layers"] == list(c.kda_layers) and len(lin["kda_layers"]) == 69


def test_flat_writer_matches_fixture_keys() -> None:
    fixture = flat()
    written = load_config(FIX / "tiny-flat").to_flat_dict()
    assert written.pop("tie_word_embeddings") is False
    assert written == fixture


def test_direct_construction_is_checked() -> None:
    fields = load_config(FIX / "tiny-flat").model_dump()
    fields["full_attn_layers"] = [13, 4]
    assert ModelConfig(**fields).full_attn_layers == (4, 13)
    bad = copy.deepcopy(fields)
    bad["topk"] = 99
    with pytest.raises(ValueError, match="top-k"):
        ModelConfig(**bad)


def test_is_mla_range() -> None:
    c = load_config(FIX / "tiny-flat")
    with pytest.raises(IndexError):
        c.is_mla(13)
