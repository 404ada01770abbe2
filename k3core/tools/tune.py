"""``k3 tune MODEL [--trunk DIR]``: the fastest settings on this machine that keep the ids.

Budgets first: the trunk and expert-cache budgets every trial runs with, and the preset
keeps, are sized to the model and to this machine (:mod:`k3core.tools.tune_budgets`): never
more than the model can use nor more than the memory available.

A reference run then decodes the prompt with ``--backend numpy`` (the bits every backend
must match). Each knob of :data:`KNOBS` is tried in turn, the others held at the best kept so
far (a coordinate search, not every combination). A knob's options are its **baseline**
(the knob left at the engine's default; when candidates are named without the default, the
first named) and its candidates. Every option opens the engine the way ``k3 run`` does
(same budgets, storage and trunk), decodes the same ids, and is timed by its median decode
step after the first (the first also prefills); each option runs ``repeat`` times, the runs
of all options alternating in rotated order. A candidate replaces the baseline only when it
wins beyond the noise of those repeated runs (:func:`k3core.tools.tune_noise.pick`: its
worst run faster than the baseline's best); otherwise the baseline is kept and the report
says "no candidate won beyond noise". A candidate whose ids differ from the reference is
**refused** and never kept, whatever its speed; the report says so. The result is written
as a user preset (``$K3_CONFIG_DIR/presets/NAME.yaml``, see
:func:`k3core.run.presets.user_preset_dir`) that ``k3 presets show NAME`` lists and ``k3 run
--preset NAME`` uses; an existing preset of that name (a user file, or a shipped preset it
would shadow) is kept unless ``force``.

Adding a knob is one :class:`Knob` entry: a settings key that ``k3 run`` takes as a flag, a
preset carries, and its candidate values. Speculative decoding (``spec``, then
``spec_width`` once it is on) is a generation parameter, not an engine setting: the trial
passes it to ``generate``, and the preset carries it as the default of runs that do not give
``--spec``/``--spec-width``.

Hooks for a progress reporter: ``progress(message)`` hears what is being done;
``on_run(done, planned)`` is called after every timed run with the runs done and the runs
planned so far (the plan grows by a knob's runs when a knob that depends on an earlier
choice, ``spec_width``, turns out to be tried).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from k3core.api.errors import K3Error, OutputError, UsageError
from k3core.api.outputs import check_output, refuse_inputs, write_bytes_atomic
from k3core.model.config import load_config
from k3core.plugins.registry import get_registry
from k3core.run.engine import open_engine
from k3core.run.preset import AUTO, NAME_PATTERN, SHIPPED
from k3core.run.presets import parse_preset, user_preset_dir
from k3core.run.request import EngineRequest, build
from k3core.run.settings import DEFAULTS
from k3core.tools.tune_budgets import Budgets, model_sizes, size_budgets
from k3core.tools.tune_noise import DEFAULT_RUNS, MAX_RUNS, MIN_RUNS, Timing, pick, rotated

DEFAULT_IDS = (3, 7, 11, 5, 9)
DEFAULT_GEN = 6
REFERENCE_BACKEND = "numpy"

Progress = Callable[[str], None]
OnRun = Callable[[int, int], None]


@dataclass(kw_only=True)
class TuneOptions:
    """What ``k3 tune`` was asked for (``None``: not given, sized or the engine's default)."""

    model_dir: Path
    trunk: Path | None = None
    trunk_gb: float | None = None  # None: sized to the model and the machine
    cache_gb: float | None = None  # None: sized to the model and the machine
    storage: str | None = None
    backends: Sequence[str] = ()  # candidates; empty: every available kernel backend
    threads: Sequence[int] = ()  # candidates; empty: 1, 2, 4, ... up to the CPU count
    expert_readers: Sequence[int] = ()  # candidates; empty: 1, 2, 4, 8
    lookahead: Sequence[str] = ()  # candidates; empty: on (beside the default, off)
    spec: Sequence[str] = ()  # candidates; empty: ngram (beside the default, off)
    spec_width: Sequence[int] = ()  # candidates once spec is on; empty: 2, 4, 8
    name: str = "tuned"
    ids: Sequence[int] = DEFAULT_IDS
    gen: int = DEFAULT_GEN
    repeat: int = DEFAULT_RUNS  # timed runs per option
    force: bool = False


@dataclass(frozen=True)
class Knob:
    """One setting ``k3 tune`` varies: its settings key, the candidates the user named, and
    the candidates tried when none are named."""

    key: str
    named: Callable[[TuneOptions], Sequence[Any]]
    default_values: Callable[[TuneOptions], list[Any]]
    #: tried only when the best setting so far satisfies this (e.g. a width once spec is on)
    when: Callable[[dict[str, Any]], bool] = lambda best: True
    #: what the engine's default resolves to here (the same run as the default), if known
    resolves: Callable[[], Any] = lambda: None

    def values(self, o: TuneOptions) -> list[Any]:
        """The candidate values: those named, else the defaults."""
        return list(dict.fromkeys(self.named(o))) or self.default_values(o)


def check_engine_values(given: Mapping[str, Any]) -> None:
    """Refuse what a run would refuse among the engine values ``k3 tune`` was given: each
    single value, and each candidate of a list (``EngineRequest.check_value``)."""
    for name, value in given.items():
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if v is not None:
                EngineRequest.check_value(name, v)


def thread_counts(n: int | None = None) -> list[int]:
    """1, 2, 4, ... below the CPU count, and the CPU count itself."""
    top = max(1, n or os.cpu_count() or 1)
    out, t = [], 1
    while t < top:
        out.append(t)
        t *= 2
    return [*out, top]


def _available_backends(o: TuneOptions) -> list[str]:
    reg = get_registry()
    return [n for n in reg.names("kernel") if n != "timed" and reg.probe("kernel", n).ok]


def _auto_backend() -> str:
    spec, _ = get_registry().resolve("kernel", AUTO)
    return str(spec.name)


#: the knobs, tried in this order (each at the best of those before it)
KNOBS: tuple[Knob, ...] = (
    Knob("backend", lambda o: o.backends, _available_backends, resolves=_auto_backend),
    Knob("threads", lambda o: o.threads, lambda o: thread_counts()),
    Knob("expert_readers", lambda o: o.expert_readers, lambda o: [1, 2, 4, 8]),
    Knob("lookahead", lambda o: o.lookahead, lambda o: ["off", "on"]),
    Knob("spec", lambda o: o.spec, lambda o: ["off", "ngram"]),
    Knob("spec_width", lambda o: o.spec_width, lambda o: [2, 4, 8],
         when=lambda best: best.get("spec", "off") != "off"),
)
#: knobs that are generation parameters (a preset carries them; the engine does not)
GENERATION_KEYS = ("spec", "spec_width")
#: a candidate equal to its default is the same run as leaving it out
_DEFAULT: dict[str, Any] = {**DEFAULTS, "spec": "off", "spec_width": 4}


def knob_options(knob: Knob, o: TuneOptions) -> tuple[list[Any], Any]:
    """``(options, baseline)`` of a knob; ``None`` stands for "left at the engine's default".

    Not named: the default (``None``) and every candidate that is not the same run as it
    (the default's value, or what it resolves to here: ``auto``'s backend), baseline the
    default. Named: those values (a value equal to the default becomes ``None``), the
    baseline the default when named, else the first named value."""
    default = _DEFAULT.get(knob.key)
    values = knob.values(o)
    if not list(knob.named(o)):
        same = {default, knob.resolves()}
        return [None, *(v for v in values if v not in same)], None
    if default in values:
        return [None, *(v for v in values if v != default)], None
    return values, values[0]


@dataclass
class Trial:
    setting: dict[str, Any]
    seconds_per_token: float | None = None  # the median of ``runs``
    ids: list[int] = field(default_factory=list)
    kept: bool = False  # ids match the reference
    note: str = ""
    runs: list[float] = field(default_factory=list)  # seconds per token, one per run
    knob: str = ""  # the knob whose options this trial is one of ("" for the reference)

    @property
    def timing(self) -> Timing | None:
        return Timing(tuple(self.runs)) if self.runs else None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        t = self.timing
        d.update(t.to_json() if t is not None else
                 {"median": None, "best": None, "worst": None, "spread": None})
        return d


@dataclass(frozen=True)
class Decision:
    """What one knob kept, and whether it won beyond noise."""

    knob: str
    kept: dict[str, Any]
    won: bool
    message: str


@dataclass
class TuneResult:
    reference: Trial
    trials: list[Trial]
    best: dict[str, Any]
    seconds_per_token: float
    preset_path: Path
    preset_text: str
    budgets: Budgets | None = None
    decisions: list[Decision] = field(default_factory=list)
    repeat: int = DEFAULT_RUNS

    def to_json(self) -> dict[str, Any]:
        return {"preset": self.best.get("name"), "preset_path": str(self.preset_path),
                "setting": {k: v for k, v in self.best.items() if k != "name"},
                "seconds_per_token": self.seconds_per_token,
                "budgets": self.budgets.to_json() if self.budgets is not None else None,
                "repeat": self.repeat,
                "reference": self.reference.to_json(),
                "trials": [t.to_json() for t in self.trials],
                "decisions": [asdict(d) for d in self.decisions],
                "refused": [t.setting for t in self.trials if not t.kept]}

    def table_lines(self) -> list[str]:
        """The timings, knob by knob: median and spread of every option, and the verdict."""
        out = [f"reference (--backend {REFERENCE_BACKEND}): ids {_ids(self.reference.ids)}"]
        if self.budgets is not None:
            out.append(self.budgets.line())
            out += [f"  note: {n}" for n in self.budgets.notes]
        for d in self.decisions:
            out.append(f"{d.knob} ({self.repeat} alternating runs each):")
            for t in self.trials:
                if t.knob != d.knob:
                    continue
                timing = t.timing
                label = _label(t)
                if t.kept and timing is not None:
                    out.append(f"  {label}: {timing.describe()}")
                else:
                    out.append(f"  {label}: REFUSED ({t.note})")
            out.append(f"  -> {d.message}")
        return out

    def summary_lines(self) -> list[str]:
        best = _what({k: v for k, v in self.best.items() if k != "name"})
        return [f"best: {best} at {self.seconds_per_token:.4f} s/token median (ids match the "
                "reference)",
                f"wrote preset {self.best['name']!r} to {self.preset_path} "
                f"(k3 run --preset {self.best['name']})"]

    def lines(self) -> list[str]:
        return self.table_lines() + self.summary_lines()


def _ids(ids: Sequence[int]) -> str:
    return ",".join(map(str, ids))


def _what(setting: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in setting.items()) or "defaults"


def _label(t: Trial) -> str:
    """A trial as its knob's option: ``threads=2``, or the default, after the settings held."""
    if t.knob in t.setting:
        return _what(t.setting)
    held = _what(t.setting) + " " if t.setting else ""
    return held + _option(t.knob, None)


def check_name(o: TuneOptions) -> Path:
    """The preset file ``tune`` will write; refused before any run (exit 2, or exit 3 when it
    would replace a preset without ``force``)."""
    import re

    if not re.fullmatch(NAME_PATTERN, o.name) or o.name == AUTO:
        raise UsageError(f"--name {o.name!r}: a preset name is 1-32 of a-z, 0-9, '-', '_' "
                         "(starting with a letter or digit), and not 'auto'")
    path = user_preset_dir() / f"{o.name}.yaml"
    if not o.force:
        if path.exists():
            raise OutputError(f"preset {o.name!r} already exists at {path}; refusing to replace "
                              "it (--force replaces it, --name picks another)")
        if o.name in SHIPPED:
            raise OutputError(f"preset {o.name!r} is shipped with k3; a user preset of that name "
                              "would shadow it (--force does, --name picks another)")
    if path.parent.exists() and not path.parent.is_dir():
        raise OutputError(f"cannot write preset {path}: {path.parent} is not a directory")
    refuse_inputs(path, "preset", _reads(o))
    return path


def _reads(o: TuneOptions) -> list[tuple[Any, str]]:
    """What the trials read, which the preset may not replace."""
    return [(o.model_dir, "MODEL_DIR"), (o.trunk, "--trunk")]


def run_trial(o: TuneOptions, setting: dict[str, Any]) -> Trial:
    """Open the engine with ``setting``, decode ``o.ids`` for ``o.gen`` tokens, time it once."""
    engine_keys = {k: v for k, v in setting.items() if k not in GENERATION_KEYS}
    gen_keys = {k: v for k, v in setting.items() if k in GENERATION_KEYS}
    # the trunk budget applies to a streamed trunk only (a resident one is the whole trunk)
    trunk_gb = o.trunk_gb if o.trunk is not None else None
    fields: dict[str, Any] = {"model_dir": o.model_dir, "trunk": o.trunk, "trunk_gb": trunk_gb,
                              "cache_gb": o.cache_gb, "storage": o.storage, **engine_keys}
    req = build(EngineRequest, {**{k: v for k, v in fields.items() if v is not None},
                                "positions": len(o.ids) + o.gen})
    with open_engine(req) as eng:
        t0 = time.perf_counter()
        gen = eng.generate(list(o.ids), max_tokens=o.gen, ignore_eos=True, **gen_keys)
        wall = time.perf_counter() - t0
    steps = [s.seconds for s in gen.steps[1:]]
    spt = statistics.median(steps) if steps else wall / max(1, len(gen.ids))
    return Trial(dict(setting), spt, list(gen.ids), runs=[spt])


class _Runs:
    """Counts timed runs for the ``on_run`` hook."""

    def __init__(self, on_run: OnRun | None) -> None:
        self.done, self.planned, self.on_run = 0, 0, on_run

    def plan(self, n: int) -> None:
        self.planned += n

    def ran(self) -> None:
        self.done += 1
        if self.on_run is not None:
            self.on_run(self.done, max(self.planned, self.done))


def tune(o: TuneOptions, progress: Progress | None = None,
         on_run: OnRun | None = None) -> TuneResult:
    """Size the budgets, search :data:`KNOBS` keeping only candidates whose ids match and
    that win beyond noise, write the preset."""
    if o.gen < 2:
        raise UsageError(f"--gen must be at least 2 (the first step also prefills), got {o.gen}")
    if not MIN_RUNS <= o.repeat <= MAX_RUNS:
        raise UsageError(f"--repeat must be in {MIN_RUNS}..{MAX_RUNS} (repeated runs are what "
                         f"tell a win from noise), got {o.repeat}")
    path = check_name(o)
    say = progress or (lambda s: None)
    cfg = load_config(o.model_dir)
    budgets = size_budgets(cfg, model_sizes(Path(o.model_dir), cfg, o.storage),
                           trunk_gb=o.trunk_gb, cache_gb=o.cache_gb, prompt_len=len(o.ids),
                           gen=o.gen)
    say(budgets.line())
    for note in budgets.notes:
        say(note)
    o = _with_budgets(o, budgets)
    runs = _Runs(on_run)
    runs.plan(1 + o.repeat * sum(len(knob_options(k, o)[0]) for k in KNOBS if k.when({})))
    say(f"reference run: --backend {REFERENCE_BACKEND}")
    ref = run_trial(o, {"backend": REFERENCE_BACKEND, "threads": 1, "lookahead": "off"})
    ref.kept = True
    runs.ran()
    trials: list[Trial] = []
    decisions: list[Decision] = []
    best: dict[str, Any] = {}  # the kept values that differ from the engine's defaults
    chosen: dict[str, Any] = {}  # every knob tried: the value kept (None: the default)
    best_timing: Timing | None = None
    for knob in KNOBS:
        if not knob.when(best):
            continue
        options, baseline = knob_options(knob, o)
        if not knob.when({}):
            runs.plan(o.repeat * len(options))
        decided = _try_knob(o, knob, options, baseline, best, ref, runs, say)
        trials += decided.trials
        if decided.decision is None:
            if knob.key == "backend":
                raise K3Error("k3 tune: no kernel backend decoded the reference's ids; refusing "
                              "to write a preset (see the refused trials above)")
            continue
        decisions.append(decided.decision)
        say(f"{knob.key}: {decided.decision.message}")
        value = decided.value
        chosen[knob.key] = value
        best = {k: v for k, v in best.items() if k != knob.key}
        if value is not None:
            best[knob.key] = value
        best_timing = decided.timing
    assert best_timing is not None
    setting = {k: (v if v is not None else _DEFAULT.get(k)) for k, v in chosen.items()}
    setting = {k: v for k, v in setting.items() if v is not None}
    doc = _preset_doc(o, setting, best_timing)
    text = yaml.safe_dump(doc, sort_keys=False, allow_unicode=False, width=1000)
    parse_preset(text, str(path))  # the file is a valid preset before it is written
    _write_atomic(path, text, _reads(o))
    return TuneResult(ref, trials, {"name": o.name, **setting}, best_timing.median, path, text,
                      budgets, decisions, o.repeat)


def _with_budgets(o: TuneOptions, b: Budgets) -> TuneOptions:
    from dataclasses import replace

    return replace(o, trunk_gb=b.trunk_gb, cache_gb=b.cache_gb)


@dataclass
class _Decided:
    trials: list[Trial]
    decision: Decision | None
    value: Any = None
    timing: Timing | None = None


def _try_knob(o: TuneOptions, knob: Knob, options: list[Any], baseline: Any,
              best: dict[str, Any], ref: Trial, runs: _Runs, say: Progress) -> _Decided:
    """Time every option ``o.repeat`` times, alternating; keep what wins beyond noise."""
    base = {k: v for k, v in best.items() if k != knob.key}
    trials: dict[Any, Trial] = {}
    for v in options:
        setting = base if v is None else {**base, knob.key: v}
        trials.setdefault(v, Trial(dict(setting), kept=True, knob=knob.key))
    order = list(trials)
    for r in range(o.repeat):
        for v in rotated(order, r):
            t = trials[v]
            if not t.kept:
                runs.ran()  # refused or failed: not run again
                continue
            say(f"trying {_what(t.setting)} (run {r + 1} of {o.repeat})")
            try:
                one = run_trial(o, t.setting)
            except K3Error as exc:
                t.kept, t.note = False, f"failed: {exc.message}"
                runs.ran()
                continue
            runs.ran()
            if one.ids != ref.ids:
                t.kept, t.ids = False, one.ids
                t.note = (f"its ids {_ids(one.ids)} differ from the reference's "
                          f"{_ids(ref.ids)}; a setting that changes the ids is never kept")
                continue
            t.ids = one.ids
            t.runs += one.runs
    for t in trials.values():
        if t.kept:
            t.seconds_per_token = statistics.median(t.runs)
        else:
            t.runs = []
    kept = [v for v in order if trials[v].kept]
    if not kept:
        return _Decided(list(trials.values()), None)
    base_v = baseline if baseline in kept else kept[0]
    value, won = pick(base_v, {v: trials[v].runs for v in kept})
    what = _option(knob.key, value)
    if won:
        w, b = trials[value].timing, trials[base_v].timing
        assert w is not None and b is not None
        msg = (f"kept {what}: it won beyond noise (its worst run {w.worst:.4f} s/token beats "
               f"the best run of {_option(knob.key, base_v)}, {b.best:.4f})")
    else:
        msg = f"no candidate won beyond noise; kept {what}"
    decision = Decision(knob.key, dict(trials[value].setting), won, msg)
    return _Decided(list(trials.values()), decision, value, trials[value].timing)


def _option(key: str, v: Any) -> str:
    if v is not None:
        return f"{key}={v}"
    default = _DEFAULT.get(key)
    return f"{key}={default} (default)" if default is not None else f"{key} unset (default)"


def _preset_doc(o: TuneOptions, setting: dict[str, Any], timing: Timing) -> dict[str, Any]:
    assert o.trunk_gb is not None and o.cache_gb is not None
    doc: dict[str, Any] = {
        "name": o.name,
        "description": f"k3 tune on this machine for {Path(o.model_dir).name}"[:200],
        "trunk_gb": float(o.trunk_gb),
        "cache_gb": float(o.cache_gb),
    }
    if o.storage is not None:
        doc["storage"] = o.storage
    doc.update(setting)
    doc["notes"] = (f"measured {timing.median:.4f} s/token (median of {len(timing.runs)} runs, "
                    f"spread {timing.spread:.4f}; median decode step, {o.gen} tokens); kept "
                    "only what won beyond noise; budgets sized to the model; ids matched "
                    f"--backend {REFERENCE_BACKEND}")[:300]
    return doc


def _write_atomic(path: Path, text: str, reads: list[tuple[Any, str]]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot write preset {path}: {exc.strerror or exc}") from None
    check_output(path, "preset", inputs=reads)
    write_bytes_atomic(path, text.encode("utf-8"), "preset")
