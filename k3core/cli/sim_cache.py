"""``k3 sim-cache TRACE``: replay a recorded expert trace under every cache policy and Belady.

The trace is an ``expert_trace.bin`` (``k3 run --dump-cache-trace DIR``, or the reference
engine's). Sizes come as ``--slots`` or ``--cache-gb`` (decimal GB, converted with the
expert's byte size like the reference's ``sim_cache.py``); the defaults are the reference's
twelve budgets. ``--model DIR`` takes top-k, the layer and expert counts and the expert size
from that model, so a trace k3 recorded from a synthetic model is replayed with its own
shape. A trace recorded with the router lookahead has its guesses beside it
(``expert_guess.bin``, or ``--guesses FILE``): the lookahead is replayed too (recall, demand
reads, wasted bytes). ``--serve visits`` replays a layer visit as the engine serves it (each
expert once, its other rows with the same use) instead of request by request. A trace may be
gzipped (``expert_trace.bin.gz``). See ``docs/expert-cache.md``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import typer

from k3core.api.errors import UsageError
from k3core.api.units import check_gb
from k3core.cli.guard import guarded

if TYPE_CHECKING:
    from k3core.experts.locator import PoolShape


def parse_numbers(text: str, flag: str, *, integer: bool) -> list[Any]:
    """``"455,911"`` -> ``[455, 911]``; every piece a positive finite number (else exit 2)."""
    pieces = [p for p in text.replace(" ", ",").split(",") if p]
    if not pieces:
        raise UsageError(f"{flag}: no sizes in {text!r}")
    out: list[Any] = []
    for p in pieces:
        try:
            v: Any = int(p) if integer else float(p)
        except ValueError:
            kind = "whole numbers of slots" if integer else "numbers of GB"
            raise UsageError(f"bad {flag} value {p!r}: sizes are positive {kind}, e.g. 455,911") from None
        if not (math.isfinite(v) and v > 0):
            raise UsageError(f"bad {flag} value {p!r}: sizes must be positive")
        out.append(v)
    return out


def read_guess_file(trace: Path, given: Path | None, requests: int,
                    shape: PoolShape | None) -> np.ndarray | None:
    """The lookahead's guesses: ``--guesses``, else ``expert_guess.bin`` beside the trace."""
    from k3core.experts.guess_trace import GUESS_NAME, read_guesses

    path = given if given is not None else trace.parent / GUESS_NAME
    if given is None and not path.is_file():
        return None
    return read_guesses(path, requests, n_layers=shape.max_layer if shape else None,
                        n_experts=shape.n_experts if shape else None)


def check_visits(pairs: np.ndarray, topk: int) -> None:
    """Every layer visit of the trace must be whole positions of ``topk`` requests."""
    from k3core.experts.simulator import TraceView

    for start, end, layer, _ in TraceView.of(pairs).visits:
        if (end - start) % topk:
            raise UsageError(
                f"the trace's visit of layer {layer} at request {start} has {end - start} "
                f"requests, not a multiple of top-k {topk}; give the model's top-k with "
                "--topk or --model DIR"
            )


def check_hist(trace: Path, n_layers: int, n_experts: int) -> None:
    """A trace k3 recorded names its model's shape in ``expert_hist.json`` beside it: refuse
    replaying it for ``--model`` of another shape."""
    from k3core.experts.trace import HIST_NAME, TraceError, read_hist

    hist_path = trace.parent / HIST_NAME
    if not hist_path.is_file():
        return
    hist = read_hist(hist_path)
    if (hist["n_layers"], hist["n_experts"]) != (n_layers, n_experts):
        raise TraceError(f"trace {trace} was recorded from a model with {hist['n_layers']} "
                         f"layers and {hist['n_experts']} experts ({hist_path}); --model has "
                         f"{n_layers} and {n_experts}: a trace of another model")


def check_plot(plot: Path, trace: Path, guesses: Path | None, model: Path | None) -> None:
    """Refuse, before the replay, a ``--plot`` that cannot be written or would replace what
    the command reads: the trace, the files read beside it, ``--guesses``, ``--model``."""
    from k3core.api.outputs import check_outputs
    from k3core.experts.guess_trace import GUESS_NAME
    from k3core.experts.trace import HIST_NAME

    check_outputs([(plot, "--plot")], inputs=[
        (trace, "the trace"), (trace.parent / HIST_NAME, "the trace's histogram"),
        (guesses if guesses is not None else trace.parent / GUESS_NAME, "the guesses"),
        (model, "--model")])


@guarded
def sim_cache(
    trace: Path = typer.Argument(..., help="expert_trace.bin (k3 run --dump-cache-trace, or the reference's)."),
    slots: str = typer.Option(None, "--slots", help="Cache sizes in slots, e.g. 455,911,1823."),
    cache_gb: str = typer.Option(None, "--cache-gb", help="Cache sizes in GB (1e9 B), e.g. 8,16,32 (default: the reference's 12 sizes)."),
    expert_bytes: int = typer.Option(None, "--expert-bytes", help="Bytes of one expert (default 17547264, Kimi K3's; or --model's)."),
    topk: int = typer.Option(None, "--topk", help="Experts per position (default 16, Kimi K3's; or --model's)."),
    model: Path = typer.Option(None, "--model", help="Take top-k, layer/expert counts and the expert size from this model directory."),
    policy: list[str] = typer.Option([], "--policy", help="Replay only this policy (repeatable; default: every registered one)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (hit rates as fractions 0..1)."),
    plot: Path = typer.Option(None, "--plot", help="Also write hit rate versus slots as a PNG."),
    guesses: Path = typer.Option(None, "--guesses", help="The router lookahead's expert_guess.bin (default: beside TRACE when there)."),
    no_lookahead: bool = typer.Option(False, "--no-lookahead", help="Ignore the lookahead's guesses."),
    serve: str = typer.Option("requests", "--serve", help="Replay a layer visit request by request (requests, the reference's) or as the engine serves it, each expert once (visits)."),
) -> None:
    """Replay TRACE under every cache policy and Belady: hit rate and bytes read per token."""
    from k3core.experts.locator import pool_shape
    from k3core.experts.simulator import EXPERT_BYTES, MODEL_TOPK, SERVE_MODES, simulate
    from k3core.experts.trace import read_trace

    if slots is not None and cache_gb is not None:
        raise UsageError("give cache sizes as --slots or as --cache-gb, not both")
    if serve not in SERVE_MODES:
        raise UsageError(f"--serve must be one of {', '.join(SERVE_MODES)}, got {serve!r}")
    slot_list = parse_numbers(slots, "--slots", integer=True) if slots is not None else None
    gb_list = parse_numbers(cache_gb, "--cache-gb", integer=False) if cache_gb is not None else None
    for gb in gb_list or ():
        check_gb(gb, "--cache-gb", positive=True)
    for flag, v in (("--expert-bytes", expert_bytes), ("--topk", topk)):
        if v is not None and v < 1:
            raise UsageError(f"{flag} must be a positive whole number, got {v}")
    if plot is not None:
        check_plot(plot, trace, guesses, model)
    shape = pool_shape(model) if model is not None else None
    k = topk or (shape.topk if shape else MODEL_TOPK)
    nbytes = expert_bytes or (shape.expert_bytes if shape else EXPERT_BYTES)
    pairs = read_trace(trace, n_layers=shape.max_layer if shape else None,
                       n_experts=shape.n_experts if shape else None)
    if shape is not None:
        check_hist(trace, shape.max_layer + 1, shape.n_experts)
    check_visits(pairs, k)
    guess_rows = None if no_lookahead else read_guess_file(trace, guesses, len(pairs), shape)
    moe_layers = shape.n_layers if shape else len(np.unique(pairs[:, 0]))
    sizes = slot_list if slot_list is not None else None
    if sizes is not None and all(s < k + 1 for s in sizes):
        raise UsageError(f"every size is under top-k + 1 = {k + 1} slots (the engine refuses those)")
    from rich.console import Console

    status = Console(stderr=True)
    with status.status("replaying the trace", spinner="dots") as st:
        result = simulate(
            pairs, slots_list=sizes, cache_gb=gb_list if sizes is None else None,
            policies=policy or None, expert_bytes=nbytes, requests_per_token=k * moe_layers,
            topk=k, n_layers=shape.n_layers if shape else None,
            n_experts=shape.n_experts if shape else None,
            progress=lambda name, n: st.update(f"replaying {name} at {n} slots"),
            serve=serve,
        )
    if not result.rows:
        raise UsageError(f"every size is under top-k + 1 = {k + 1} slots (the engine refuses those); "
                         f"{nbytes:,}-byte experts")
    if plot is not None:
        result.plot(plot)
    la_text, la_json = "", None
    if guess_rows is not None:
        from k3core.experts.lookahead_sim import lookahead_for

        la_text, la_json = lookahead_for(result, pairs, guess_rows, policy or None, k)
    if as_json:
        doc = result.to_json()
        if la_json is not None:
            doc["lookahead"] = la_json
        print(json.dumps(doc, indent=2, allow_nan=False))
        return
    print(result.to_text())
    if la_text:
        print(la_text)
    if result.skipped_slots:
        print(f"skipped sizes under top-k + 1 = {k + 1} slots: {', '.join(map(str, result.skipped_slots))}")
    if plot is not None:
        print(f"wrote {plot}")


def register(app: typer.Typer) -> None:
    app.command("sim-cache")(sim_cache)
