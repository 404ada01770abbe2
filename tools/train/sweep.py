"""The demo model's size sweep: a few sizes, each trained for about the same time.

``python -m tools.train.sweep --plan s128:150,s192:84,s256:65 --work build/sweep`` trains
each size of :data:`tools.train.train.SIZES` for its number of steps (chosen so each run
takes about as long on one machine: the steps are the equal-compute yardstick), with the
trainer's defaults otherwise, and writes ``sweep.json`` (size, parameters, steps, tokens,
seconds, held-out loss on code and prose) in the work directory. The model card records the
sweep that chose the shipped size.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tools.train import train


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plan", required=True, help="SIZE:STEPS,... e.g. s128:150,s256:65")
    ap.add_argument("--work", type=Path, default=Path("build/sweep"))
    ap.add_argument("--corpus-work", type=Path, default=Path("build/train"),
                    help="where the corpus, tokenizer and ids are built (shared with make train)")
    args, rest = ap.parse_known_args(argv)
    results = []
    for item in args.plan.split(","):
        size, steps = item.split(":")
        rc = train.main(["--work", str(args.corpus_work), "--size", size, "--steps", steps,
                         "--no-export", "--eval-every", steps, "--save-every", steps,
                         "--warmup", str(max(10, int(steps) // 10)), "--qat-frac", "0",
                         "--log-every", "10", *rest])
        if rc != 0:
            return rc
        log = json.loads((args.corpus_work / f"train_log-{size}.json").read_text())
        batch, seq = int(log["args"]["batch"]), int(log["args"]["seq"])
        results.append({"size": size, "params": log["params"], "steps": int(steps),
                        "tokens": int(steps) * batch * seq, "seconds": round(log["seconds"], 1),
                        "heldout": log["final_heldout"]})
        (args.corpus_work / f"checkpoint-{size}.pt").unlink(missing_ok=True)
        print(json.dumps(results[-1]), flush=True)
    args.work.mkdir(parents=True, exist_ok=True)
    (args.work / "sweep.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
