"""The doctor's verdicts: one pure function of what it found about the machine and the model.

:func:`judge` takes the machine's facts (memory total and available, the best read
bandwidth measured, this process's resident set) and the model's (its config and sizes: the
model directory given, else Kimi K3's released figures) and returns every verdict the
report prints, so they cannot disagree:

* **resident**: the whole model (trunk resident, every routed expert cached) plans at most
  :data:`RESIDENT_SHARE` of the memory available. Then nothing needs to stream: no packed
  trunk, no preset (``k3 run MODEL`` caches every expert), and no per-preset disk advice.
* **each preset**: the memory plan of a streamed run with its budgets on this model (the
  plan ``k3 run`` checks, budgets cut to what the model can use), and the bytes one token
  reads from disk at the measured bandwidth (:func:`k3core.tools.doctor.needs.preset_reads`).
  A preset is ``ok`` only when it fits the memory available (within the plan's 95 % line,
  and a trunk budget that holds the model's largest layer) **and** its reads take at most
  :data:`~k3core.tools.doctor.needs.SLOW_SECONDS_PER_TOKEN` per token (``warn`` when slow);
  one that does not fit is ``info`` (not this machine's preset, not a problem); one that
  fits with the bandwidth unmeasured is ``info`` too.
* **the recommended preset**: the first of :data:`LADDER` (server, workstation, desktop,
  laptop) that fits, else ``ultra`` when it fits, else none. ``max`` is never recommended
  (the reference measured it no faster than ``server``), but it is rated. The memory line,
  the ``fit`` line and the next command all name this one preset.
* **the ultra floor**: one trunk layer, top-k + 1 expert slots, ultra-low-memory full
  recompute; when even that does not fit, a given model cannot run here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from k3core.api.units import align_up, human
from k3core.model.config import ModelConfig
from k3core.model.sizes import ModelSizes
from k3core.run.memory_plan import MemoryRequest, plan_memory
from k3core.run.preset import Preset
from k3core.tools.doctor.model import Status
from k3core.tools.doctor.needs import SLOW_SECONDS_PER_TOKEN, PresetReads, preset_reads

#: the whole model "fits comfortably" when its resident plan is at most this share of available
RESIDENT_SHARE = 0.5
#: presets the doctor recommends, largest first (then ``ultra``)
LADDER = ("server", "workstation", "desktop", "laptop")
ULTRA = "ultra"
#: the request every plan here is made for: a short prompt and a short generation
PROMPT, GEN = 32, 8


@dataclass(frozen=True)
class MachineFacts:
    total: int  # bytes of memory
    available: int  # bytes available now (MemAvailable)
    read_mb_s: float = 0.0  # best measured read bandwidth; 0: not measured
    baseline: int = 0  # this process's resident set (the plan's "python + libraries" row)


@dataclass(frozen=True)
class ModelFacts:
    cfg: ModelConfig
    sizes: ModelSizes
    given: bool = True  # a model directory; False: Kimi K3's released figures

    @property
    def which(self) -> str:
        return "this model" if self.given else "Kimi K3"


@dataclass(frozen=True)
class PresetVerdict:
    name: str
    planned: int  # bytes a streamed run with this preset plans on the model
    fits_memory: bool
    reads: PresetReads
    seconds_per_token: float | None  # of reading; None: bandwidth not measured
    status: Status
    detail: str

    @property
    def slow(self) -> bool | None:
        s = self.seconds_per_token
        return None if s is None else s > SLOW_SECONDS_PER_TOKEN

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "planned_bytes": self.planned,
                "fits_memory": self.fits_memory, "reads_bytes_per_token": self.reads.total,
                "seconds_per_token": self.seconds_per_token, "slow": self.slow,
                "status": self.status}


@dataclass(frozen=True)
class Verdict:
    resident: bool  # the whole model fits comfortably: nothing streams
    resident_planned: int
    preset: str | None  # recommended; None when resident or when nothing fits
    presets: tuple[PresetVerdict, ...]
    floor_planned: int
    floor_fits: bool
    memory_status: Status
    memory_detail: str
    available: int

    def preset_verdict(self, name: str) -> PresetVerdict | None:
        return next((p for p in self.presets if p.name == name), None)

    def to_json(self) -> dict[str, Any]:
        return {"resident": self.resident, "resident_planned_bytes": self.resident_planned,
                "preset": self.preset, "floor_planned_bytes": self.floor_planned,
                "floor_fits": self.floor_fits, "available_bytes": self.available,
                "presets": [p.to_json() for p in self.presets]}


def _fits(total: int, available: int) -> bool:
    from k3core.run.memory_plan import PLAN_LIMIT

    return total <= PLAN_LIMIT * available


def _plan(m: MachineFacts, model: ModelFacts, req: MemoryRequest) -> int:
    return plan_memory(model.cfg, req, sizes=model.sizes, available=m.available,
                       baseline=m.baseline).total


def rate_preset(p: Preset, m: MachineFacts, model: ModelFacts) -> PresetVerdict:
    """One preset on this machine and model: memory and read speed together."""
    sz = model.sizes
    slot = align_up(sz.largest_layer)
    planned = _plan(m, model, MemoryRequest(
        streamed=True, trunk_budget=max(p.trunk_bytes, slot), cache_bytes=p.cache_bytes,
        prompt_len=PROMPT, gen=GEN, incremental=True, ultra=p.ultra_low_memory))
    room = p.trunk_bytes >= slot
    fits = room and _fits(planned, m.available)
    reads = preset_reads(p, sz)
    secs = 0.0 if reads.total == 0 else reads.seconds_at(m.read_mb_s) if m.read_mb_s > 0 else None
    memory = (f"plans {human(planned)} of {human(m.available)} available" if room else
              f"its trunk budget {human(p.trunk_bytes)} is below one layer of {model.which} "
              f"({human(slot)})")
    read = (f"{model.which} reads ~{human(reads.total)} per token ({reads.pinned_layers}/"
            f"{reads.n_layers} trunk layers pinned; trunk {human(reads.trunk_bytes)}, experts "
            f"~{human(reads.expert_bytes)} if routing were uniform)")
    if secs is None:
        speed = f"{read}; read speed not measured"
    else:
        speed = (f"{read}: at {m.read_mb_s:,.0f} MB/s that is >= {secs:.1f} s/token of reading"
                 if reads.total else f"{read}: nothing streams")
    status: Status
    if not fits:
        status, detail = "info", f"does not fit this machine: {memory}; {speed}"
    elif secs is None:
        status, detail = "info", f"fits memory ({memory}); {speed}"
    elif secs > SLOW_SECONDS_PER_TOKEN:
        status, detail = "warn", f"fits memory ({memory}) but slow: {speed}"
    else:
        status, detail = "ok", f"fits memory ({memory}) and disk speed: {speed}"
    return PresetVerdict(p.name, planned, fits, reads, secs, status, detail)


def judge(m: MachineFacts, model: ModelFacts, presets: Sequence[Preset]) -> Verdict:
    """Every verdict of the report, from the facts alone (see the module)."""
    sz = model.sizes
    resident_planned = _plan(m, model, MemoryRequest(
        streamed=False, cache_bytes=sz.expert_pool_bytes, prompt_len=PROMPT, gen=GEN,
        incremental=True))
    resident = resident_planned <= RESIDENT_SHARE * m.available
    floor_planned = _plan(m, model, MemoryRequest(
        streamed=True, trunk_budget=align_up(sz.largest_layer),
        cache_bytes=(sz.topk + 1) * sz.expert_slot_bytes, prompt_len=PROMPT, gen=GEN,
        incremental=False, ultra=True))
    rated = tuple(rate_preset(p, m, model) for p in presets)
    fitting = {v.name for v in rated if v.fits_memory}
    avail = human(m.available)
    status: Status
    preset: str | None = None
    if resident:
        status = "ok"
        detail = (f"the whole of {model.which} fits in memory: a resident run with every expert "
                  f"cached plans {human(resident_planned)} of {avail} available (at most "
                  f"{RESIDENT_SHARE:.0%}); no packed trunk or preset needed")
    elif (preset := next((n for n in LADDER if n in fitting), None)) is not None:
        v = next(r for r in rated if r.name == preset)
        status = "ok"
        detail = (f"fits --preset {preset}: a streamed run plans {human(v.planned)} of {avail} "
                  f"available for {model.which} (the largest of server, workstation, desktop, "
                  "laptop that fits; max is never faster than server within noise)")
    elif ULTRA in fitting:
        preset = ULTRA
        v = next(r for r in rated if r.name == ULTRA)
        status = "warn"
        detail = (f"only --preset ultra fits {model.which} here: it plans {human(v.planned)} of "
                  f"{avail} available, and laptop (the ordinary path's floor) does not fit "
                  "(proof of life only; building and testing still work)")
    else:
        status = "warn"
        detail = (f"no preset fits {model.which} here ({avail} available); the ultra-low-memory "
                  f"floor plans {human(floor_planned)}"
                  + ("" if _fits(floor_planned, m.available) else ", and does not fit either")
                  + " (building and testing still work)")
    return Verdict(resident, resident_planned, preset, rated, floor_planned,
                   _fits(floor_planned, m.available), status, detail, m.available)
