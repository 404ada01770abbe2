"""Token-mask libraries at the released vocabulary: compile time and mask time per token.

Measures llguidance, xgrammar and outlines-core (whichever are installed) on a tokenizer of
the released Kimi K3 layout (163,840 ids: ``k3core.tokenizer.fit.write_tokenizer``), for a
few strict JSON schemas: the time to compile each schema for the vocabulary, and the time
to compute the mask at every step while a valid instance is fed token by token. Also
times what k3 does with a mask at that width (the argmax over the allowed ids of a logit
row). Prints a Markdown table; the figures of a run go to docs/measurements/.

    python tools/constraint_bench.py [--libs llguidance,xgrammar,outlines] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from k3core.tokenizer.encoding import Tokenizer
from k3core.tokenizer.fit import write_tokenizer

VOCAB = 163_840

SCHEMAS: dict[str, tuple[dict[str, Any], Any]] = {
    "flat": (
        {"type": "object", "properties": {"city": {"type": "string"},
                                          "days": {"type": "integer"}},
         "required": ["city", "days"], "additionalProperties": False},
        {"city": "San Francisco, California", "days": 14},
    ),
    "enum+array": (
        {"type": "object", "properties": {
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}},
            "score": {"type": "number"}},
         "required": ["unit", "tags", "score"], "additionalProperties": False},
        {"unit": "fahrenheit", "tags": ["warm", "dry", "windy"], "score": -12.5},
    ),
    "nested": (
        {"type": "object", "properties": {
            "name": {"type": "string", "pattern": "^[A-Z][a-z]+$"},
            "address": {"type": "object", "properties": {
                "street": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["street", "zip"], "additionalProperties": False},
            "items": {"type": "array", "items": {"type": "object", "properties": {
                "sku": {"type": "string"}, "qty": {"type": "integer"}},
                "required": ["sku", "qty"], "additionalProperties": False}}},
         "required": ["name", "address", "items"], "additionalProperties": False},
        {"name": "Alice", "address": {"street": "1 Main Street", "zip": "94110"},
         "items": [{"sku": "A-1", "qty": 2}, {"sku": "B-22", "qty": 1}]},
    ),
}


def text_of(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok: Tokenizer):
        import llguidance
        import llguidance.numpy
        from llguidance.tiktoken import lltokenizer_from_encoding

        self.g, self.gnp = llguidance, llguidance.numpy
        t0 = time.perf_counter()
        self.lt = lltokenizer_from_encoding(tok.encoding, n_vocab=VOCAB, eos_token=tok.special_tokens["[EOS]"])
        self.setup = time.perf_counter() - t0

    def compile(self, schema: dict[str, Any]) -> Any:
        schema = {**schema, "x-guidance": {"item_separator": ",", "key_separator": ":",
                                           "whitespace_flexible": False}}
        m = self.g.LLMatcher(self.lt, self.g.LLMatcher.grammar_from_json_schema(schema))
        assert not m.is_error(), m.get_error()
        self.mask = self.gnp.allocate_token_bitmask(1, VOCAB)
        return m

    def step(self, m: Any) -> None:
        self.gnp.fill_next_token_bitmask(m, self.mask)

    def feed(self, m: Any, t: int) -> None:
        assert m.consume_token(t), m.get_error()


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok: Tokenizer):
        import xgrammar

        self.x = xgrammar
        t0 = time.perf_counter()
        vocab = [tok.id_to_token_bytes(i) for i in range(VOCAB)]
        info = xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, vocab_size=VOCAB,
                                      stop_token_ids=[tok.special_tokens["[EOS]"]])
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.setup = time.perf_counter() - t0

    def compile(self, schema: dict[str, Any]) -> Any:
        g = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                              separators=(",", ":"), strict_mode=True)
        self.mask = self.x.allocate_token_bitmask(1, VOCAB)
        return self.x.GrammarMatcher(g)

    def step(self, m: Any) -> None:
        m.fill_next_token_bitmask(self.mask)

    def feed(self, m: Any, t: int) -> None:
        assert m.accept_token(t)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tok: Tokenizer):
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        self.o, self.regex = outlines_core, build_regex_from_schema
        t0 = time.perf_counter()
        eos = tok.special_tokens["[EOS]"]
        pieces: dict[bytes, list[int]] = {}
        for i in range(tok.n_ranks):
            pieces.setdefault(tok.id_to_token_bytes(i), []).append(i)
        self.vocab = outlines_core.Vocabulary(eos, pieces)
        self.setup = time.perf_counter() - t0

    def compile(self, schema: dict[str, Any]) -> Any:
        index = self.o.Index(self.regex(json.dumps(schema), whitespace_pattern=""), self.vocab)
        self.mask = np.zeros((VOCAB + 31) // 32, dtype=np.int32)
        return self.o.Guide(index)

    def step(self, m: Any) -> None:
        m.write_mask_into(self.mask.ctypes.data, self.mask.size, 4)

    def feed(self, m: Any, t: int) -> None:
        m.advance(t)


LIBS = {"llguidance": LLGuidance, "xgrammar": XGrammar, "outlines": OutlinesCore}


def masked_argmax_seconds(repeat: int = 200) -> float:
    """k3's own share of a masked greedy step at this width: a float32 logit row, a
    boolean row of allowed ids, the argmax among them."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(VOCAB).astype(np.float32)
    allowed = np.zeros(VOCAB, dtype=bool)
    allowed[rng.choice(VOCAB, 2000, replace=False)] = True
    t0 = time.perf_counter()
    for _ in range(repeat):
        ids = np.flatnonzero(allowed)
        int(ids[np.argmax(logits[ids])])
    return (time.perf_counter() - t0) / repeat


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--libs", default="llguidance,xgrammar,outlines")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        write_tokenizer(Path(d), VOCAB)
        tok = Tokenizer.from_dir(d, vocab_size=VOCAB)
    print(f"masked argmax over a {VOCAB:,}-id row: {masked_argmax_seconds() * 1e6:.0f} us")
    print("| library | setup s | schema | compile ms | tokens | mask us/token: median | p95 | mean "
          "| feeding a token us: mean |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for name in args.libs.split(","):
        try:
            lib = LIBS[name](tok)
        except ImportError as e:
            print(f"| {name} | not installed: {e} |")
            continue
        for sname, (schema, instance) in SCHEMAS.items():
            ids = tok.encode(text_of(instance), allow_special=False)
            compiles, steps, feeds = [], [], []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                m = lib.compile(schema)
                compiles.append(time.perf_counter() - t0)
                for t in ids:
                    t0 = time.perf_counter()
                    lib.step(m)
                    steps.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    lib.feed(m, t)
                    feeds.append(time.perf_counter() - t0)
            steps.sort()
            print(f"| {lib.name} | {lib.setup:.2f} | {sname} | {statistics.median(compiles) * 1e3:.1f} "
                  f"| {len(ids)} | {statistics.median(steps) * 1e6:.0f} "
                  f"| {steps[int(len(steps) * 0.95)] * 1e6:.0f} | {statistics.mean(steps) * 1e6:.0f} "
                  f"| {statistics.mean(feeds) * 1e6:.0f} |")


if __name__ == "__main__":
    main()
