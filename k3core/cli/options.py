"""Each parameter's flag: the one table from a name of k3's Python API to the command line.

The library names its own parameters in its errors (``max_tokens must be in 0..4096``,
:func:`k3core.api.errors.param`); every command shows them as the flags its user typed
(``--gen must be in 0..4096``) through :data:`FLAGS`, the table the engine flags are also
declared from. This module imports nothing heavy: the guard reads it on the way out.
"""

from __future__ import annotations

#: parameter -> its flag's declarations (the first long one is the name errors use; a slash
#: pair is an on/off switch)
FLAGS: dict[str, tuple[str, ...]] = {
    # the engine (k3core.run.request.EngineRequest)
    "model_dir": ("MODEL_DIR",),
    "config": ("--config",),
    "layers": ("--layers",),
    "tok": ("--tok",),
    "preset": ("--preset",),
    "trunk": ("--trunk",),
    "trunk_gb": ("--trunk-gb",),
    "trunk_ring": ("--trunk-ring",),
    "cache_gb": ("--cache-gb",),
    "ultra_low_memory": ("--ultra-low-memory",),
    "backend": ("--backend",),
    "storage": ("--storage",),
    "cache_policy": ("--cache-policy",),
    "cache_trace": ("--cache-trace",),
    "threads": ("--threads", "-t"),
    "incremental": ("--incremental/--full-recompute",),
    "lookahead": ("--lookahead",),
    "expert_readers": ("--expert-readers", "--readers"),
    "verify_trunk": ("--verify-trunk",),
    "prefill_chunk": ("--prefill-chunk",),
    # a generation (k3core.run.request.GenerationParams)
    "max_tokens": ("--gen", "-n"),
    "context": ("--context", "-c"),
    "temperature": ("--temperature",),
    "top_p": ("--top-p",),
    "top_k": ("--top-k",),
    "seed": ("--seed",),
    "stop": ("--stop",),
    "stop_ids": ("--stop-id",),
    "ignore_eos": ("--ignore-eos",),
    "spec": ("--spec",),
    "spec_width": ("--spec-width",),
    "spec_ngram": ("--spec-ngram",),
}


def flag_word(name: str) -> str:
    """How an error names the parameter ``name`` on the command line: its long flags
    (``--expert-readers/--readers``), ``MODEL_DIR`` for the argument, else ``name``."""
    decls = FLAGS.get(name)
    if not decls:
        return name
    long = [d for d in decls if d.startswith("--")]
    return "/".join(long) if long else decls[0]


#: parameter -> the words an error uses for it on the command line
FLAG_WORDS: dict[str, str] = {name: flag_word(name) for name in FLAGS}
