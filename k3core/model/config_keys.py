"""The keys of ``config.json``: where each is looked up, its type, and the structural rules.

:func:`read_fields` walks the key table over a parsed document and returns the values it
could read with confidence plus every missing key and every problem; :func:`structural_problems`
applies the cross-field rules (layer map, top-k, partition with ``kda_layers``).
:mod:`k3core.model.config` turns the lists into one ``ConfigError``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from k3core.api.safejson import show

Kind = Literal["size", "count", "float", "posfloat", "bool", "layers"]

#: the reference engine's K3_MAX_TOPK
MAX_TOPK = 64
#: integers above this are refused as absurd (the reference engine reads them into C ints)
MAX_INT = 2**31 - 1
#: more layers than this is refused as absurd (Kimi K3 has 93)
MAX_LAYERS = 4096
#: a layer list longer than this is refused before it is examined
MAX_LIST = 65536


@dataclass(frozen=True)
class Key:
    field: str
    names: tuple[str, ...]  # primary spelling, then aliases
    kind: Kind
    kda: bool = False  # a KDA-block key: linear_attn_config is searched first
    optional: bool = False  # only the three booleans: default true

    @property
    def label(self) -> str:
        return self.names[0] + "".join(f" (or {a})" for a in self.names[1:])


KEYS: tuple[Key, ...] = (
    Key("hidden", ("hidden_size",), "size"),
    Key("n_layers", ("num_hidden_layers",), "size"),
    Key("vocab", ("vocab_size",), "size"),
    Key("rms_eps", ("rms_norm_eps",), "posfloat"),
    Key("kda_heads", ("num_heads", "kda_num_heads"), "size", kda=True),
    Key("kda_head_dim", ("head_dim", "kda_head_dim"), "size", kda=True),
    Key("conv_k", ("short_conv_kernel_size",), "size", kda=True),
    Key("gate_lb", ("gate_lower_bound",), "float", kda=True),
    Key("n_heads", ("num_attention_heads",), "size"),
    Key("q_lora", ("q_lora_rank",), "size"),
    Key("kv_lora", ("kv_lora_rank",), "size"),
    Key("qk_nope", ("qk_nope_head_dim",), "size"),
    Key("qk_rope", ("qk_rope_head_dim",), "size"),
    Key("v_head", ("v_head_dim",), "size"),
    Key("mla_out_gate", ("mla_use_output_gate",), "bool", optional=True),
    Key("n_experts", ("num_experts",), "size"),
    Key("topk", ("num_experts_per_token",), "size"),
    Key("n_shared", ("num_shared_experts",), "count"),
    Key("latent", ("routed_expert_hidden_size",), "size"),
    Key("moe_inter", ("moe_intermediate_size",), "size"),
    Key("routed_scale", ("routed_scaling_factor",), "posfloat"),
    Key("moe_renorm", ("moe_renormalize",), "bool", optional=True),
    Key("latent_norm", ("latent_moe_use_norm",), "bool", optional=True),
    Key("first_dense", ("first_k_dense_replace",), "count"),
    Key("dense_inter", ("intermediate_size",), "size"),
    Key("attn_res_block", ("attn_res_block_size",), "size"),
    Key("situ_b1", ("activation_situ_beta", "situ_beta"), "posfloat"),
    Key("situ_b2", ("activation_situ_linear_beta", "situ_linear_beta"), "posfloat"),
    Key("full_attn_layers", ("full_attn_layers",), "layers", kda=True),
)

#: released keys the forward pass does not read, asserted when present (docs/model.md §2):
#: (key, required value, what another value would mean)
PINNED: tuple[tuple[str, Any, str], ...] = (
    ("mla_use_nope", True, "rotary embeddings, which this engine does not implement"),
    ("hidden_act", "situ", "an activation other than SiTU-GLU"),
    ("moe_router_activation_func", "sigmoid", "a router other than the sigmoid one"),
    ("topk_method", "noaux_tc", "a routing method other than bias-on-selection top-k"),
    ("moe_layer_freq", 1, "dense layers interleaved with MoE layers"),
    ("use_full_rank_gate", True, "a low-rank KDA output gate"),
    ("num_nextn_predict_layers", 0, "multi-token-prediction layers"),
    ("tie_word_embeddings", False, "an lm_head tied to the embedding"),
)
_KDA_ONLY = {"use_full_rank_gate", "kda_layers"}


class Doc:
    """A parsed config with its lookup scopes in order."""

    def __init__(self, d: Mapping[str, Any], problems: list[str]):
        text = d.get("text_config")
        self.shape: Literal["nested", "flat"] = "nested" if "text_config" in d else "flat"
        scopes: list[tuple[str, Mapping[str, Any]]] = []
        lin: tuple[str, Mapping[str, Any]] | None = None
        if self.shape == "nested":
            if isinstance(text, dict):
                scopes.append(("text_config.", text))
                if "linear_attn_config" in text:
                    lin = _scope(text, "linear_attn_config", "text_config.", problems)
            else:
                problems.append(f"text_config is {_what(text)}, not an object")
        if lin is None and "linear_attn_config" in d:
            lin = _scope(d, "linear_attn_config", "", problems)
        root = ("", d)
        self.general = [*scopes, *([lin] if lin else []), root]
        self.kda = [*([lin] if lin else []), *scopes, root]

    def find(self, names: tuple[str, ...], kda: bool, problems: list[str]) -> tuple[str, Any]:
        """``(where, value)`` of the first hit, or ``("", _ABSENT)``."""
        for prefix, obj in self.kda if kda else self.general:
            hits = [(prefix + n, obj[n]) for n in names if n in obj]
            if len(hits) > 1 and any(not _same(hits[0][1], v) for _, v in hits[1:]):
                problems.append(" and ".join(f"{w} = {_short(v)}" for w, v in hits)
                                + " disagree")
            if hits:
                return hits[0]
        return "", _ABSENT


class _Absent:
    pass


_ABSENT: Any = _Absent()


def read_fields(d: Mapping[str, Any]) -> tuple[Literal["nested", "flat"], dict[str, Any],
                                                list[str], list[str]]:
    """Return ``(shape, values, missing key labels, problems)``."""
    problems: list[str] = []
    doc = Doc(d, problems)
    values: dict[str, Any] = {}
    missing: list[str] = []
    for key in KEYS:
        where, raw = doc.find(key.names, key.kda, problems)
        if raw is _ABSENT:
            if key.optional:
                values[key.field] = True
            else:
                missing.append(key.label)
            continue
        value, why = convert(raw, key.kind)
        if why:
            problems.append(f"{where} {why}")
        else:
            values[key.field] = tuple(sorted(value)) if key.kind == "layers" else value
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        where, raw = doc.find((name,), False, problems)
        if raw is _ABSENT or raw is None:
            values[name] = None
            continue
        value, why = convert(raw, "count")
        if why:
            problems.append(f"{where} {why}")
        else:
            values[name] = value
    _check_pinned(doc, values, problems)
    where, raw = doc.find(("kda_layers",), True, problems)
    if raw is not _ABSENT:
        value, why = convert(raw, "layers")
        if why:
            problems.append(f"{where} {why}")
        else:
            values["kda_layers"] = value
    return doc.shape, values, missing, problems


def _check_pinned(doc: Doc, values: dict[str, Any], problems: list[str]) -> None:
    for name, want, meaning in PINNED:
        where, raw = doc.find((name,), name in _KDA_ONLY, problems)
        if raw is not _ABSENT and not _same(raw, want):
            problems.append(f"{where} is {_short(raw)}, but this engine implements only "
                            f"{_short(want)} (another value means {meaning})")
    where, raw = doc.find(("num_key_value_heads",), False, problems)
    if raw is not _ABSENT and raw is not None and "n_heads" in values and not _same(raw, values["n_heads"]):
        problems.append(f"{where} is {_short(raw)}, but num_attention_heads is "
                        f"{values['n_heads']} (grouped-query attention is not this model)")
    _, grouped = doc.find(("use_grouped_topk",), False, problems)
    w_groups, groups = doc.find(("num_expert_group",), False, problems)
    _, tgroup = doc.find(("topk_group",), False, problems)
    if not _same(grouped, False) and groups is not _ABSENT and not _same(groups, 1):
        if tgroup is _ABSENT or not _same(tgroup, groups):
            shown = "absent" if tgroup is _ABSENT else _short(tgroup)
            problems.append(f"{w_groups} is {_short(groups)} with topk_group {shown}: grouped "
                            f"routing that is not degenerate is not this model (expected 1 "
                            f"and 1)")


def convert(raw: Any, kind: Kind) -> tuple[Any, str]:
    """``(value, "")`` or ``(None, why)`` for one raw JSON value of ``kind``."""
    if kind == "bool":
        if isinstance(raw, bool):
            return raw, ""
        if type(raw) is int and raw in (0, 1):
            return bool(raw), ""
        return None, f"must be true/false or 0/1, not {_short(raw)}"
    if kind == "layers":
        if not isinstance(raw, list):
            return None, f"must be an array of layer numbers, not {_what(raw)}"
        if len(raw) > MAX_LIST:
            return None, f"has {len(raw)} entries, more than any model has layers"
        out = []
        for i, item in enumerate(raw):
            v, why = convert(item, "count")
            if why:
                return None, f"entry {i} {why}"
            out.append(v)
        return tuple(out), ""
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        return None, f"must be a JSON number, not {_what(raw)}"
    if kind in ("float", "posfloat"):
        if isinstance(raw, int) and abs(raw) > 2**1000:
            return None, "is out of range"
        value = float(raw)
        if not math.isfinite(value):
            return None, f"must be finite, not {value}"
        if kind == "posfloat" and value <= 0:
            return None, f"must be > 0, not {value}"
        return value, ""
    if isinstance(raw, float):
        if not math.isfinite(raw) or not raw.is_integer():
            return None, f"must be a whole number, not {raw}"
        raw = int(raw)
    low = 1 if kind == "size" else 0
    if not low <= raw <= MAX_INT:
        return None, f"must be in {low}..{MAX_INT}, not {_short(raw)}"
    return raw, ""


def structural_problems(v: Mapping[str, Any]) -> list[str]:
    """The cross-field rules, on converted values (all required fields present)."""
    out: list[str] = []
    n = v["n_layers"]
    layers = v["full_attn_layers"]
    if n > MAX_LAYERS:
        return [f"num_hidden_layers {n} is more than this engine supports ({MAX_LAYERS})"]
    if not layers:
        out.append("full_attn_layers is empty: a model without MLA layers is not this model")
    elif len(layers) >= n:
        out.append(f"full_attn_layers lists {len(layers)} layers but the model has {n}: at "
                   f"least one layer must be KDA")
    bad = [x for x in layers if not 1 <= x <= n]
    if bad:
        out.append(f"full_attn_layers entry {_short(bad[0])} is outside 1..{n} (the list is "
                   f"one-based: layer 1 is the first)")
    repeats = sorted(x for x, c in Counter(layers).items() if c > 1)
    if repeats:
        out.append(f"full_attn_layers repeats layer {repeats[0]}")
    if v["topk"] > MAX_TOPK:
        out.append(f"top-k (num_experts_per_token) {v['topk']} is above the maximum {MAX_TOPK}")
    if v["topk"] > v["n_experts"]:
        out.append(f"top-k (num_experts_per_token) {v['topk']} is more than num_experts "
                   f"{v['n_experts']}")
    if v["first_dense"] > n:
        out.append(f"first_k_dense_replace {v['first_dense']} is more than the {n} layers")
    kda = v.get("kda_layers")
    if kda is not None and not (bad or repeats):
        if len(kda) + len(layers) != n or not _covers(kda, layers, n):
            out.append(f"kda_layers and full_attn_layers do not partition 1..{n} exactly "
                       f"({_partition_detail(kda, layers, n)})")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        tok = v.get(name)
        if tok is not None and tok >= v["vocab"]:
            out.append(f"{name} {tok} is outside the vocabulary (vocab_size {v['vocab']})")
    return out


def _covers(kda: tuple[int, ...], mla: tuple[int, ...], n: int) -> bool:
    """With ``len(kda) + len(mla) == n``: whether together they are exactly 1..n."""
    both = set(kda) | set(mla)
    return len(both) == n and all(1 <= x <= n for x in both)


def _partition_detail(kda: tuple[int, ...], mla: tuple[int, ...], n: int) -> str:
    both = sorted(set(kda) & set(mla))
    if both:
        return f"layer {both[0]} is in both"
    outside = [x for x in kda if not 1 <= x <= n]
    if outside:
        return f"kda_layers entry {outside[0]} is outside 1..{n}"
    dup = sorted(x for x, c in Counter(kda).items() if c > 1)
    if dup:
        return f"kda_layers repeats layer {dup[0]}"
    gap = sorted(set(range(1, n + 1)) - set(kda) - set(mla))
    return f"layer {gap[0]} is in neither" if gap else "they overlap"


def _scope(obj: Mapping[str, Any], key: str, prefix: str,
           problems: list[str]) -> tuple[str, Mapping[str, Any]] | None:
    value = obj[key]
    if isinstance(value, dict):
        return (f"{prefix}{key}.", value)
    problems.append(f"{prefix}{key} is {_what(value)}, not an object")
    return None


def _same(raw: Any, want: Any) -> bool:
    """Whether JSON value ``raw`` means ``want``: 1 == 1.0; a boolean may be given as 0/1,
    but a number is never given as a boolean."""
    if isinstance(want, bool):
        return raw is want or (type(raw) is int and raw == int(want))
    if isinstance(raw, bool):
        return False
    if isinstance(raw, (int, float)) and isinstance(want, (int, float)):
        return raw == want
    return type(raw) is type(want) and raw == want


def _what(value: Any) -> str:
    names = {list: "an array", dict: "an object", str: "a string", bool: "a boolean",
             type(None): "null", int: "a number", float: "a number"}
    return names.get(type(value), type(value).__name__)


def _short(value: Any) -> str:
    if isinstance(value, str):
        return show(value, 40)
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, int) and abs(value) > 10**12:
        return f"a number of about {int(abs(value).bit_length() * 0.30103)} digits"
    if isinstance(value, (int, float)):
        return repr(value)
    return _what(value)
