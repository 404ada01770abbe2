"""A session: one sequence on an open engine, carried across calls.

The fourth stage of request -> plan -> engine -> session -> report. A :class:`Session`
holds the ids of its sequence and, when decoding incrementally (the default), the KDA
recurrent state, the conv history and the MLA KV cache, so a second ``generate`` costs only
its own new tokens. The last generated id is *pending*: it is fed at the start of the next
call, exactly as a single longer run would feed it, so a conversation split into calls gives
the same ids and logit bytes as one run over the concatenated prompt.

Full recompute (``incremental=False``) keeps only the ids and re-runs the whole sequence
every step (O(T^2)); it gives the same tokens.

One step, in order: ``before_step`` (a hook, for fault tests), the forward pass, the pick
(greedy or the seeded sampler), then the stop checks: a ``stop_ids`` id, the end-of-sequence
id (unless ``ignore_eos``; its text is not shown), a stop string (the text is cut before it),
``max_tokens``. With ``spec`` (``ngram``/``auto``) a step is a verify pass that may emit
several tokens (the same ids, each checked against the stops in turn; the state keeps only
what was emitted: :mod:`k3core.model.speculative`). With a ``constraint``
(:mod:`k3core.model.constraint`) the pick is restricted to the ids it allows (the logits stay
exact), and the ids it then forces are emitted as steps of their own without a pick and
fed with the next pass, several ids in one pass; a constraint that is complete ends the
generation (``stop``). A Ctrl-C inside the loop leaves what
was made in :attr:`Session.last` (``interrupted=True``, ``stop_reason="interrupted"``) and propagates; the session stays usable (a forward pass cut short
drops the carried state, and the next call prefills the session's ids again).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import fields, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from k3core.api.errors import UsageError, param
from k3core.model.constraint import Constraint, masked, take_forced
from k3core.model.sampling import Sampler, argmax
from k3core.model.speculative import SpecOptions, Speculator
from k3core.model.state import SequenceState, StateSnapshot, restore
from k3core.model.steps import Step
from k3core.run.generation import Generation
from k3core.run.memory_plan import check_kv
from k3core.run.prompt import MAX_PROMPT, check_vocab
from k3core.run.request import GenerationParams, build
from k3core.run.stops import TextStream

if TYPE_CHECKING:
    from k3core.run.binding import Bound


#: wraps a generation's pick (``Session.steps``' ``around``)
PickWrap = Callable[[Callable[[np.ndarray], int]], Callable[[np.ndarray], int]]
#: the most ids one pass of :meth:`Session.prefill` feeds when it hands out every row's logits
ROWS_PASS = 64


def make_sampler(p: GenerationParams) -> Sampler | None:
    """``None`` for greedy (a temperature below ``MIN_TEMPERATURE``, 0 included, or no
    sampling keyword), else the seeded sampler."""
    if p.greedy:
        return None
    seed = p.seed if p.seed is not None else time.time_ns() % (1 << 63)
    return Sampler(temperature=1.0 if p.temperature is None else p.temperature,
                   top_p=1.0 if p.top_p is None else p.top_p, top_k=p.top_k, seed=seed)


def params_from(params: GenerationParams | None, kw: dict[str, Any]) -> GenerationParams:
    if params is not None and kw:
        raise UsageError("give either a GenerationParams or keywords, not both")
    if params is not None:
        return params
    return build(GenerationParams, {k: v for k, v in kw.items() if v is not None})


class Session:
    """One sequence on ``engine``; see the module docstring."""

    def __init__(self, engine: Bound, incremental: bool | None = None):
        self.engine = engine
        self.incremental = engine.incremental if incremental is None else incremental
        self.ids: list[int] = []
        self.state: SequenceState | None = None
        self.last: Generation | None = None
        #: set by another thread to end the session's current pass between two chunks
        #: (``k3core.model.scheduler.Cancelled``; a server's client that went away)
        self.cancel: threading.Event | None = None
        #: the logits of the last id the state holds (a kept prompt state, with its last
        #: row's logits, :mod:`k3core.run.prefix_cache`): the next call's first pick uses
        #: them instead of a pass, when it feeds nothing new and does not draft
        self.primed: np.ndarray | None = None
        #: told the first pass's logits when it fed everything the session holds (the
        #: server keeps the prompt's state with them)
        self.after_prefill: Callable[[np.ndarray], None] | None = None

    # ---- the sequence ------------------------------------------------------------------------
    @property
    def positions(self) -> int:
        """Positions whose state is held (incremental) or ids held (full recompute)."""
        return self.state.pos if self.state is not None else 0

    @property
    def pending(self) -> list[int]:
        """Ids of the sequence not yet fed to the model (the last generated one, usually)."""
        return self.ids[self.positions:] if self.incremental else []

    def reset(self) -> None:
        self.ids, self.state, self.last = [], None, None

    def resume(self, ids: Sequence[int], snap: StateSnapshot) -> None:
        """Start this session from a kept state (``snap``, reached after ``ids``: a prefix
        cache's entry, :mod:`k3core.run.prefix_cache`): the same bytes as feeding ``ids``."""
        if not self.incremental:
            raise UsageError("resuming a kept state needs incremental decoding")
        if snap.pos != len(ids):
            raise UsageError(f"a kept state of {snap.pos} positions does not match {len(ids)} ids")
        self.reset()
        self._reserve(len(ids) + 1)
        assert self.state is not None
        restore(self.state, snap)
        self.ids = [int(i) for i in ids]

    def before_step(self, step: int) -> None:
        """Called before each decode step (a hook for tests that time a fault)."""

    # ---- generating --------------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int] = (), params: GenerationParams | None = None,
                 **kw: Any) -> Generation:
        """Continue the sequence with ``prompt`` (text or ids) and generate; see the module."""
        for _ in self.steps(self.encode(prompt), params_from(params, kw)):
            pass
        assert self.last is not None
        return self.last

    def stream(self, prompt: str | Sequence[int] = (), params: GenerationParams | None = None,
               **kw: Any) -> Iterator[str]:
        """Yield text pieces as tokens arrive (never half a UTF-8 character)."""
        for _, piece in self.steps(self.encode(prompt), params_from(params, kw)):
            if piece:
                yield piece

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            tok = self.engine.tokenizer
            if tok is None:
                raise UsageError("a text prompt needs a tokenizer: pass tok=DIR (none was found "
                                 "in the model directory), or give ids")
            return tok.encode(prompt)
        ids = [int(i) for i in prompt]
        check_vocab(ids, self.engine.cfg.vocab, "prompt")
        return ids

    def steps(self, prompt_ids: Sequence[int], p: GenerationParams,
              around: PickWrap | None = None, constraint: Constraint | None = None,
              speculator: Speculator | None = None
              ) -> Generator[tuple[Step | None, str], None, None]:
        """The decode loop as a generator of ``(step, text piece)``; fills :attr:`last`.

        The last item may be ``(None, text)``: text held back until the end (an incomplete
        character, or the start of a stop string that never completed). ``around`` wraps the
        pick (greedy or the sampler): the wrapper is handed each step's exact logits, in step
        order, and returns the id chosen (the server's penalties and logprobs); speculative
        verify rows are picked in the same order, so a wrapper sees what plain decoding
        shows it, plus at most the rows of one pass past a stop string. ``constraint``
        restricts the choice to the ids it allows (inside ``around``) and forces ids (module
        docstring). ``speculator`` replaces the one ``p.spec`` makes (tests drive its drafts)."""
        eng = self.engine
        if constraint is not None and p.spec != "off":
            raise UsageError(f"a constrained generation decodes one token a pass: set "
                             f"{param('spec')} off (got {p.spec!r})")
        prompt = [int(i) for i in prompt_ids]
        if not prompt and not self.ids:
            raise UsageError("the prompt is empty: nothing to feed the model")
        if len(self.ids) + len(prompt) > MAX_PROMPT:
            raise UsageError(f"the sequence would hold {len(self.ids) + len(prompt)} ids; the "
                             f"limit is {MAX_PROMPT}")
        for sid in p.stop_ids:
            check_vocab([sid], eng.cfg.vocab, param("stop_ids"))
        if self.incremental and not prompt and not self.pending and (
                self.primed is None or p.spec != "off" or speculator is not None):
            raise UsageError("nothing to feed: the session's ids are all consumed; give a prompt")
        gen = Generation(prompt_ids=prompt, sampler=make_sampler(p))
        make, fills = p.budget(len(self.ids) + len(prompt))
        gen.limit = make
        if make != p.max_tokens:  # -1 or over the context: the loops make ``make`` at most
            p = p.model_copy(update={"max_tokens": make})
        self._reserve(len(self.ids) + len(prompt) + max(make, 1))
        self.last = gen
        self.ids = self.ids + prompt
        pick: Callable[[np.ndarray], int] = gen.sampler or argmax
        if constraint is not None:
            pick = masked(pick, constraint)
        if around is not None:
            pick = around(pick)
        spec = speculator if speculator is not None else (
            Speculator(eng.model, SpecOptions(p.spec, p.spec_width, p.spec_ngram))
            if p.spec != "off" else None)
        if constraint is not None and spec is not None:
            raise UsageError("a constrained generation decodes one token a pass: no drafts")
        text = TextStream(eng.tokenizer, p.stop)
        stops, eos = set(p.stop_ids), set() if p.ignore_eos else eng.eos_ids
        with eng.model.scheduler.running():  # batched with the other running sequences
            try:
                if p.max_tokens == 0:
                    t0 = time.perf_counter()
                    gen.first_logits = self._prefill(gen)
                    gen.prefill_seconds = time.perf_counter() - t0
                    gen.stop_reason = "prefill"
                    return
                if spec is not None:
                    yield from self._speculate(gen, p, spec, pick, text, stops, eos)
                else:
                    yield from self._plain(gen, p, pick, text, stops, eos, constraint)
                if fills and gen.stop_reason == "length" and len(gen.ids) >= make:
                    gen.stop_reason = "context"
                tail = text.finish()
                if tail:
                    yield None, tail
            except KeyboardInterrupt:
                gen.mark_interrupted()
                raise
            finally:
                gen.text = text.text if text.enabled else None

    def prefill(self, prompt_ids: Sequence[int],
                on_rows: Callable[[int, np.ndarray], None] | None = None) -> None:
        """Feed ``prompt_ids`` after the session's ids without generating: the state then
        holds every id, none pending (incremental sessions only). ``on_rows(pos, rows)`` is
        handed the logits of every position fed, in passes of at most :data:`ROWS_PASS` ids
        (``rows[j]`` is position ``pos + j``'s, predicting the id after it): each row the
        bytes a one-pass run gives, as for any split of a sequence into calls."""
        if not self.incremental:
            raise UsageError("prefill needs incremental decoding (full recompute carries no state)")
        prompt = [int(i) for i in prompt_ids]
        check_vocab(prompt, self.engine.cfg.vocab, "prompt")
        if len(self.ids) + len(prompt) > MAX_PROMPT:
            raise UsageError(f"the sequence would hold {len(self.ids) + len(prompt)} ids; the "
                             f"limit is {MAX_PROMPT}")
        self._reserve(len(self.ids) + len(prompt) + 1)
        self.ids = self.ids + prompt
        state = self.state
        assert state is not None
        model = self.engine.model
        try:
            with model.scheduler.running():
                while state.pos < len(self.ids):
                    start = state.pos
                    end = len(self.ids) if on_rows is None else start + ROWS_PASS
                    rows = model.forward(np.array(self.ids[start:end]), state,
                                         all_logits=on_rows is not None, cancel=self.cancel)
                    if on_rows is not None:
                        on_rows(start, rows)
        except BaseException:
            self.state = None  # as _forward: the next call prefills the session's ids again
            raise

    def _plain(self, gen: Generation, p: GenerationParams, pick: Callable[[np.ndarray], int],
               text: TextStream, stops: set[int], eos: set[int],
               constraint: Constraint | None = None
               ) -> Generator[tuple[Step | None, str], None, None]:
        """One forward pass per step; with a ``constraint``, the ids it forces after a pick
        follow as steps of their own (their pass's seconds shared among them), fed together
        with the next pass."""
        g = 0
        while g < p.max_tokens:
            self.before_step(g)
            t0 = time.perf_counter()
            logits = self._prefill(gen) if g == 0 else self._forward()
            if g == 0:
                gen.first_logits = logits
            toks = [pick(logits)]
            if constraint is not None:
                toks += take_forced(constraint, p.max_tokens - g - 1)
            seconds = time.perf_counter() - t0
            for tok in toks:
                self.ids.append(tok)
                gen.ids.append(tok)
                step = Step(g, tok, seconds / len(toks))
                g += 1
                gen.steps.append(step)
                piece = "" if tok in eos and tok not in stops else text.push(tok)
                gen.text = text.text if text.enabled else None
                yield step, piece
                if tok in stops:
                    gen.stopped_at, gen.stop_reason = tok, "stop_id"
                    return
                if tok in eos:
                    gen.stopped_at, gen.stop_reason = tok, "eos"
                    return
                if text.hit is not None:
                    gen.stop_reason = "stop"
                    return
            if constraint is not None and constraint.done:
                gen.stop_reason = "stop"
                return

    def _speculate(self, gen: Generation, p: GenerationParams, spec: Speculator,
                   pick: Callable[[np.ndarray], int], text: TextStream, stops: set[int],
                   eos: set[int]) -> Generator[tuple[Step | None, str], None, None]:
        """Draft, verify in one pass, emit what agrees (docs/speculative.md); the same ids,
        steps and stops as :meth:`_plain`, one pass per agreeing run of tokens."""
        g = 0
        gen.spec = spec.stats
        while g < p.max_tokens:
            self.before_step(g)
            t0 = time.perf_counter()
            sure = len(self.ids) - self.state.pos if self.state is not None else len(self.ids)
            drafts = spec.propose(self.ids, p.max_tokens - g, sure)
            if g == 0:  # the first pass is the prefill (with drafts after it)
                rows = self._prefill(gen, partial(self._verify, spec, drafts))
                gen.first_logits = rows[0]
            else:
                rows = self._verify(spec, drafts)
            toks: list[int] = []
            for i, row in enumerate(rows):
                tok = pick(row)
                toks.append(tok)
                if (tok in stops or tok in eos or g + len(toks) >= p.max_tokens
                        or i >= len(drafts) or tok != drafts[i]):
                    break
            seconds = time.perf_counter() - t0
            kept, done = 0, False
            try:
                for tok in toks:
                    self.ids.append(tok)
                    gen.ids.append(tok)
                    kept += 1
                    step = Step(g, tok, seconds / len(toks))
                    g += 1
                    gen.steps.append(step)
                    piece = "" if tok in eos and tok not in stops else text.push(tok)
                    gen.text = text.text if text.enabled else None
                    yield step, piece
                    if tok in stops:
                        gen.stopped_at, gen.stop_reason, done = tok, "stop_id", True
                    elif tok in eos:
                        gen.stopped_at, gen.stop_reason, done = tok, "eos", True
                    elif text.hit is not None:
                        gen.stop_reason, done = "stop", True
                    if done:
                        break
            finally:
                self._settle(spec, kept)
                spec.record(g - kept, drafts, toks[:kept], seconds)
            if done:
                break

    def _verify(self, spec: Speculator, drafts: list[int]) -> np.ndarray:
        try:
            return spec.verify(self.ids, self.state if self.incremental else None, drafts)
        except BaseException:
            self.state = None  # as _forward: the next call prefills the session's ids again
            raise

    def _settle(self, spec: Speculator, kept: int) -> None:
        """Keep the state of the emitted tokens (the last one stays pending)."""
        if self.state is None:
            return
        if kept == 0:  # cut short before a token was emitted: prefill again next time
            self.state = None
            return
        spec.settle(self.state, len(self.ids) - 1)

    def _reserve(self, need: int) -> None:
        """Room for ``need`` positions in the carried state (the KV cache is checked first)."""
        if not self.incremental:
            return
        cfg = self.engine.cfg
        n_layers = self.engine.model.n_layers
        if self.state is None:
            check_kv(cfg, need + 1, n_layers=n_layers)
            self.state = SequenceState(cfg, need)
        elif self.state.capacity < need:
            check_kv(cfg, need + 1, n_layers=n_layers)
            grow_state(self.state, need)

    def _prefill(self, gen: Generation,
                 run: Callable[[], np.ndarray] | None = None) -> np.ndarray:
        """The call's first forward pass (``run``, by default :meth:`_forward`), with its
        figures recorded in ``gen``: the ids it fed, its chunks, its routed-expert bytes."""
        stats = self.engine.experts.stats
        before = stats.bytes_read
        gen.prefill_ids = len(self.ids) - (self.state.pos if self.incremental and self.state else 0)
        primed, self.primed = self.primed, None
        if primed is not None and run is None and gen.prefill_ids == 0:
            gen.prefill_chunks = 0  # the kept state's own logits: no pass
            return primed
        logits = run() if run is not None else self._forward()
        gen.prefill_chunks = self.engine.model.chunks_last
        gen.prefill_expert_bytes = stats.bytes_read - before
        if (self.after_prefill is not None and self.state is not None
                and self.state.pos == len(self.ids)):
            self.after_prefill(logits)
        return logits

    def _forward(self) -> np.ndarray:
        model = self.engine.model
        if self.incremental:
            assert self.state is not None
            feed = self.ids[self.state.pos:]
            try:
                return model.forward(np.array(feed), self.state, cancel=self.cancel)[-1]
            except BaseException:
                # some layers' state advanced, others not: drop it; the next call prefills
                # the session's ids again (the same bits as carrying it)
                self.state = None
                raise
        fresh = SequenceState(model.cfg, len(self.ids), shared_kda_slot=model.shared_kda_slot)
        return model.forward(np.array(self.ids), fresh)[-1]

    # ---- saving and loading ------------------------------------------------------------------
    def save(self, path: str | Path) -> int:
        """Write the session to ``path`` atomically; returns the bytes written. A path the
        engine reads (inside MODEL_DIR or the packed trunk, the tokenizer, the config) is
        refused (``OutputError``, exit 3) before anything is written."""
        from k3core.api.outputs import check_output
        from k3core.run.state_file import write_state

        if not self.incremental:
            raise UsageError("saving a session needs incremental decoding (full recompute "
                             "carries no state)")
        check_output(path, "the session file", inputs=self.engine.plan.inputs())
        return write_state(Path(path), self.engine, self.ids, self.state)

    def load(self, path: str | Path) -> None:
        """Replace this session's sequence with the one saved at ``path`` (same model only)."""
        from k3core.run.state_file import read_state

        if not self.incremental:
            raise UsageError("loading a session needs incremental decoding (this engine "
                             "recomputes in full: incremental=False)")
        self.ids, self.state = read_state(Path(path), self.engine)
        self.last = None


def grow_state(state: SequenceState, capacity: int) -> None:
    """Make room for ``capacity`` positions, keeping every cached position's bytes."""
    old = state.capacity
    for layer, kv in list(state.kv.items()):
        changes: dict[str, Any] = {}
        for f in fields(kv):
            a = getattr(kv, f.name)
            if isinstance(a, np.ndarray) and a.ndim and a.shape[0] == old:
                b = np.zeros((capacity, *a.shape[1:]), dtype=a.dtype)
                b[:old] = a
                changes[f.name] = b
        state.kv[layer] = replace(kv, **changes)
    state.capacity = capacity
