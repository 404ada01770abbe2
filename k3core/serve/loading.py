"""How long a conversation ``k3 chat`` and ``k3 serve`` hold, and the engine request for it.

A chat or a server opens its engine once, the way every caller does
(:func:`k3core.run.engine.open_engine`), from :func:`conversation_request`: the command
line's engine flags, the memory plan sized for the longest conversation the command may
hold, a tokenizer required, and incremental decoding always (that is what carries a
conversation's state from one turn to the next).

Whether chat replies think first unless told (``--think/--no-think``, a request's
``reasoning_effort``) is the model's to say, through :func:`default_thinking`: yes for Kimi
K3 and any other model, no for a model k3's own trainer exported (its ``config.json`` holds
a ``k3_demo`` section: the demo model, whose chat transcripts were all without thinking,
never learned to close a thinking channel).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from k3core.api.errors import UsageError
from k3core.api.files import FileRejected, read_capped
from k3core.api.safejson import JSONRejected, parse_json
from k3core.model.config import MAX_CONFIG_BYTES
from k3core.run.prompt import MAX_PROMPT
from k3core.run.request import MAX_GEN, EngineRequest, build

#: the longest conversation a chat or server keeps (the prompt ceiling; one reply fits in it)
MAX_CONTEXT = MAX_PROMPT
#: the conversation a chat or server holds unless ``--context`` says otherwise
DEFAULT_CONTEXT = MAX_GEN


def check_context(context: int) -> int:
    if not 1 <= context <= MAX_CONTEXT:
        raise UsageError(f"--context must be in 1..{MAX_CONTEXT}, got {context}")
    return context


def conversation_request(model_dir: Path, context: int,
                         flags: Mapping[str, object]) -> EngineRequest:
    """The engine of a chat or a server on ``model_dir``, for conversations of ``context``
    ids, from ``k3 run``'s engine flags (``None`` = not given)."""
    check_context(context)
    given = {k: v for k, v in flags.items() if v is not None}
    return build(EngineRequest, {**given, "model_dir": model_dir, "incremental": True,
                                 "positions": context, "needs_tokenizer": True,
                                 "given_as": "flag"})


#: the ``config.json`` section that marks a model of k3's own trainer (``tools/train``)
DEMO_SECTION = "k3_demo"


def default_thinking(config: str | Path) -> bool:
    """Whether chat replies on the model of ``config`` (its ``config.json``) think unless
    told: False for a model trained to answer without thinking (module docstring), True otherwise (a
    config that cannot be read here was read to open the engine: True)."""
    try:
        doc = parse_json(read_capped(Path(config), MAX_CONFIG_BYTES))
    except (FileRejected, JSONRejected, OSError):
        return True
    return not (isinstance(doc, dict) and DEMO_SECTION in doc)
