"""``k3 tune MODEL [--trunk DIR]``: the fastest settings on this machine that keep the ids.

A reference run first decodes the prompt with ``--backend numpy`` (the bits every backend
must match) and the engine's default settings. Then each knob of :data:`KNOBS` is tried in
turn, the others held at the best found so far (a coordinate search, not every
combination): a candidate opens the engine the way ``k3 run`` does (same budgets, storage
and trunk), decodes the same ids, and is timed by its median decode step after the first
(the first also prefills). A candidate whose ids differ from the reference is **refused**
and never kept, whatever its speed; the report says so. The winner is written as a user
preset (``$K3_CONFIG_DIR/presets/NAME.yaml``, see :func:`k3core.run.presets.user_preset_dir`)
that ``k3 presets show NAME`` lists and ``k3 run --preset NAME`` uses; an existing preset of
that name (a user file, or a shipped preset it would shadow) is kept unless ``force``.

Adding a knob is one :class:`Knob` entry: a settings key that ``k3 run`` takes as a flag, a
preset carries, and its candidate values. Speculative decoding (``spec``, then
``spec_width`` once it is on) is a generation parameter, not an engine setting: the trial
passes it to ``generate``, and the preset carries it as the default of runs that do not give
``--spec``/``--spec-width``.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from k3core.api.errors import K3Error, OutputError, UsageError
from k3core.api.filemode import give_new_file_mode
from k3core.plugins.registry import get_registry
from k3core.run.engine import Engine
from k3core.run.plan import plan_engine
from k3core.run.preset import AUTO, NAME_PATTERN, SHIPPED
from k3core.run.presets import parse_preset, user_preset_dir
from k3core.run.request import EngineRequest, build
from k3core.run.settings import DEFAULTS

DEFAULT_IDS = (3, 7, 11, 5, 9)
DEFAULT_GEN = 6
REFERENCE_BACKEND = "numpy"


@dataclass
class TuneOptions:
    """What ``k3 tune`` was asked for (``None``: not given, the engine's default)."""

    model_dir: Path
    trunk: Path | None = None
    trunk_gb: float | None = None
    cache_gb: float | None = None
    storage: str | None = None
    backends: Sequence[str] = ()  # candidates; empty: every available kernel backend
    threads: Sequence[int] = ()  # candidates; empty: 1, 2, 4, ... up to the CPU count
    expert_readers: Sequence[int] = ()  # candidates; empty: 1, 2, 4, 8
    lookahead: Sequence[str] = ()  # candidates; empty: off, on
    spec: Sequence[str] = ()  # candidates; empty: off, ngram (docs/speculative.md)
    spec_width: Sequence[int] = ()  # candidates once spec is on; empty: 2, 4, 8
    name: str = "tuned"
    ids: Sequence[int] = DEFAULT_IDS
    gen: int = DEFAULT_GEN
    force: bool = False


@dataclass(frozen=True)
class Knob:
    """One setting ``k3 tune`` varies: its settings key and its candidate values."""

    key: str
    values: Callable[[TuneOptions], list[Any]]
    #: tried only when the best setting so far satisfies this (e.g. a width once spec is on)
    when: Callable[[dict[str, Any]], bool] = lambda best: True


def thread_counts(n: int | None = None) -> list[int]:
    """1, 2, 4, ... below the CPU count, and the CPU count itself."""
    top = max(1, n or os.cpu_count() or 1)
    out, t = [], 1
    while t < top:
        out.append(t)
        t *= 2
    return [*out, top]


def _backends(o: TuneOptions) -> list[str]:
    if o.backends:
        return list(dict.fromkeys(o.backends))
    reg = get_registry()
    return [n for n in reg.names("kernel") if n != "timed" and reg.probe("kernel", n).ok]


#: the knobs, tried in this order (each at the best of those before it)
KNOBS: tuple[Knob, ...] = (
    Knob("backend", _backends),
    Knob("threads", lambda o: list(o.threads) or thread_counts()),
    Knob("expert_readers", lambda o: list(o.expert_readers) or [1, 2, 4, 8]),
    Knob("lookahead", lambda o: list(o.lookahead) or ["off", "on"]),
    Knob("spec", lambda o: list(o.spec) or ["off", "ngram"]),
    Knob("spec_width", lambda o: list(o.spec_width) or [2, 4, 8],
         when=lambda best: best.get("spec", "off") != "off"),
)
#: knobs that are generation parameters (a preset carries them; the engine does not)
GENERATION_KEYS = ("spec", "spec_width")
#: a candidate equal to its default is the same run as leaving it out
_DEFAULT: dict[str, Any] = {**DEFAULTS, "spec": "off", "spec_width": 4}


@dataclass
class Trial:
    setting: dict[str, Any]
    seconds_per_token: float | None = None
    ids: list[int] = field(default_factory=list)
    kept: bool = False  # ids match the reference
    note: str = ""


@dataclass
class TuneResult:
    reference: Trial
    trials: list[Trial]
    best: dict[str, Any]
    seconds_per_token: float
    preset_path: Path
    preset_text: str

    def to_json(self) -> dict[str, Any]:
        return {"preset": self.best.get("name"), "preset_path": str(self.preset_path),
                "setting": {k: v for k, v in self.best.items() if k != "name"},
                "seconds_per_token": self.seconds_per_token,
                "reference": asdict(self.reference), "trials": [asdict(t) for t in self.trials],
                "refused": [t.setting for t in self.trials if not t.kept]}

    def lines(self) -> list[str]:
        out = [f"reference (--backend {REFERENCE_BACKEND}): ids {_ids(self.reference.ids)}"]
        for t in self.trials:
            what = " ".join(f"{k}={v}" for k, v in t.setting.items())
            if t.kept:
                out.append(f"  {what}: {t.seconds_per_token:.4f} s/token")
            else:
                out.append(f"  {what}: REFUSED ({t.note})")
        best = " ".join(f"{k}={v}" for k, v in self.best.items() if k != "name")
        out.append(f"best: {best} at {self.seconds_per_token:.4f} s/token (ids match the reference)")
        out.append(f"wrote preset {self.best['name']!r} to {self.preset_path} "
                   f"(k3 run --preset {self.best['name']})")
        return out


def _ids(ids: Sequence[int]) -> str:
    return ",".join(map(str, ids))


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
    return path


def run_trial(o: TuneOptions, setting: dict[str, Any]) -> Trial:
    """Open the engine with ``setting``, decode ``o.ids`` for ``o.gen`` tokens, time it."""
    engine_keys = {k: v for k, v in setting.items() if k not in GENERATION_KEYS}
    gen_keys = {k: v for k, v in setting.items() if k in GENERATION_KEYS}
    fields: dict[str, Any] = {"model_dir": o.model_dir, "trunk": o.trunk, "trunk_gb": o.trunk_gb,
                              "cache_gb": o.cache_gb, "storage": o.storage, **engine_keys}
    req = build(EngineRequest, {k: v for k, v in fields.items() if v is not None})
    plan = plan_engine(req, given_as="keyword")
    plan.plan_memory(prompt_len=len(o.ids), gen=o.gen)
    plan.check()
    with Engine.from_plan(plan) as eng:
        t0 = time.perf_counter()
        gen = eng.generate(list(o.ids), max_tokens=o.gen, ignore_eos=True, **gen_keys)
        wall = time.perf_counter() - t0
    steps = [s.seconds for s in gen.steps[1:]]
    spt = statistics.median(steps) if steps else wall / max(1, len(gen.ids))
    return Trial(dict(setting), spt, list(gen.ids))


def tune(o: TuneOptions, progress: Callable[[str], None] | None = None) -> TuneResult:
    """Search :data:`KNOBS`, keep only candidates whose ids match, write the preset."""
    if o.gen < 2:
        raise UsageError(f"--gen must be at least 2 (the first step also prefills), got {o.gen}")
    path = check_name(o)
    say = progress or (lambda s: None)
    say(f"reference run: --backend {REFERENCE_BACKEND}")
    ref = run_trial(o, {"backend": REFERENCE_BACKEND, "threads": 1, "lookahead": "off"})
    ref.kept = True
    trials: list[Trial] = []
    done: dict[tuple[tuple[str, Any], ...], Trial] = {}
    best: dict[str, Any] = {}
    best_spt: float | None = None
    for knob in KNOBS:
        values = knob.values(o)
        if not values or not knob.when(best):
            continue
        scored: list[tuple[float, Any]] = []
        for v in values:
            setting = {**best, knob.key: v}
            # a value equal to the engine's default is the same run as leaving it out
            sig = tuple(sorted((k, x) for k, x in setting.items() if _DEFAULT.get(k) != x))
            t = done.get(sig)
            if t is None:
                say("trying " + " ".join(f"{k}={x}" for k, x in setting.items()))
                try:
                    t = run_trial(o, setting)
                except K3Error as exc:
                    if knob.key != "backend" and not best:
                        raise
                    t = Trial(setting, note=f"failed: {exc.message}")
                else:
                    if t.ids != ref.ids:
                        t.note = (f"its ids {_ids(t.ids)} differ from the reference's "
                                  f"{_ids(ref.ids)}; a setting that changes the ids is never kept")
                    else:
                        t.kept = True
                done[sig] = t
                trials.append(t)
            if t.kept and t.seconds_per_token is not None:
                scored.append((t.seconds_per_token, v))
        if not scored:
            if knob.key == "backend":
                raise K3Error("k3 tune: no kernel backend decoded the reference's ids; refusing "
                              "to write a preset (see the refused trials above)")
            continue
        spt, v = min(scored, key=lambda sv: sv[0])
        best[knob.key], best_spt = v, spt
    assert best_spt is not None
    doc = _preset_doc(o, best, best_spt)
    text = yaml.safe_dump(doc, sort_keys=False, allow_unicode=False, width=1000)
    parse_preset(text, str(path))  # the file is a valid preset before it is written
    _write_atomic(path, text)
    return TuneResult(ref, trials, {"name": o.name, **best}, best_spt, path, text)


def _preset_doc(o: TuneOptions, best: dict[str, Any], spt: float) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "name": o.name,
        "description": f"k3 tune on this machine for {Path(o.model_dir).name}"[:200],
        "trunk_gb": float(o.trunk_gb if o.trunk_gb is not None else DEFAULTS["trunk_gb"]),
        "cache_gb": float(o.cache_gb if o.cache_gb is not None else DEFAULTS["cache_gb"]),
    }
    if o.storage is not None:
        doc["storage"] = o.storage
    doc.update(best)
    doc["notes"] = (f"measured {spt:.4f} s/token (median decode step, {o.gen} tokens); ids "
                    f"matched --backend {REFERENCE_BACKEND}")[:300]
    return doc


def _write_atomic(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise OutputError(f"cannot write preset {path}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            give_new_file_mode(f.fileno())
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise OutputError(f"cannot write preset {path}: {exc.strerror or exc}") from None
