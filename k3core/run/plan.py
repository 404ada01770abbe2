"""The plan: a request resolved against the model, every budget checked before allocation.

The second stage of request -> plan -> engine -> session -> report. :func:`plan_engine`
reads the model's config (small), resolves the preset and the settings (flag > environment
> preset > default, each with its source), resolves each plugin once through the registry
(an ``auto`` choice is picked here and only here: :class:`Plugins`), finds the tokenizer
(``tok``, ``$K3_TOK_FILES``, else MODEL_DIR's own files) and sums the memory plan for the
positions the request asks the engine to hold: trunk, tables, expert cache, recurrent
state, buffers and KV cache against the memory available. Nothing large has been allocated
yet; :meth:`EnginePlan.check` refuses a plan that does not fit. :func:`plan_run` is the
plan of one ``k3 run``: the engine's, plus the prompt's ids and the generation
(:class:`RunPlan`), the memory summed for them.

Both plans print (:meth:`lines`) and serialise (:meth:`to_json`); ``--out`` records them.
:func:`k3core.run.engine.open_engine` makes the plan and binds it; nothing else does.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from k3core.api.errors import UsageError, param
from k3core.api.specs import Kind
from k3core.api.units import ALIGN, gb_bytes, human
from k3core.experts.setup import CacheOptions
from k3core.model.config import ModelConfig, load_config
from k3core.model.sizes import sizes_from_config
from k3core.plugins.registry import get_registry
from k3core.run.memory_plan import MemoryPlan, MemoryRequest, check_kv, plan_memory
from k3core.run.model_dir import config_path
from k3core.run.preset import Preset
from k3core.run.presets import check_plugins, load_preset
from k3core.run.prompt import PromptSpec, check_vocab, find_tokenizer, load_tokenizer, prompt_ids
from k3core.run.request import UNTIL_END, EngineRequest, RunRequest
from k3core.run.settings import MergedSettings, merge_settings
from k3core.tokenizer.encoding import Tokenizer


@dataclass(frozen=True, kw_only=True)
class Plugins:
    """The plugin of each kind the plan resolved, by name: an ``auto`` choice is picked
    once, here; :func:`k3core.run.binding.bind` creates each by that name. ``notes`` holds
    what ``auto`` picked, by kind (``auto picked kernel backend 'numpy'``)."""

    kernel: str
    storage: str
    cache: str
    notes: dict[Kind, str] = field(default_factory=dict)


@dataclass(kw_only=True)
class EnginePlan:
    """Everything needed to open an engine, resolved and checked (see the module)."""

    request: EngineRequest
    model_dir: Path
    cfg: ModelConfig
    merged: MergedSettings
    plugins: Plugins
    preset: Preset | None = None
    tokenizer: Tokenizer | None = None
    tok_dir: Path | None = None
    memory: MemoryPlan | None = None
    #: where the expert cache records its trace (``k3 run --dump-cache-trace``)
    trace_dir: Path | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def incremental(self) -> bool:
        return bool(self.merged.settings.incremental)

    @property
    def streamed(self) -> bool:
        return self.request.trunk is not None

    @property
    def n_layers(self) -> int:
        return self.request.layers or self.cfg.n_layers

    @property
    def has_moe(self) -> bool:
        """Whether a layer run has routed experts (else there is no expert cache)."""
        return any(not self.cfg.is_dense(L) for L in range(self.n_layers))

    @property
    def trunk_gb(self) -> float | None:
        """The trunk budget: ``trunk_gb`` or the preset's; without either, every layer."""
        s, r = self.merged.settings, self.request
        return s.trunk_gb if self.streamed and (r.trunk_gb is not None or self.preset) else None

    @property
    def prefill_chunk(self) -> int | None:
        """Ids per forward pass of a prompt: the memory plan's (``prefill_chunk``, else the
        activations budget's)."""
        return self.memory.prefill_chunk if self.memory is not None else self.request.prefill_chunk

    def plan_memory(self, prompt_len: int, gen: int) -> MemoryPlan:
        """Sum the run's buffers for ``prompt_len`` + ``gen`` positions (and keep the plan)."""
        s = self.merged.settings
        check_kv(self.cfg, prompt_len + gen + 1, n_layers=self.n_layers)  # every mode holds one
        budget = _trunk_budget(self.cfg, self.n_layers, self.trunk_gb) if self.streamed else None
        remote = self.request.remote_experts  # no expert cache here: the workers hold them
        self.memory = plan_memory(self.cfg, MemoryRequest(
            streamed=self.streamed, cache_bytes=0 if remote else gb_bytes(s.cache_gb),
            prompt_len=prompt_len, gen=gen, incremental=self.incremental, n_layers=self.n_layers,
            trunk_budget=budget, ultra=bool(s.ultra_low_memory),
            prefill_chunk=self.request.prefill_chunk, slots=self.request.slots,
            prefix_cache=self.request.prefix_cache_bytes), expert_bytes=0 if remote else None)
        return self.memory

    def check(self) -> None:
        """Refuse (exit 1) a memory plan over 95 % of the memory available."""
        if self.memory is not None:
            self.memory.check()

    def cache_options(self) -> CacheOptions:
        """The expert cache this plan sizes: its budget, policy, readers and trace."""
        s, r = self.merged.settings, self.request
        return CacheOptions(
            cache_gb=s.cache_gb, policy=self.plugins.cache, trace_dir=self.trace_dir,
            readers=s.expert_readers,
            policy_options={"trace": str(r.cache_trace)} if r.cache_trace is not None else {})

    def inputs(self) -> list[tuple[Path | None, str]]:
        """What an engine of this plan reads, which no output may replace: MODEL_DIR, its
        config, the packed trunk, the tokenizer, a preset file, a replayed trace."""
        r = self.request
        origin = self.preset.origin if self.preset is not None else ""
        preset_file = Path(origin) if origin and Path(origin).is_file() else None
        config = config_path(self.model_dir, r.config)  # a link out of MODEL_DIR too
        return [(self.model_dir, "MODEL_DIR"), (config, "--config" if r.config else "the config"),
                (r.trunk, "--trunk"),
                (self.tok_dir, "the tokenizer directory"), (preset_file, "the preset"),
                (r.cache_trace, "--cache-trace")]

    def lines(self, verbose: bool = False, short: bool = False) -> list[str]:
        """The report's plan block: model, preset, settings and their sources, memory.
        ``short`` (a terminal): no tokenizer or setting lines, the memory plan in one line."""
        from k3core import __version__

        out = [f"k3 {__version__}: Kimi K3, released checkpoint layout", self.cfg.describe(),
               f"model  : {self.model_dir}"]
        if self.tok_dir is not None and not short:
            out.append(f"tokenizer: {self.tok_dir}")
        if self.preset is not None:
            p = self.preset
            out.append(f"preset : {p.name} (trunk {p.trunk_gb:.2f} GB / expert cache "
                       f"{p.cache_gb:.2f} GB)" + ("" if self.streamed else
                       "; without --trunk the trunk is resident, so only the cache budget applies"))
        d = self.merged.settings.model_dump()
        for k, src in self.merged.sources.items():
            if (src != "default" or verbose) and not short:
                out.append(f"setting: {k} = {d[k]}  ({src})")
        if self.request.layers is not None:
            out.append(f"NOTE: only the first {self.request.layers} of {self.cfg.n_layers} layers "
                       "run; this is not the full model")
        if self.memory is not None and short:
            m = self.memory
            out.append(f"memory : {human(m.total)} planned of {human(m.available)} available "
                       "(-v: the memory plan)")
        elif self.memory is not None:
            out += self.memory.lines()
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def to_json(self) -> dict[str, Any]:
        d = self.merged.settings.model_dump(mode="json")
        plan: dict[str, Any] = {
            "model_dir": str(self.model_dir),
            "tokenizer": None if self.tok_dir is None else str(self.tok_dir),
            "preset": None if self.preset is None else self.preset.name,
            "settings": {k: {"value": d[k], "source": src} for k, src in self.merged.sources.items()},
            "incremental": self.incremental, "streamed": self.streamed, "layers": self.n_layers,
            "storage": self.plugins.storage, "notes": list(self.notes),
        }
        if self.memory is not None:
            m = self.memory
            plan["memory"] = {"rows": dict(m.rows()), "total": m.total, "available": m.available,
                              "positions": m.positions, "cache_slots": m.cache_slots}
        return plan


def read_model_config(model_dir: Path, config: Path | None = None,
                      layers: int | None = None) -> ModelConfig:
    """The model's config (``config``, else MODEL_DIR's), and ``layers`` checked against it."""
    cfg = load_config(config_path(model_dir, config))
    if layers is not None and not 1 <= layers <= cfg.n_layers:
        raise UsageError(f"{param('layers')} must be in 1..{cfg.n_layers}, got {layers}")
    return cfg


def plan_engine(req: EngineRequest) -> EnginePlan:
    """The plan of an engine that holds ``req.positions`` ids: resolved against the model
    (config, preset, settings, plugins, tokenizer) and its memory summed."""
    plan = _resolve(req, req.needs_tokenizer)
    plan.plan_memory(prompt_len=req.positions, gen=0)
    return plan


def _resolve(req: EngineRequest, needs_tokenizer: bool) -> EnginePlan:
    """Resolve ``req`` against the model: config, preset, settings, plugins, tokenizer."""
    given_as = req.given_as
    model_dir = req.model_dir or merge_settings(None, None, None, req.flags()).settings.model_dir
    if model_dir is None:
        raise UsageError(f"{param('model_dir')} is required (or set K3_MODEL_DIR)")
    model_dir = Path(model_dir)
    cfg = read_model_config(model_dir, req.config, req.layers)
    if not model_dir.is_dir():
        raise UsageError(f"model directory {model_dir} does not exist")
    preset = load_preset(req.preset, cfg=cfg) if req.preset else None
    merged = merge_settings(None, preset, None, req.flags(), given_as)
    s = merged.settings
    if preset is not None:
        for problem in check_plugins(preset):
            raise UsageError(f"preset {preset.name}: {problem}")
    notes: list[str] = []
    plugins = _plugins(s.backend, s.storage, s.cache_policy or "auto", model_dir)
    if s.ultra_low_memory and req.trunk is None:
        raise UsageError(f"{param('ultra_low_memory')} needs {param('trunk')} DIR (pack one "
                         "with `k3 pack-trunk MODEL_DIR TRUNK_DIR`)")
    tok = load_tokenizer(s.tok, cfg.vocab, required=needs_tokenizer, model_dir=model_dir)
    tok_dir = (Path(s.tok) if s.tok is not None else find_tokenizer(model_dir)) if tok else None
    return EnginePlan(request=req, model_dir=model_dir, cfg=cfg, merged=merged, plugins=plugins,
                      preset=preset, tokenizer=tok, tok_dir=tok_dir, notes=notes)


def _plugins(kernel: str, storage: str, cache: str, model_dir: Path) -> Plugins:
    """Resolve each kind once (an explicit name never falls back; ``auto`` picks here, a
    storage backend that can read ``model_dir``: the storage contract's ``probe_path``)."""
    reg = get_registry()
    names: dict[Kind, str] = {}
    notes: dict[Kind, str] = {}
    asked: tuple[tuple[Kind, str], ...] = (("kernel", kernel), ("storage", storage),
                                           ("cache", cache))
    for kind, name in asked:
        spec, note = reg.resolve(kind, name, for_path=model_dir if kind == "storage" else None)
        names[kind] = spec.name
        if note:
            notes[kind] = note
        if kind == "kernel":
            spec.load()  # import it now, so the plan's baseline (this process's RSS) includes it
    return Plugins(kernel=names["kernel"], storage=names["storage"], cache=names["cache"],
                   notes=notes)


@dataclass(kw_only=True)
class RunPlan(EnginePlan):
    """One command-line run: the engine's plan, the prompt's ids, the generation."""

    run: RunRequest
    prompt_ids: list[int]
    prompt_how: str

    def lines(self, verbose: bool = False, short: bool = False) -> list[str]:
        out = super().lines(verbose, short)
        mode = " (incremental)" if self.incremental else " (full recompute)"
        out.insert(3, f"prompt : {self.prompt_how}; {self.generating()}{mode}")
        return out

    def generating(self) -> str:
        """What ``--gen`` (and ``--context``) ask for, in words."""
        g = self.run.generation
        make, fills = g.budget(len(self.prompt_ids))
        if g.max_tokens == UNTIL_END:
            return (f"generating until the end of sequence or the context is full (at most "
                    f"{make}: {len(self.prompt_ids) + make} positions)")
        if fills:
            return f"generating {g.max_tokens}, at most {make} (the context holds {g.context})"
        return f"generating {g.max_tokens}"

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "prompt_ids": self.prompt_ids, "prompt": self.prompt_how}


def plan_run(req: RunRequest) -> RunPlan:
    """The whole plan of one ``k3 run``; raises before anything large is allocated."""
    req.check()
    # a run's values are the command line's: its sources say "flag --threads"
    eng = _resolve(req.engine.model_copy(update={"given_as": "flag"}), req.prompt.needs_tokenizer)
    req.outputs.check(inputs=(*eng.inputs(), (req.prompt.file, "--prompt-file")))
    for sid in req.generation.stop_ids:
        check_vocab([sid], eng.cfg.vocab, param("stop_ids"))
    tok = eng.tokenizer
    bos = tok.special_token_id("[BOS]") if tok is not None and "[BOS]" in tok.special_tokens else None
    bos = bos if bos is not None else eng.cfg.bos_token_id
    p = req.prompt
    ids_text = ",".join(map(str, p.ids)) if isinstance(p.ids, list) else p.ids
    ids, how = prompt_ids(PromptSpec(text=p.text, file=p.file, ids=ids_text, bos=p.bos), tok,
                          eng.cfg.vocab, bos)
    if req.outputs.load_state is not None and not eng.incremental:
        raise UsageError("--load-state needs incremental decoding (drop --full-recompute)")
    plan = RunPlan(**{f.name: getattr(eng, f.name) for f in fields(EnginePlan)}, run=req,
                   prompt_ids=ids, prompt_how=how)
    plan.trace_dir = req.outputs.dump_cache_trace
    plan.plan_memory(len(ids), req.generation.budget(len(ids))[0])
    return plan


def _trunk_budget(cfg: ModelConfig, n_layers: int, trunk_gb: float | None) -> int:
    """Bytes the streamed trunk may hold: ``--trunk-gb``, or (without it) every layer pinned."""
    if trunk_gb is not None:
        return int(trunk_gb * 1e9)
    return sizes_from_config(cfg).first(n_layers).trunk_bytes + ALIGN * n_layers
