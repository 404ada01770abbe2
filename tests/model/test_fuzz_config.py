"""Hostile config.json (issue 7): every input ends in a ModelConfig or one ConfigError.

Seeded (``derandomize=True``) so the default run is the same 10,000 cases every time:
structured mutations of the two fixture shapes (keys deleted, retyped, moved between scopes,
spelled both ways, set out of range; layer lists with repeats, zeros and overflow; top-k
above the expert count; released keys changed; NaN/Infinity literals), byte-level damage to
their JSON (truncation, non-UTF-8, flipped brackets) and raw garbage and deep nesting. An
accepted config must satisfy the structural rules and survive both writers; a refusal must
be a ``ConfigError`` with exit code 2 and a one-line message. ``-m slow`` runs 200,000.
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from k3core.api.errors import ConfigError, K3Error
from k3core.model.config import ModelConfig
from k3core.model.config_keys import KEYS, PINNED
from k3core.testing.fixtures import fixtures_dir
from k3core.testing.fuzz import Draw, SeededDraw, cases, fuzz_settings

FIX = fixtures_dir()
FLAT = json.loads((FIX / "tiny-flat" / "config.json").read_text())
NESTED = json.loads((FIX / "tiny-released" / "config.json").read_text())

# the default run: 2,000 Hypothesis-driven cases + 800 seeds x 10 seeded cases = 10,000
N_HYPOTHESIS, N_SEEDS, PER_SEED = 2000, 800, 10
LONG = 20  # the slow variant runs LONG times as many (200,000)

KEY_NAMES = sorted({n for k in KEYS for n in k.names} | {p[0] for p in PINNED} | {
    "kda_layers", "num_key_value_heads", "use_grouped_topk", "num_expert_group",
    "topk_group", "bos_token_id", "eos_token_id", "pad_token_id", "text_config",
    "linear_attn_config", "top_k", "extra_key"})
HOT_KEYS = ["full_attn_layers", "kda_layers", "num_experts_per_token", "num_experts",
            "num_hidden_layers", "first_k_dense_replace", "vocab_size", "eos_token_id",
            "num_key_value_heads", "num_expert_group", "topk_group"]
EDGE_INTS = [0, 1, -1, 2, 3, 4, 8, 12, 13, 14, 63, 64, 65, 128, 255, 256, 999, 2**31 - 1,
             2**31, 2**53 + 1, 2**63, 2**64, -(2**63), 10**30]
EDGE_FLOATS = [0.0, -0.0, 0.5, 1.0, 4.0, 13.0, 1e-5, -5.0, 1e308, float("nan"),
               float("inf"), float("-inf"), 2.0**70, 4.5]
STRINGS = ["", "4", "situ", "silu", "sigmoid", "noaux_tc", "true", "\ud800", "\x00"]
LAYER_ITEMS = [999, 2**40, 4.0, 4.5, True, None, "4", -(2**63)]
JUNK = [b"\xff", b"\xc3", b"\x00", b"[", b"]", b"{", b"}", b",", b'"', b"NaN", b"-Infinity",
        b"1e999", b"\xed\xa0\x80", b"\\ud800", b"9" * 40, b"\xef\xbb\xbf"]


def gen_value(r: Draw, depth: int = 0) -> Any:
    kind = r.randint(0, 9)
    if kind <= 1:
        return r.choice(EDGE_INTS)
    if kind == 2:
        return r.randint(-3, 20)
    if kind == 3:
        return r.choice(EDGE_FLOATS)
    if kind == 4:
        return r.chance(0.5)
    if kind == 5:
        return None if r.chance(0.5) else r.choice(STRINGS)
    if kind == 6 or depth >= 2 and kind != 7:  # a layer list: repeats, zeros, out of range, wrong types
        return [r.choice(LAYER_ITEMS) if r.chance(0.1) else r.randint(-2, 16)
                for _ in range(r.randint(0, 15))]
    if kind == 7:
        return sorted(r.randint(1, 13) for _ in range(r.randint(0, 13)))
    if kind == 8:
        return [gen_value(r, depth + 1) for _ in range(r.randint(0, 3))]
    return {r.choice(KEY_NAMES): gen_value(r, depth + 1) for _ in range(r.randint(0, 3))}


def gen_doc(r: Draw) -> tuple[dict[str, Any], bool]:
    base = r.choice([FLAT, NESTED])
    ops = [gen_op(r) for _ in range(r.choice([0, 1, 1, 2, 2, 3, 5]))]
    return mutate(base, ops), not ops


def gen_op(r: Draw) -> tuple[str, str, str, Any]:
    kind = r.choice(["del", "set", "set", "set", "move"])
    where = r.choice(["root", "text", "lin"])
    if r.chance(0.4):  # the keys the structural rules are about, with fitting values
        key = r.choice(HOT_KEYS)
        if key in ("full_attn_layers", "kda_layers") and r.chance(0.7):
            value = gen_value(r, depth=2)
        else:
            value = r.randint(0, 20) if r.chance(0.5) else gen_value(r)
        return kind, where, key, value
    return kind, where, r.choice(KEY_NAMES), gen_value(r)


def gen_case(r: Draw) -> tuple[bytes, Any, bool]:
    """``(file bytes, the document if they are its plain encoding, pristine?)``."""
    kind = r.randint(0, 19)
    if kind <= 12:
        doc, pristine = gen_doc(r)
        return encode(doc), doc, pristine
    if kind <= 17:
        data = encode(gen_doc(r)[0])
        how = r.choice(["truncate", "insert", "replace", "bracket"])
        return damage(data, how, r.randint(0, len(data)), r.choice(JUNK)), None, False
    if kind == 18:
        return r.blob(64), None, False
    return r.choice([b"[", b'{"a":', b'{"text_config":', b"[{"]) * r.randint(1, 3000), None, False


def scopes(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out = {"root": doc}
    text = doc.get("text_config")
    if isinstance(text, dict):
        out["text"] = text
        if isinstance(text.get("linear_attn_config"), dict):
            out["lin"] = text["linear_attn_config"]
    if "lin" not in out and isinstance(doc.get("linear_attn_config"), dict):
        out["lin"] = doc["linear_attn_config"]
    return out


def mutate(base: dict[str, Any], ops: list[tuple[str, str, str, Any]]) -> dict[str, Any]:
    doc = copy.deepcopy(base)
    for kind, where, key, value in ops:
        sc = scopes(doc)
        target = sc.get(where, doc)
        if kind == "del":
            target.pop(key, None)
        elif kind == "set":
            target[key] = value
        else:  # move a key to another scope, where it may shadow or be shadowed
            src = [s for s in sc.values() if key in s]
            if src:
                target[key] = src[0].pop(key)
    return doc


def encode(doc: Any) -> bytes:
    return json.dumps(doc, allow_nan=True).encode()


def must_refuse(doc: Any, data: bytes) -> str:
    """Reasons any correct reader refuses, found without sharing the reader's code."""
    if b"NaN" in data or b"Infinity" in data:
        return "non-standard JSON literal"
    if not isinstance(doc, dict):
        return "not an object"
    sc = scopes(doc)
    for key in KEYS:
        if not key.optional and not any(n in s for s in sc.values() for n in key.names):
            return f"{key.names[0]} absent"
    return ""


def check(data: bytes, doc: Any = None, pristine: bool = False) -> None:
    try:
        c = ModelConfig.from_json_bytes(data, source="fuzz.json")
    except ConfigError as exc:
        assert exc.exit_code == 2
        msg = str(exc)
        assert msg.startswith("fuzz.json: cannot be read with confidence: ") and "\n" not in msg
        assert len(msg) < 20_000
        assert not pristine, msg
        return
    except K3Error as exc:  # any other K3Error is the wrong family
        raise AssertionError(f"not a ConfigError: {exc!r}") from None
    if doc is not None:
        assert not must_refuse(doc, data), must_refuse(doc, data)
    layers = c.full_attn_layers
    assert 0 < len(layers) < c.n_layers and len(set(layers)) == len(layers)
    assert all(1 <= x <= c.n_layers for x in layers) and list(layers) == sorted(layers)
    assert 1 <= c.topk <= min(64, c.n_experts) and 0 <= c.first_dense <= c.n_layers
    assert c.n_mla + c.n_kda == c.n_layers and len(c.layer_map) == c.n_layers
    for f in (c.rms_eps, c.gate_lb, c.routed_scale, c.situ_b1, c.situ_b2):
        assert math.isfinite(f)
    assert min(c.hidden, c.vocab, c.kda_heads, c.kda_head_dim, c.conv_k, c.attn_res_block) >= 1
    assert c.n_shared >= 0 and len(c.fingerprint()) == 12 and c.describe()
    for d in (c.to_flat_dict(), c.to_nested_dict()):
        assert ModelConfig.from_json_bytes(encode(d)) == c


def damage(data: bytes, how: str, pos: int, junk: bytes) -> bytes:
    if how == "truncate":
        return data[:pos]
    if how == "insert":
        return data[:pos] + junk + data[pos:]
    if how == "replace":
        return data[:pos] + junk + data[pos + len(junk):]
    return data.replace(b"{", b"[", 1)


@fuzz_settings(N_HYPOTHESIS)
@given(cases(gen_case))
def test_fuzz_config_hypothesis(case: tuple[bytes, Any, bool]) -> None:
    check(*case)


@fuzz_settings(N_SEEDS)
@given(st.integers(0, 2**64 - 1))
def test_fuzz_config_seeded(seed: int) -> None:
    run_seeded(seed, PER_SEED)


@pytest.mark.slow
@fuzz_settings(N_HYPOTHESIS * LONG)
@given(cases(gen_case))
def test_fuzz_config_hypothesis_long(case: tuple[bytes, Any, bool]) -> None:
    check(*case)


@pytest.mark.slow
@fuzz_settings(N_SEEDS * LONG)
@given(st.integers(0, 2**64 - 1))
def test_fuzz_config_seeded_long(seed: int) -> None:
    run_seeded(seed, PER_SEED)


def run_seeded(seed: int, cases: int) -> None:
    for i in range(cases):
        r = SeededDraw(seed * 1000 + i)
        data, doc, pristine = gen_case(r)
        try:
            check(data, doc, pristine)
        except AssertionError as exc:
            raise AssertionError(f"seeded case SeededDraw({seed * 1000 + i}): {data[:400]!r}: "
                                 f"{exc}") from None


def test_fuzz_oracle_sanity() -> None:
    """The generators' pristine documents are accepted; the refusal oracle is not vacuous."""
    for base in (FLAT, NESTED):
        check(encode(base), base, pristine=True)
        doc = mutate(base, [("del", "lin", "full_attn_layers", None),
                            ("del", "root", "full_attn_layers", None)])
        assert must_refuse(doc, encode(doc)) == "full_attn_layers absent"
