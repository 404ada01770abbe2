"""``k3 run MODEL_DIR``: generate tokens and report what it cost (see ``k3core.run.runner``).

The generated text goes to stdout as it arrives; the plan, the per-step table and the
report go to stderr (``-q`` silences them, ``-v`` adds detail). With ``--batch-file`` every
prompt of a JSON Lines file runs, batched (``k3core.run.batch_runner``), one JSON result a
line on stdout.
"""

from __future__ import annotations

from pathlib import Path

import typer

from k3core.cli.guard import guarded
from k3core.cli.options import EngineFlags, engine_flags
from k3core.run.request import MAX_GEN

_P = "Prompt"
_M = "Memory"
_G = "Generation"
_X = "Plugins"
_O = "Outputs and diagnostics"
_C = "Cluster (docs/cluster.md)"
#: where each engine flag shows in ``k3 run --help``, and the panels in their order
PANELS = {"tok": _P, "preset": _M, "trunk": _M, "trunk_gb": _M, "trunk_ring": _M,
          "cache_gb": _M, "ultra_low_memory": _M, "prefill_chunk": _M, "incremental": _G,
          "backend": _X, "storage": _X, "cache_policy": _X, "cache_trace": _X, "threads": _X,
          "lookahead": _X, "expert_readers": _X, "config": _O, "layers": _O, "verify_trunk": _O}
ORDER = (_P, _M, _G, _X, _O, _C)


@guarded
@engine_flags(panel=PANELS, order=ORDER)
def run(
    model_dir: Path = typer.Argument(None, help="Directory with the safetensors shards (or $K3_MODEL_DIR).", show_default=False),
    prompt: str = typer.Option(None, "--prompt", "-p", help="Prompt text (tokenizer: --tok, or the files in MODEL_DIR).", rich_help_panel=_P),
    prompt_file: Path = typer.Option(None, "--prompt-file", "-f", help="Prompt file, its bytes taken verbatim; - reads standard input.", rich_help_panel=_P),
    ids: str = typer.Option(None, "--ids", help="Prompt token ids, e.g. 3,7,11 (no tokenizer needed).", rich_help_panel=_P),
    batch_file: Path = typer.Option(None, "--batch-file", help="Run every prompt of this JSON Lines file, their passes batched: one JSON object a line, {\"prompt\": TEXT} or {\"ids\": [...]} and any generation field (max_tokens, temperature, seed, stop, ...; the flags are the defaults); one JSON result a line on stdout as each ends (docs/batch-file.md).", rich_help_panel=_P),
    max_batch: int = typer.Option(None, "--max-batch", help="With --batch-file: prompts that run at once, 1..256 (default 8, or fewer if the memory plan fits fewer; each holds its KV cache and recurrent state).", rich_help_panel=_P),
    bos: bool = typer.Option(False, "--bos", help="Prepend the BOS token (never added otherwise).", rich_help_panel=_P),
    gen: int = typer.Option(8, "--gen", "-n", help=f"Tokens to generate (0..{MAX_GEN}; 0 = prefill only; -1 = until the end of sequence or the context is full).", rich_help_panel=_G),
    context: int = typer.Option(None, "--context", "-c", help=f"Ids the sequence may hold, the prompt included; generation stops when it is full (default: the prompt + {MAX_GEN}).", rich_help_panel=_G),
    stop_id: list[int] = typer.Option([], "--stop-id", help="Stop after emitting this id (repeatable, up to 8).", rich_help_panel=_G),
    stop: list[str] = typer.Option([], "--stop", help="Stop when the text contains TEXT, cut before it (repeatable, up to 8).", rich_help_panel=_G),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Run past the tokenizer's end-of-sequence id.", rich_help_panel=_G),
    temperature: float = typer.Option(None, "--temperature", help="Sample with this temperature (0 = greedy).", rich_help_panel=_G),
    top_p: float = typer.Option(None, "--top-p", help="Sample from the top-p mass (0, 1].", rich_help_panel=_G),
    top_k: int = typer.Option(None, "--top-k", help="Sample from the k most likely ids.", rich_help_panel=_G),
    seed: int = typer.Option(None, "--seed", help="Sampling seed (printed; the same seed gives the same tokens).", rich_help_panel=_G),
    spec: str = typer.Option(None, "--spec", help="Speculative decoding (default off, or the preset's): off, ngram (draft from the context's n-grams, verify in one pass; the same ids) or auto (draft where the cost model says it pays).", rich_help_panel=_G),
    spec_width: int = typer.Option(None, "--spec-width", help="Drafts verified per pass at most (1..16; default 4, or the preset's).", rich_help_panel=_G),
    spec_ngram: int = typer.Option(3, "--spec-ngram", help="Longest context suffix looked up for a draft (1..8).", rich_help_panel=_G),
    json_schema: Path = typer.Option(None, "--json-schema", help="Constrain the text to one JSON value of this JSON Schema (the supported subset: docs/server.md); the logits stay exact, the choice is made among the ids the schema allows.", rich_help_panel=_G),
    grammar: Path = typer.Option(None, "--grammar", help="Constrain the text to this grammar (llguidance's Lark; a .gbnf file is read as llama.cpp's GBNF).", rich_help_panel=_G),
    save_state: Path = typer.Option(None, "--save-state", help="After the run, write the session (ids, KV and recurrent state) here.", rich_help_panel=_G),
    load_state: Path = typer.Option(None, "--load-state", help="Resume a saved session: the prompt continues it (same model and config only).", rich_help_panel=_G),
    out: Path = typer.Option(None, "--out", help="Write the result, the request and the plan as JSON (with --batch-file: the result lines, in the file's order).", rich_help_panel=_O),
    dump_logits: Path = typer.Option(None, "--dump-logits", help="Write step 0's logits as raw float32.", rich_help_panel=_O),
    dump_cache_trace: Path = typer.Option(None, "--dump-cache-trace", help="Write expert_trace.bin and expert_hist.json into this directory.", rich_help_panel=_O),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only the generated text (nothing on stderr but errors).", rich_help_panel=_O),
    verbose: int = typer.Option(0, "--verbose", "-v", count=True, help="More detail on stderr: every setting and its source, the request.", rich_help_panel=_O),
    expert_workers: int = typer.Option(None, "--expert-workers", help="Routed experts on N Ray workers (a local cluster unless --ray-address; needs k3[ray]).", rich_help_panel=_C),
    ray_address: str = typer.Option(None, "--ray-address", help="Join this Ray cluster (ray start --head) for the expert workers.", rich_help_panel=_C),
    expert_shares: str = typer.Option(None, "--expert-shares", help="Where worker-0 ... (k3 shard-experts) lie on the worker nodes; MODEL_DIR is then its head/ ($K3_EXPERT_SHARES on a node overrides it there).", rich_help_panel=_C),
    worker_retries: int = typer.Option(2, "--worker-retries", help="Times a MoE layer's call is sent again to a worker that died and was restarted (0..100).", rich_help_panel=_C),
    *,
    flags: EngineFlags,
) -> None:
    """Generate tokens from MODEL_DIR (greedy unless a sampling flag is given); with
    --batch-file, for every prompt of a JSON Lines file, batched."""
    from k3core.run.request import RunRequest
    from k3core.run.runner import execute

    given = {
        **flags.given, "model_dir": model_dir, "prompt": prompt, "prompt_file": prompt_file,
        "ids": ids, "bos": bos, "gen": gen, "context": context, "stop_id": stop_id,
        "stop": stop, "ignore_eos": ignore_eos, "temperature": temperature, "top_p": top_p,
        "top_k": top_k, "seed": seed, "spec": spec, "spec_width": spec_width,
        "spec_ngram": spec_ngram, "json_schema": json_schema, "grammar": grammar,
        "save_state": save_state, "load_state": load_state,
        "out": out, "dump_logits": dump_logits, "dump_cache_trace": dump_cache_trace,
        "quiet": quiet, "verbose": verbose}
    if batch_file is not None or max_batch is not None:
        from k3core.run.batch_runner import execute_batch

        execute_batch(given, batch_file, max_batch, also={
            "--expert-workers": expert_workers, "--ray-address": ray_address,
            "--expert-shares": expert_shares})
        return
    request = RunRequest.from_flags(given)
    remote = None
    if expert_workers is not None or ray_address is not None or expert_shares is not None:
        from k3core.cluster.executor import ClusterExperts

        remote = ClusterExperts(expert_workers, ray_address, cache_gb=request.engine.cache_gb,
                                shares=expert_shares, retries=worker_retries)
    elif model_dir is not None:
        from k3core.cluster.shares import refuse_head_alone

        refuse_head_alone(model_dir)
    execute(request, remote=remote)


def register(app: typer.Typer) -> None:
    app.command("run")(run)
