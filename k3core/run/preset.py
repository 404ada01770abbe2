"""The preset record: one named pair of budgets and the plugin choices it may carry.

A preset is a declarative YAML file (``presets/*.yaml``, user files) or the computed ``auto``
preset (:mod:`k3core.run.preset_auto`); both end as a validated :class:`Preset`.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

from k3core.api.errors import UsageError
from k3core.api.specs import Kind
from k3core.api.units import MAX_GB
from k3core.experts.readers import READERS_LIMIT
from k3core.run.settings import LOOKAHEAD_PATTERN, MAX_THREADS

#: shipped presets in the order ``k3 presets`` lists them
SHIPPED = ("ultra", "laptop", "desktop", "workstation", "server", "max")
AUTO = "auto"
MAX_PRESET_BYTES = 64_000
MAX_DEPTH = 1  # a top-level mapping of scalars: no nested values at all
MAX_EVENTS = 2_000
NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,31}$"
PLUGIN_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


class PresetError(UsageError):
    """A preset that cannot be found or read with confidence (exit 2)."""


class Preset(BaseModel):
    """One preset. Budgets are decimal GB (1 GB = 10^9 bytes)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    name: str = Field(pattern=NAME_PATTERN)
    description: str = Field(default="", max_length=200)
    trunk_gb: float = Field(gt=0, le=MAX_GB)
    cache_gb: float = Field(ge=0, le=MAX_GB)
    ultra_low_memory: bool = False
    peak_rss_gb: float | None = Field(default=None, ge=0, le=MAX_GB)
    notes: str = Field(default="", max_length=300)
    backend: str | None = Field(default=None, pattern=PLUGIN_PATTERN)
    storage: str | None = Field(default=None, pattern=PLUGIN_PATTERN)
    cache_policy: str | None = Field(default=None, pattern=PLUGIN_PATTERN)
    threads: int | None = Field(default=None, ge=1, le=MAX_THREADS)
    incremental: bool | None = None
    lookahead: str | None = Field(default=None, pattern=LOOKAHEAD_PATTERN)
    expert_readers: int | None = Field(default=None, ge=1, le=READERS_LIMIT)
    #: speculative decoding defaults of a run that does not give ``--spec``/``--spec-width``
    spec: str | None = Field(default=None, pattern=r"^(off|ngram|auto)$")
    spec_width: int | None = Field(default=None, ge=1, le=16)

    _origin: str = PrivateAttr(default="")

    @field_validator("trunk_gb", "cache_gb", "peak_rss_gb")
    @classmethod
    def _finite(cls, v: float | None) -> float | None:
        if v is not None and not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v

    @field_validator("lookahead", mode="before")
    @classmethod
    def _onoff(cls, v: object) -> object:
        # YAML 1.1 reads a bare on/off as a boolean: take it as the word it was
        return ("on" if v else "off") if isinstance(v, bool) else v

    @field_validator("description", "notes")
    @classmethod
    def _printable(cls, v: str) -> str:
        if any(ord(ch) < 32 and ch not in "\t" for ch in v):
            raise ValueError("must be one line of printable text")
        return v

    @property
    def origin(self) -> str:
        """Where it was read from (a path, or ``computed``)."""
        return self._origin

    @property
    def needs_trunk(self) -> bool:
        """Whether a run with this preset needs ``--trunk DIR`` (a packed trunk): only an
        ultra-low-memory preset does (it streams embedding and lm_head from the packed
        trunk). Any other runs without one, its trunk resident: the trunk budget then does
        not apply, only the cache budget (the plan says so)."""
        return self.ultra_low_memory

    @property
    def trunk_bytes(self) -> int:
        return int(self.trunk_gb * 1e9)

    @property
    def cache_bytes(self) -> int:
        return int(self.cache_gb * 1e9)

    def with_origin(self, origin: str) -> Preset:
        self._origin = origin
        return self

    def plugins(self) -> dict[Kind, str]:
        """The plugin names this preset asks for, by registry kind."""
        named: dict[Kind, str | None] = {"kernel": self.backend, "storage": self.storage,
                                         "cache": self.cache_policy}
        return {k: v for k, v in named.items() if v is not None}
