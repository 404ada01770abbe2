"""Open the engine ``k3 chat`` and ``k3 serve`` hold for their whole life.

The same pipeline as ``k3 run`` and ``k3.load``: an :class:`~k3core.run.request.EngineRequest`
from the command line's engine flags, resolved into a plan (config, preset, settings,
plugins, tokenizer), the memory plan checked for the longest conversation the command may
hold, then :meth:`~k3core.run.engine.Engine.from_plan`. A chat or a server always decodes
incrementally: that is what carries a conversation's state from one turn to the next.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from k3core.api.errors import UsageError
from k3core.run.engine import Engine
from k3core.run.plan import plan_engine
from k3core.run.prompt import MAX_PROMPT
from k3core.run.request import EngineRequest, build

#: the longest conversation a chat or server keeps (the prompt ceiling; one reply fits in it)
MAX_CONTEXT = MAX_PROMPT
DEFAULT_CONTEXT = 4096


def check_context(context: int) -> int:
    if not 1 <= context <= MAX_CONTEXT:
        raise UsageError(f"--context must be in 1..{MAX_CONTEXT}, got {context}")
    return context


def open_engine_for(model_dir: Path, context: int = DEFAULT_CONTEXT, **flags: Any) -> Engine:
    """Open ``model_dir`` with ``k3 run``'s engine flags (``None`` = not given)."""
    check_context(context)
    fields = {"model_dir": model_dir, "incremental": True, **flags}
    req = build(EngineRequest, {k: v for k, v in fields.items() if v is not None})
    plan = plan_engine(req, needs_tokenizer=True)
    plan.plan_memory(prompt_len=context, gen=0)
    return Engine.from_plan(plan)
