"""Each parameter's flag, and the engine flags made from the request model.

:data:`FLAGS` is the one table from a name of k3's Python API to the command line. The
library names its own parameters in its errors (``max_tokens must be in 0..4096``,
:func:`k3core.api.errors.param`); every command shows them as the flags its user typed
(``--gen must be in 0..4096``) through it.

:func:`engine_flags` gives a command the engine flags, one per field of
:class:`~k3core.run.request.EngineRequest`: declared as :data:`FLAGS` says, the field's
description as the help text, the field's default, and the request's checks, so ``k3 run``,
``k3 chat``, ``k3 serve``, ``k3 tune``, ``k3 bench decode`` and ``k3 perplexity`` take the
same flags with the same help and the same refusals. This module imports nothing heavy at
import time: the guard reads the table on the way out.
"""

from __future__ import annotations

import functools
import inspect
import re
import typing
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

if TYPE_CHECKING:
    from k3core.run.request import EngineRequest

F = TypeVar("F", bound=Callable[..., Any])

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
    # a run's constraint (k3core.constrain.files)
    "json_schema": ("--json-schema",),
    "grammar": ("--grammar",),
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


# ---- the engine flags, made from the request's fields ---------------------------------------
#: the engine fields a command line never takes as a flag (MODEL_DIR is each command's
#: argument)
NOT_FLAGS = ("model_dir",)


class EngineFlags:
    """The engine flags one command was given (``None``: not given), by field name: each
    value as typer parsed it (a list for a repeatable flag), checked by the request."""

    def __init__(self, given: Mapping[str, Any]):
        self.given: dict[str, Any] = dict(given)

    def request(self, **use: object) -> EngineRequest:
        """The engine request of these flags (named ``flag --NAME`` in the plan), plus
        ``use``: the model directory and how the engine will be used (``positions``,
        ``needs_tokenizer``, ...); ``None`` in either means not given."""
        from k3core.run.request import EngineRequest, build

        values = {k: v for k, v in {**self.given, **use}.items() if v is not None}
        return build(EngineRequest, {**values, "given_as": "flag"})


def engine_flags(*, omit: Collection[str] = (), only: Collection[str] | None = None,
                 panel: str | Mapping[str, str] | None = None,
                 order: Sequence[str] = (), after: str | None = None,
                 repeatable: Collection[str] = (),
                 notes: Mapping[str, str] | None = None) -> Callable[[F], F]:
    """Give a typer command the engine flags: one option per field of
    :class:`~k3core.run.request.EngineRequest` (but ``omit``, or ``only`` those), declared as
    :data:`FLAGS` says, helped by the field's description, defaulting to the field's
    default. The command takes them as one keyword argument, ``flags``
    (:class:`EngineFlags`).

    ``panel``: the help panel of every flag, or of each by name; ``order``: the panels in the
    order the help shows them (the command's own options are sorted into it too); ``after``:
    the command's own parameter the flags follow (by default they come last).
    ``repeatable``: the flags taken any number of times (a list, ``[]`` when not given:
    ``k3 tune``'s candidates). ``notes``: a command's own words after a flag's help text."""

    def decorate(fn: F) -> F:
        from typer.models import ArgumentInfo

        from k3core.run.request import EngineRequest

        names = [n for n in (only if only is not None else EngineRequest.options())
                 if n not in omit and n not in NOT_FLAGS]
        fields = EngineRequest.model_fields
        sig = inspect.signature(fn)
        own = [p for p in sig.parameters.values() if p.name != "flags"]
        added = []
        for name in names:
            info = fields[name]
            many = name in repeatable
            kind = _flag_type(info.annotation, many)
            where = panel.get(name) if isinstance(panel, Mapping) else panel
            added.append(inspect.Parameter(
                name, inspect.Parameter.KEYWORD_ONLY, annotation=kind,
                default=_option(name, info.description or "", info.default, many, kind,
                                where, (notes or {}).get(name))))
        at = len(own) if after is None else [p.name for p in own].index(after) + 1
        params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
                  for p in [*own[:at], *added, *own[at:]]]
        if order:
            rank = {p: i for i, p in enumerate(order)}
            params = sorted(params, key=lambda p: (not isinstance(p.default, ArgumentInfo),
                                                   rank.get(_panel_of(p), len(rank))))

        @functools.wraps(fn)
        def command(*args: Any, **kwargs: Any) -> Any:
            given = {n: kwargs.pop(n) for n in names}
            return fn(*args, flags=EngineFlags(given), **kwargs)

        command.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
        command.__annotations__ = {k: v for k, v in fn.__annotations__.items() if k != "flags"}
        command.__annotations__.update({p.name: p.annotation for p in added})
        return cast(F, command)

    return decorate


def _flag_type(annotation: Any, many: bool) -> Any:
    """The option's type: the field's, or a list of its values for a repeatable flag."""
    if not many:
        return annotation
    inner = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    return list[inner[0]]  # type: ignore[valid-type]


def _option(name: str, description: str, default: Any, many: bool, kind: Any,
            panel: str | None, note: str | None) -> Any:
    """The typer option of one field."""
    import typer

    decls = FLAGS[name]
    text = _BACKQUOTED.sub(lambda m: flag_word(m.group(1)).split("/")[0]
                           if m.group(1) in FLAGS else m.group(0), description)
    if note:
        text = f"{text[:-1] if text.endswith('.') and not text.endswith('...') else text}; {note}."
    extra: dict[str, Any] = {}
    if panel is not None:
        extra["rich_help_panel"] = panel
    if kind in (bool, bool | None) and default is None:
        extra["show_default"] = False
    return typer.Option([] if many else default, *decls, help=text, **extra)


def _panel_of(p: inspect.Parameter) -> str:
    return str(getattr(p.default, "rich_help_panel", None) or "")


_BACKQUOTED = re.compile(r"`(\w+)`")
