"""The model's shape, read from ``config.json`` with confidence or not at all.

Two layouts are accepted and never guessed between (docs/model.md §2, docs/engine-behaviours.md §6):

* **nested** (the released file): the text model under ``text_config``, the KDA block and
  the layer map under ``text_config.linear_attn_config``, SiTU betas spelled
  ``activation_situ_beta`` / ``activation_situ_linear_beta``;
* **flat** (the fixtures): everything at the root, KDA spelled ``kda_num_heads`` /
  ``kda_head_dim``, betas ``situ_beta`` / ``situ_linear_beta``.

Each key is looked up in ``text_config``, then ``linear_attn_config`` (nested, or at the
root in the flat shape), then the root, primary spelling before alias; the first hit wins.
The KDA-block keys (head count and width, conv kernel, gate bound, layer lists,
``use_full_rank_gate``) are looked up in ``linear_attn_config`` first, as docs/model.md §2
says, so a ``text_config.head_dim`` meant for something else can never be taken for the
KDA head width. A key spelled both ways in one object with two different values is refused.

Every required key must be present: a default would silently build a different model (a
flat-only reader on the nested file gets the right SiTU betas by luck and an empty layer
map, i.e. an all-KDA model). Only ``mla_use_output_gate``, ``moe_renormalize`` and
``latent_moe_use_norm`` default (to true). All problems are reported in one
:class:`~k3core.api.errors.ConfigError` (exit 2). Released keys the forward pass does not read
but whose other values would change the model (docs/model.md §2) are asserted when present.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from k3core.api.errors import ConfigError
from k3core.api.files import FileRejected, read_capped
from k3core.api.safejson import JSONRejected, json_kind, parse_json
from k3core.api.units import human
from k3core.model.config_keys import read_fields, structural_problems

#: config.json larger than this is refused before parsing (the real one is a few kB)
MAX_CONFIG_BYTES = 16_000_000
#: how many problems one message lists before "... and N more"
MAX_LISTED = 32

Shape = Literal["nested", "flat"]


class ModelConfig(BaseModel):
    """The fields the model graph uses (names follow the reference engine's ``k3_cfg``)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    hidden: int
    n_layers: int
    vocab: int
    rms_eps: float
    kda_heads: int
    kda_head_dim: int
    conv_k: int
    gate_lb: float
    n_heads: int
    q_lora: int
    kv_lora: int
    qk_nope: int
    qk_rope: int
    v_head: int
    mla_out_gate: bool = True
    n_experts: int
    topk: int
    n_shared: int
    latent: int
    moe_inter: int
    routed_scale: float
    moe_renorm: bool = True
    latent_norm: bool = True
    first_dense: int
    dense_inter: int
    attn_res_block: int
    situ_b1: float
    situ_b2: float
    #: one-based indices of the MLA ("full attention") layers, ascending
    full_attn_layers: tuple[int, ...]
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    #: which layout the file had; not part of equality (both shapes describe one model)
    shape: Shape = "flat"
    #: where it came from, for messages; not part of equality
    source: str = "config.json"

    @field_validator("full_attn_layers", mode="before")
    @classmethod
    def _sorted_layers(cls, value: Any) -> Any:
        if isinstance(value, (list, tuple)) and all(type(x) is int for x in value):
            return tuple(sorted(value))
        return value

    @model_validator(mode="after")
    def _structure(self) -> ModelConfig:
        problems = structural_problems(self.model_dump())
        if problems:
            raise ValueError("; ".join(problems))
        return self

    # ---- reading ------------------------------------------------------------------------
    @classmethod
    def from_json_dict(cls, d: Any, source: str = "config.json") -> ModelConfig:
        """Build from a parsed ``config.json`` document; raise ``ConfigError`` (exit 2)."""
        if not isinstance(d, dict):
            raise ConfigError(f"{source}: cannot be read with confidence: the top level is "
                              f"{json_kind(d)}, not a JSON object")
        shape, values, missing, problems = read_fields(d)
        if not missing and not problems:
            problems = structural_problems(values)
        if missing or problems:
            raise ConfigError(_message(source, missing, problems))
        values.pop("kda_layers", None)  # checked above; the model keeps full_attn_layers
        try:
            return cls(**values, shape=shape, source=source)
        except ValidationError as exc:  # every check above ran first; this is a backstop
            raise ConfigError(f"{source}: cannot be read with confidence: {exc}") from None

    @classmethod
    def from_json_bytes(cls, data: bytes, source: str = "config.json") -> ModelConfig:
        """Parse and build from raw file bytes (UTF-8 JSON object, size-capped)."""
        if len(data) > MAX_CONFIG_BYTES:
            raise ConfigError(f"{source}: cannot be read with confidence: {len(data)} bytes "
                              f"is larger than the {human(MAX_CONFIG_BYTES)} limit")
        try:
            doc = parse_json(data)
        except JSONRejected as exc:
            raise ConfigError(f"{source}: cannot be read with confidence: {exc}") from None
        return cls.from_json_dict(doc, source=source)

    # ---- queries ------------------------------------------------------------------------
    def is_mla(self, layer0: int) -> bool:
        """Whether zero-based layer ``layer0`` is MLA (``layer0 + 1`` in full_attn_layers)."""
        self._check_layer(layer0)
        return (layer0 + 1) in self.full_attn_layers

    def is_dense(self, layer0: int) -> bool:
        """Whether zero-based layer ``layer0`` has the dense MLP (``layer0 < first_dense``)."""
        self._check_layer(layer0)
        return layer0 < self.first_dense

    @property
    def n_mla(self) -> int:
        return len(self.full_attn_layers)

    @property
    def n_kda(self) -> int:
        return self.n_layers - len(self.full_attn_layers)

    @property
    def kda_layers(self) -> tuple[int, ...]:
        """One-based indices of the KDA layers (the complement of ``full_attn_layers``)."""
        mla = set(self.full_attn_layers)
        return tuple(i for i in range(1, self.n_layers + 1) if i not in mla)

    @property
    def layer_map(self) -> str:
        """One letter per layer, ``K`` or ``M`` (``KKKMKKKMKKKMM`` for the tiny oracle)."""
        return "".join("M" if self.is_mla(i) else "K" for i in range(self.n_layers))

    def describe(self) -> str:
        """The one-line ``config:`` summary the run report prints."""
        return (f"config: {self.source} ({self.shape}): hidden {self.hidden}, "
                f"{self.n_layers} layers, vocab {self.vocab}, {self.n_mla} MLA + "
                f"{self.n_kda} KDA, {self.n_experts} experts top-{self.topk} + "
                f"{self.n_shared} shared, latent {self.latent}")

    def fingerprint(self) -> tuple[int, ...]:
        """The reference engine's 12-int state-file fingerprint."""
        return (self.hidden, self.n_layers, self.vocab, self.kda_heads, self.kda_head_dim,
                self.conv_k, self.n_heads, self.qk_nope, self.qk_rope, self.v_head,
                self.n_experts, self.topk)

    # ---- writing ------------------------------------------------------------------------
    def to_flat_dict(self) -> dict[str, Any]:
        """The flat (fixture) shape, as a JSON-ready dict."""
        d: dict[str, Any] = {**self._common(), "tie_word_embeddings": False,
                             "kda_num_heads": self.kda_heads, "kda_head_dim": self.kda_head_dim,
                             "short_conv_kernel_size": self.conv_k,
                             "gate_lower_bound": self.gate_lb,
                             "situ_beta": self.situ_b1, "situ_linear_beta": self.situ_b2,
                             "full_attn_layers": list(self.full_attn_layers)}
        d.update(self._token_ids())
        return d

    def to_nested_dict(self) -> dict[str, Any]:
        """The released (nested) shape, with ``kda_layers``, as a JSON-ready dict."""
        text: dict[str, Any] = {
            "model_type": "kimi_linear", **self._common(), "tie_word_embeddings": False,
            "activation_situ_beta": self.situ_b1,
            "activation_situ_linear_beta": self.situ_b2,
            "linear_attn_config": {
                "num_heads": self.kda_heads, "head_dim": self.kda_head_dim,
                "short_conv_kernel_size": self.conv_k, "gate_lower_bound": self.gate_lb,
                "full_attn_layers": list(self.full_attn_layers),
                "kda_layers": list(self.kda_layers),
            },
        }
        return {"model_type": "kimi_k3", **self._token_ids(), "text_config": text}

    def _common(self) -> dict[str, Any]:
        return {
            "hidden_size": self.hidden, "num_hidden_layers": self.n_layers,
            "vocab_size": self.vocab, "rms_norm_eps": self.rms_eps,
            "num_attention_heads": self.n_heads, "q_lora_rank": self.q_lora,
            "kv_lora_rank": self.kv_lora, "qk_nope_head_dim": self.qk_nope,
            "qk_rope_head_dim": self.qk_rope, "v_head_dim": self.v_head,
            "mla_use_output_gate": self.mla_out_gate, "num_experts": self.n_experts,
            "num_experts_per_token": self.topk, "num_shared_experts": self.n_shared,
            "routed_expert_hidden_size": self.latent, "moe_intermediate_size": self.moe_inter,
            "routed_scaling_factor": self.routed_scale, "moe_renormalize": self.moe_renorm,
            "latent_moe_use_norm": self.latent_norm, "first_k_dense_replace": self.first_dense,
            "intermediate_size": self.dense_inter, "attn_res_block_size": self.attn_res_block,
        }

    def _token_ids(self) -> dict[str, int]:
        ids = {"bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
               "pad_token_id": self.pad_token_id}
        return {k: v for k, v in ids.items() if v is not None}

    # ---- identity -----------------------------------------------------------------------
    def _semantic(self) -> tuple[Any, ...]:
        return tuple(v for k, v in self.__dict__.items() if k not in ("shape", "source"))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ModelConfig):
            return NotImplemented
        return self._semantic() == other._semantic()

    def __hash__(self) -> int:
        return hash(self._semantic())

    def _check_layer(self, layer0: int) -> None:
        if not 0 <= layer0 < self.n_layers:
            raise IndexError(f"layer {layer0} is outside 0..{self.n_layers - 1} (zero-based)")


def load_config(path: str | Path) -> ModelConfig:
    """Read ``path`` (a ``config.json``, or a model directory holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    source = str(p)
    try:
        data = read_capped(p, MAX_CONFIG_BYTES)
    except FileRejected as exc:
        raise ConfigError(f"{source}: cannot be read with confidence: {exc}") from None
    return ModelConfig.from_json_bytes(data, source=source)


def _message(source: str, missing: list[str], problems: list[str]) -> str:
    parts: list[str] = []
    if missing:
        parts.append("missing keys: " + _capped(missing, ", "))
    if problems:
        parts.append(_capped(problems, "; "))
    msg = f"{source}: cannot be read with confidence: " + "; ".join(parts)
    if missing:
        msg += ("; missing keys are never defaulted, because a default would silently "
                "build a different model")
    return msg


def _capped(items: list[str], sep: str) -> str:
    if len(items) <= MAX_LISTED:
        return sep.join(items)
    return sep.join(items[:MAX_LISTED]) + f"{sep}... and {len(items) - MAX_LISTED} more"
