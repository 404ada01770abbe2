"""Export the second oracle: the trainer's own forward pass on the shipped model, once.

``python -m tools.train.oracle MODEL_DIR HELDOUT_TXT OUT_JSON`` loads ``MODEL_DIR`` (the
released layout, exactly as k3 reads it) into the PyTorch graph (fp32), takes a snippet of
the held-out split (the first :data:`N_IDS` tokens from the first ``def `` of the file
named :data:`SNIPPET_FILE`), and writes:

* ``ids`` and, per position, the argmax, the largest ``|logit|`` and the logits of the
  torch top-8 ids and of a fixed set of ids (``logits`` as ``[id, value]`` pairs);
* a greedy continuation by full re-forward in torch: ``prompt_ids`` (the first
  :data:`N_PROMPT` ids) and ``greedy_ids`` (:data:`N_GEN` tokens).

``tests/model/test_demo_oracle.py`` holds k3 (full and incremental) to these numbers
without torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from k3core.tokenizer.encoding import Tokenizer
from tools.train.released import load_model

SNIPPET_FILE = "cpython/textwrap.py"
N_IDS = 64
N_PROMPT = 24
N_GEN = 24
FIXED_IDS = (0, 1, 10, 32, 100, 255, 256, 1000, 2000, 3000, 3839)


def snippet(heldout: bytes) -> bytes:
    mark = f"# ---- file: {SNIPPET_FILE} ----\n".encode()
    start = heldout.index(mark) + len(mark)
    return heldout[heldout.index(b"\ndef ", start) + 1 :]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Export torch logits of the shipped model.")
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("heldout", type=Path)
    ap.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = load_model(args.model_dir).eval()
    model.chunk = 0  # the step-by-step recurrence, as k3 runs it
    tok = Tokenizer.from_dir(args.model_dir, vocab_size=model.cfg.vocab)
    ids = tok.encode_bytes(snippet(args.heldout.read_bytes()), allow_special=False)[:N_IDS]
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0].numpy()
        seq = list(ids[:N_PROMPT])
        for _ in range(N_GEN):
            seq.append(int(np.argmax(model(torch.tensor([seq]))[0, -1].numpy())))
    rows = []
    for row in logits:
        top = [int(i) for i in np.argsort(-row, kind="stable")[:8]]
        keep = sorted(set(top) | set(FIXED_IDS))
        rows.append({"argmax": int(np.argmax(row)), "max_abs": float(np.abs(row).max()),
                     "logits": [[i, float(row[i])] for i in keep]})
    doc = {
        "what": "torch (tools/train/k3torch.py, fp32) logits of the shipped demo model on a "
                "held-out snippet; see tools/train/oracle.py",
        "torch": torch.__version__,
        "snippet_file": SNIPPET_FILE,
        "ids": [int(i) for i in ids],
        "positions": rows,
        "prompt_ids": [int(i) for i in ids[:N_PROMPT]],
        "greedy_ids": seq[N_PROMPT:],
        "greedy_text": tok.decode(seq[N_PROMPT:]),
    }
    args.out.write_text(json.dumps(doc, indent=0) + "\n")
    print(f"oracle: {len(ids)} ids, greedy {N_GEN} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
