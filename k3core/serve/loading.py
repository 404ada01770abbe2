"""Open what ``k3 chat`` and ``k3 serve`` hold for their whole life: the engine and tokenizer.

The engine is opened once, with the plugins and budgets the command line chose (the run
pipeline's :func:`k3core.run.engine.open_engine`), and the KV cache for ``context``
positions is checked against the memory available before anything is allocated.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from k3core.api.errors import UsageError
from k3core.experts.setup import CacheOptions
from k3core.run.engine import Engine, EngineOptions, open_engine, read_model_config
from k3core.run.memory_plan import check_kv
from k3core.run.prompt import MAX_PROMPT
from k3core.tokenizer.encoding import Tokenizer

#: the longest conversation a chat or server keeps (the prompt ceiling plus one generation)
MAX_CONTEXT = MAX_PROMPT + 4096
DEFAULT_CONTEXT = 4096


@dataclass
class LoadOptions:
    model_dir: Path
    tok: Path | None = None
    context: int = DEFAULT_CONTEXT
    trunk: Path | None = None
    trunk_gb: float | None = None
    cache_gb: float | None = None
    backend: str = "auto"
    storage: str = "auto"
    cache_policy: str = "auto"
    threads: int | None = None


def open_model(o: LoadOptions) -> tuple[Engine, Tokenizer]:
    if not 1 <= o.context <= MAX_CONTEXT:
        raise UsageError(f"--context must be in 1..{MAX_CONTEXT}, got {o.context}")
    if o.threads is not None and o.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {o.threads}")
    if not Path(o.model_dir).is_dir():
        raise UsageError(f"model directory {o.model_dir} does not exist")
    tok_dir = Path(o.tok) if o.tok is not None else Path(o.model_dir)
    if not (tok_dir / "tiktoken.model").is_file():
        raise UsageError(f"no tokenizer in {tok_dir} (tiktoken.model and tokenizer_config.json); "
                         "pass --tok DIR")
    eopts = EngineOptions(Path(o.model_dir), backend=o.backend, storage=o.storage,
                          cache_policy=o.cache_policy, threads=o.threads, trunk_dir=o.trunk,
                          trunk_gb=o.trunk_gb, cache=CacheOptions(cache_gb=o.cache_gb))
    cfg = read_model_config(eopts)
    tok = Tokenizer.from_dir(tok_dir, vocab_size=cfg.vocab)
    check_kv(cfg, o.context)
    return open_engine(eopts, cfg), tok
