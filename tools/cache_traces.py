"""Record the expert-request traces of each routing pattern k3 produces, for ``k3 sim-cache``.

One fresh engine per pattern, its expert cache recording (``--dump-cache-trace``'s recorder),
greedy decoding, the end-of-sequence id ignored so every row runs its full length:

``decode``
    One row: ``demo-model/prompt.txt``, then ``--decode-tokens`` tokens, incremental.
``prompt``
    The first ``--prompt-bytes`` bytes of the held-out ``shlex.py`` prefilled in one pass,
    then ``--prompt-tokens`` tokens, incremental: the decode just after a long prompt.
``prefill``
    The first ``--prefill-bytes`` bytes of the held-out ``shlex.py`` (the running Python's
    standard library; the demo model's card says which files it never saw), fed in passes of
    ``--prefill-chunk`` ids, prefill only.
``batch4``, ``batch16``
    ``Engine.generate_batch`` over 4 or 16 prompts at once (``max_batch`` the same): prompt
    ``i`` is ``--batch-prompt-bytes`` bytes of a held-out file (file ``i % 12``, from its
    start, or from its middle for ``i >= 12``), then ``--batch-tokens`` tokens each. The prompts come in beside
    each other in chunks (the scheduler's interleave chunk), then every pass is one batched
    decode step: each MoE layer asked for every row's top-k at once, in row order.

Each pattern's ``expert_trace.bin`` and ``expert_hist.json`` go to ``OUT/PATTERN/``. Which
rows share a batched pass depends on the threads' timing, so two recordings of a batched
pattern can differ by a few passes; the single-row patterns are exact. The demo model's traces
kept as test fixtures are these files gzipped (``gzip -9n``; ``k3 sim-cache`` reads them as
they are)::

    python tools/cache_traces.py demo-model build/traces/demo
    python tools/cache_traces.py MEDIUM build/traces/medium --trunk MEDIUM_TRUNK \\
        --decode-tokens 64 --batch-tokens 32

docs/expert-cache.md ("Routing patterns") has what the traces give.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
import time
from pathlib import Path
from typing import Any

from k3core.experts.trace import TraceRecorder
from k3core.run.engine import Engine, open_engine
from k3core.run.plan import EnginePlan
from k3core.run.request import EngineRequest, build

ROOT = Path(__file__).resolve().parent.parent
DECODE_PROMPT = ROOT / "demo-model" / "prompt.txt"
#: the demo model's held-out standard library modules, in name order (the corpus manifest's
#: list, demo-model/MODEL_CARD.md)
HELD_OUT = tuple(sorted(
    name.removesuffix(".py") for name in json.loads(
        (ROOT / "tools" / "train" / "corpus_manifest.json").read_text())["held_out"]["stdlib"]))
PATTERNS = ("decode", "prompt", "prefill", "batch4", "batch16")


def held_out(name: str) -> bytes:
    return (Path(sysconfig.get_paths()["stdlib"]) / f"{name}.py").read_bytes()


def batch_prompts(n: int, size: int) -> list[str]:
    out = []
    for i in range(n):
        data = held_out(HELD_OUT[i % len(HELD_OUT)])
        at = len(data) // 2 if i >= len(HELD_OUT) else 0  # a second prompt: the middle
        out.append(data[at : at + size].decode("utf-8", errors="ignore"))
    return out


def open_recording(args: argparse.Namespace, out: Path, **extra: Any) -> Engine:
    """An engine whose expert cache records every request (``out`` is where it goes)."""
    fields: dict[str, Any] = {"model_dir": str(args.model), "given_as": "flag", **extra}
    if args.trunk is not None:
        fields["trunk"] = str(args.trunk)
    if args.tok is not None:
        fields["tok"] = str(args.tok)

    def record(plan: EnginePlan) -> None:
        plan.trace_dir = out

    return open_engine(build(EngineRequest, fields), on_plan=record)


def record(args: argparse.Namespace, pattern: str) -> tuple[int, float]:
    """Run ``pattern`` on a fresh engine; write its trace. Returns (requests, seconds)."""
    out = args.out / pattern
    out.mkdir(parents=True, exist_ok=True)
    greedy = {"temperature": 0.0, "ignore_eos": True}
    extra = {"prefill_chunk": args.prefill_chunk} if pattern == "prefill" else {}
    t0 = time.perf_counter()
    with open_recording(args, out, **extra) as engine:
        if pattern == "decode":
            engine.generate(DECODE_PROMPT.read_text(encoding="utf-8"),
                            max_tokens=args.decode_tokens, **greedy)
        elif pattern == "prompt":
            text = held_out("shlex")[: args.prompt_bytes].decode("utf-8", errors="ignore")
            engine.generate(text, max_tokens=args.prompt_tokens, **greedy)
        elif pattern == "prefill":
            text = held_out("shlex")[: args.prefill_bytes].decode("utf-8", errors="ignore")
            engine.generate(text, max_tokens=0, **greedy)
        else:
            n = int(pattern.removeprefix("batch"))
            engine.generate_batch(batch_prompts(n, args.batch_prompt_bytes), max_batch=n,
                                  max_tokens=args.batch_tokens, **greedy)
        recorder = engine.experts.recorder  # type: ignore[attr-defined]
        assert isinstance(recorder, TraceRecorder)
        recorder.write(out)
        return len(recorder), time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--trunk", type=Path)
    ap.add_argument("--tok", type=Path)
    ap.add_argument("--patterns", default=",".join(PATTERNS))
    ap.add_argument("--decode-tokens", type=int, default=512)
    ap.add_argument("--prompt-bytes", type=int, default=2400)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--prefill-bytes", type=int, default=12000)
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument("--batch-prompt-bytes", type=int, default=200)
    ap.add_argument("--batch-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    for pattern in args.patterns.split(","):
        if pattern not in PATTERNS:
            ap.error(f"unknown pattern {pattern!r}; known: {', '.join(PATTERNS)}")
    for pattern in args.patterns.split(","):
        n, secs = record(args, pattern)
        print(f"{pattern}: {n} requests in {secs:.1f} s -> {args.out / pattern}", flush=True)


if __name__ == "__main__":
    main()
