"""The yardstick for the model card: a unigram model of the same tokenizer on the same text.

``python -m tools.train.unigram TOK_DIR TRAIN_TXT TEXT [--json]`` counts the tokens of the
training split and scores ``TEXT`` with add-one smoothing over the tokenizer's ranks: mean
cross-entropy per token (nats) and perplexity, over the same targets ``k3 perplexity``
scores (every token after the first).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

from k3core.tokenizer.encoding import Tokenizer


def unigram_nll(tok: Tokenizer, train: bytes, text: bytes, n_ranks: int) -> tuple[float, int]:
    counts = np.bincount(tok.encode_bytes(train, allow_special=False), minlength=n_ranks)
    p = (counts[:n_ranks] + 1.0) / (counts[:n_ranks].sum() + n_ranks)
    ids = np.array(tok.encode_bytes(text, allow_special=False)[1:])
    return float(math.fsum((-np.log(p[ids])).tolist()) / len(ids)), len(ids)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("tok_dir", type=Path)
    ap.add_argument("train", type=Path)
    ap.add_argument("text", type=Path)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    tok = Tokenizer.from_dir(args.tok_dir)
    n_ranks = len(tok.encoding._mergeable_ranks)
    nll, n = unigram_nll(tok, args.train.read_bytes(), args.text.read_bytes(), n_ranks)
    res = {"scored": n, "mean_nll": nll, "perplexity": math.exp(nll)}
    print(json.dumps(res) if args.json else
          f"unigram: {n} tokens scored, mean NLL {nll:.6f} nats/token, perplexity "
          f"{math.exp(nll):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
