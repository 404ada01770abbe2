"""The engine: a model opened once from its checkpoint and plugins, reusable for many calls.

:func:`open_engine` is the one way to open one, for every caller (the command line's
commands, ``k3.load``, the server, ``k3 tune``, the benches, ``k3 perplexity``): a request
(:class:`~k3core.run.request.EngineRequest`, or a whole
:class:`~k3core.run.request.RunRequest`) becomes a plan (:mod:`k3core.run.plan`: presets, the
environment, the plugins, the memory plan), the plan is checked, and
:func:`~k3core.run.binding.bind` opens what it resolved.

An engine serves any number of generations (:meth:`Engine.generate`, :meth:`Engine.stream`,
:meth:`Engine.logits`, :meth:`Engine.generate_batch`) and sessions (:meth:`Engine.session`);
calls from several threads at once share batched passes (``k3core.model.scheduler``). It is
closed
once (``close()`` or a ``with`` block). It is the handle a caller holds, so it sits above
the session and the report it hands out (docs/architecture.md, the stages' import order).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from k3core.api.errors import UsageError
from k3core.model.state import SequenceState
from k3core.run.arenas import limit_arenas
from k3core.run.binding import Bound, bind
from k3core.run.generation import Generation
from k3core.run.plan import EnginePlan, plan_engine, plan_run
from k3core.run.prompt import check_vocab
from k3core.run.report import run_record
from k3core.run.request import EngineRequest, RunRequest
from k3core.run.session import Session, params_from

__all__ = ["Engine", "open_engine"]


@dataclass(kw_only=True)
class Engine(Bound):
    """An open model and the calls that use it (see the module docstring)."""

    def session(self, incremental: bool | None = None) -> Session:
        """A new sequence that carries its state across calls (``k3core.run.session``)."""
        self._check_open()
        return Session(self, incremental)

    def generate(self, prompt: str | Sequence[int], **params: Any) -> Generation:
        """Generate after ``prompt`` (text or ids) in a fresh session, with the run report.

        ``params`` are :class:`~k3core.run.request.GenerationParams` fields: ``max_tokens``,
        ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``, ``stop_ids``, ``ignore_eos``.
        """
        gen = self.session().generate(prompt, **params)
        gen.report = run_record(self, gen)
        return gen

    def generate_batch(self, prompts: Sequence[str | Sequence[int]], *,
                       max_batch: int | None = None, **params: Any) -> list[Generation]:
        """Generate after every prompt at once (``k3core.run.batch``): their passes batched,
        each result the bytes of that prompt run alone, in the prompts' order. ``params`` as
        :meth:`generate` (a ``seed`` gives prompt ``i`` the seed ``seed + i``); at most
        ``max_batch`` prompts run together (default 8). The first failure is raised once every
        prompt has ended."""
        from k3core.run.batch import run_batch

        self._check_open()
        base = params_from(None, params)
        items = [(p, base if base.seed is None else
                  base.model_copy(update={"seed": (base.seed + i) % (1 << 63)}))
                 for i, p in enumerate(prompts)]
        out = run_batch(self, items, max_batch=max_batch)
        for r in out:
            if isinstance(r, BaseException):
                raise r
        return [r for r in out if isinstance(r, Generation)]

    def stream(self, prompt: str | Sequence[int], **params: Any) -> Iterator[str]:
        """Text pieces as tokens arrive (a fresh session; a UTF-8 character is never split)."""
        return self.session().stream(prompt, **params)

    def logits(self, ids: Sequence[int], all_positions: bool = False) -> np.ndarray:
        """float32 logits after ``ids`` (one pass from a fresh state): the last position's
        ``[vocab]`` vector, or ``[len(ids), vocab]`` with ``all_positions``."""
        self._check_open()
        seq = [int(i) for i in ids]
        if not seq:
            raise UsageError("logits() needs at least one id")
        check_vocab(seq, self.cfg.vocab, "ids")
        st = SequenceState(self.cfg, len(seq), shared_kda_slot=self.model.shared_kda_slot)
        out = self.model.forward(np.array(seq), st, all_logits=all_positions)
        return np.array(out if all_positions else out[-1], dtype=np.float32)

    def _check_open(self) -> None:
        if self.closed:
            raise UsageError("this engine is closed; open another with k3.load(...)")

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_engine(request: EngineRequest | RunRequest, *,
                on_plan: Callable[[EnginePlan], None] | None = None,
                on_layer_bound: Callable[[int], None] | None = None) -> Engine:
    """Open an engine: request -> plan -> engine.

    The plan (:func:`~k3core.run.plan.plan_engine`, or :func:`~k3core.run.plan.plan_run` for
    a whole run) resolves the preset, the environment and the plugins and sums the memory;
    ``on_plan`` sees it before anything large is allocated (``k3 run`` prints it); then the
    memory plan is checked (``MemoryPlanError``, exit 1) and the plan is bound.
    ``on_layer_bound(L)`` hears each layer as it binds."""
    limit_arenas()  # before the engine's threads: one heap each would outgrow the plan
    plan = plan_run(request) if isinstance(request, RunRequest) else plan_engine(request)
    if on_plan is not None:
        on_plan(plan)
    plan.check()
    return bind(plan, Engine, on_layer_bound)
