"""The engine: a model opened once from its checkpoint and plugins, reusable for many calls.

The third stage of request -> plan -> engine -> session -> report. :meth:`Engine.from_plan`
opens what a checked :class:`~k3core.run.plan.EnginePlan` resolved; :func:`open_engine` is
the same from bare :class:`EngineOptions` (tests and tools use it). The binding itself
(plugins, index, trunk, expert cache) is :mod:`k3core.run.binding`.

An engine serves any number of generations (:meth:`Engine.generate`, :meth:`Engine.stream`,
:meth:`Engine.logits`) and sessions (:meth:`Engine.session`), one at a time, and is closed
once (``close()`` or a ``with`` block).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from k3core.api.errors import UsageError
from k3core.model.config import ModelConfig
from k3core.model.state import SequenceState
from k3core.run.binding import Bound, EngineOptions, bind, read_model_config
from k3core.run.generation import Generation
from k3core.run.prompt import check_vocab
from k3core.run.report import run_record
from k3core.run.session import Session

if TYPE_CHECKING:
    from k3core.run.plan import EnginePlan

__all__ = ["Engine", "EngineOptions", "open_engine", "read_model_config"]


@dataclass
class Engine(Bound):
    """An open model and the calls that use it (see the module docstring)."""

    plan: EnginePlan | None = None

    @classmethod
    def from_plan(cls, plan: EnginePlan, trace_dir: Path | None = None,
                  on_layer_bound: Callable[[int], None] | None = None) -> Engine:
        """Open the engine a plan describes; the plan's memory check runs first."""
        plan.check()
        eng = open_engine(plan.options(trace_dir), plan.cfg, on_layer_bound)
        eng.tokenizer, eng.incremental, eng.plan = plan.tokenizer, plan.incremental, plan
        eng.notes = plan.notes + eng.notes
        return eng

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


def open_engine(opts: EngineOptions, cfg: ModelConfig | None = None,
                on_layer_bound: Callable[[int], None] | None = None) -> Engine:
    """Resolve plugins, index the checkpoint and bind the trunk; an :class:`Engine`."""
    return bind(opts, cfg, on_layer_bound, cls=Engine)
