"""What a run was asked for, validated: the first stage of request -> plan -> engine -> session.

A :class:`RunRequest` is built the same way by the command line (from its flags), by the
Python API (``k3.load`` and ``Engine.generate`` keywords) and by a server (from a JSON
body). It holds what the caller *gave*; ``None`` means "not given", so the plan
(:mod:`k3core.run.plan`) can fill the gap from the environment, a preset or a default and
record which layer set each value (flag > environment > preset > default).

It has three parts, each usable alone:

* :class:`EngineRequest`: everything that opens an engine (model, budgets, plugins);
* :class:`GenerationParams`: one generation (prompt-independent: length, sampling, stops);
* :class:`OutputRequest`: the files a command-line run writes.

Every refusal is a ``UsageError`` (exit 2) naming the parameter (:func:`~k3core.api.errors.param`:
``max_tokens`` from Python, ``--gen`` on the command line), checked in the reference engine's
order before any file is opened. The whole request serialises to JSON
(:meth:`RunRequest.to_json`) and ``--out`` records it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from k3core.api.errors import UsageError, param
from k3core.api.units import check_gb
from k3core.experts.readers import READERS_LIMIT
from k3core.run.settings import LOOKAHEAD_MODES
from k3core.trunk.plan import DEFAULT_RING, MAX_RING

if TYPE_CHECKING:
    from k3core.api.outputs import InputSpec
    from k3core.run.preset import Preset

M = TypeVar("M", bound=BaseModel)

#: the most tokens one generation may ask for, and the most stop ids / stop strings
MAX_GEN = 4096
#: ``max_tokens`` (``--gen``) that generates until the end of sequence or the context is full
UNTIL_END = -1
MAX_STOP_IDS = 8
MAX_STOP_TEXTS = 8
MAX_STOP_CHARS = 256


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)


def max_context() -> int:
    """The largest ``context``: the longest prompt plus the most one generation makes."""
    from k3core.run.prompt import MAX_PROMPT

    return MAX_PROMPT + MAX_GEN


class PromptInput(_Strict):
    """Exactly one of ``text`` (``--prompt``), ``file`` (``--prompt-file``, ``-`` = stdin)
    or ``ids`` (``--ids``: the text ``3,7,11`` or a list of ints)."""

    text: str | None = None
    file: Path | None = None
    ids: str | list[int] | None = None
    bos: bool = False

    def check(self) -> None:
        given = [n for n, v in (("--prompt", self.text), ("--prompt-file", self.file),
                                ("--ids", self.ids)) if v is not None]
        if not given:
            raise UsageError("one of --prompt, --prompt-file or --ids is required")
        if len(given) > 1:
            raise UsageError(f"{' and '.join(given)} are mutually exclusive: give exactly one "
                             "prompt source")

    @property
    def needs_tokenizer(self) -> bool:
        return self.ids is None


class GenerationParams(_Strict):
    """One generation: how many tokens, how they are chosen, where it stops.

    ``temperature`` 0 or below ``MIN_TEMPERATURE`` (1e-5; or no sampling keyword at all) is
    greedy; any of ``top_p``, ``top_k``, ``seed`` or a larger ``temperature`` turns seeded
    sampling on (temperature
    1.0 unless given; a time-based seed unless given, printed in the report). Generation
    stops after ``max_tokens``, after emitting a ``stop_ids`` id or the tokenizer's
    end-of-sequence id (unless ``ignore_eos``), or when the text contains a ``stop`` string
    (the text is cut before it). ``max_tokens`` -1 (:data:`UNTIL_END`, llama.cpp's ``-n -1``)
    generates until one of those stops or the context is full: the sequence (the session's
    ids, the prompt and what is generated) holds ``context`` ids, by default the sequence
    before this call plus ``MAX_GEN``; a given ``context`` also ends a longer ``max_tokens``
    early (``stop_reason`` ``context``). ``spec`` (off | ngram | auto) drafts up to ``spec_width``
    tokens per pass from the context's n-grams (longest ``spec_ngram``) and verifies them in
    one pass: the same ids as ``off`` (docs/speculative.md).
    """

    max_tokens: int = 8
    context: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    stop_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    spec: str = "off"
    spec_width: int = 4
    spec_ngram: int = 3

    @model_validator(mode="after")
    def _check(self) -> GenerationParams:
        from k3core.model.sampling import check_sampling
        from k3core.model.speculative import check_spec

        if not (0 <= self.max_tokens <= MAX_GEN or self.max_tokens == UNTIL_END):
            raise UsageError(f"{param('max_tokens')} must be in 0..{MAX_GEN}, or {UNTIL_END} to "
                             f"generate until the end of sequence or the context is full; got "
                             f"{self.max_tokens} (refusing rather than clamping)")
        if self.context is not None and not 1 <= self.context <= max_context():
            raise UsageError(f"{param('context')} must be in 1..{max_context()}, got "
                             f"{self.context}")
        if len(self.stop_ids) > MAX_STOP_IDS:
            raise UsageError(f"{param('stop_ids')} may be given at most {MAX_STOP_IDS} times")
        if any(s < 0 for s in self.stop_ids):
            raise UsageError(f"{param('stop_ids')} must be a non-negative integer")
        if len(self.stop) > MAX_STOP_TEXTS:
            raise UsageError(f"{param('stop')} may be given at most {MAX_STOP_TEXTS} times")
        for s in self.stop:
            if not s or len(s) > MAX_STOP_CHARS:
                raise UsageError(f"{param('stop')} needs a non-empty text of at most "
                                 f"{MAX_STOP_CHARS} characters, got {s!r:.40}")
        check_sampling(self.temperature, self.top_p, self.top_k, self.seed)
        check_spec(self.spec, self.spec_width, self.spec_ngram)
        return self

    def budget(self, held: int) -> tuple[int, bool]:
        """After a sequence of ``held`` ids (the session's and the prompt's): the most tokens
        this generation makes, and whether reaching that count means the context is full
        (``stop_reason`` ``context``) rather than ``max_tokens`` made. A sequence that
        already fills the context, with tokens still to make, is refused (exit 2)."""
        limit = held + MAX_GEN if self.context is None else self.context
        room = limit - held
        if self.max_tokens == 0:
            return 0, False
        if room <= 0:
            raise UsageError(f"the sequence holds {held} ids, which fills the context of "
                             f"{limit}: no room to generate (a larger {param('context')}, or "
                             "a shorter prompt)")
        if self.max_tokens == UNTIL_END or self.max_tokens > room:
            return room, True
        return self.max_tokens, False

    @property
    def greedy(self) -> bool:
        from k3core.model.sampling import is_greedy_temperature

        if self.temperature is not None and is_greedy_temperature(self.temperature):
            return True
        return all(v is None for v in (self.temperature, self.top_p, self.top_k, self.seed))


class EngineRequest(_Strict):
    """What opens an engine. ``None`` = not given (environment, preset or default decides).

    Each field's description is its help text: the command line's engine flags are made
    from these fields (``k3core/cli/options.py``), so every command that opens an engine
    takes them with one help text, one default and one check each; a backquoted name in a
    description is another field (``--trunk`` on the command line).

    The fields after ``prefill_chunk`` say how the engine will be used, not how it is
    configured (the JSON record leaves them out): ``positions``, the ids a session is planned to hold (the
    memory plan sizes the KV cache and the buffers for them); ``needs_tokenizer``, refuse
    at the plan when there is none; ``given_as``, how the caller's values are named in the
    plan's sources (``flag --threads`` on the command line, ``keyword threads`` in Python).
    """

    model_dir: Path | None = Field(default=None, description="Directory with the safetensors shards "
                                   "(or $K3_MODEL_DIR).")
    config: Path | None = Field(default=None, description="Model config (default MODEL_DIR/config.json).")
    layers: int | None = Field(default=None, description="Run only the first N layers (not the full "
                               "model).")
    tok: Path | None = Field(default=None, description="Directory with tiktoken.model and "
                             "tokenizer_config.json (or $K3_TOK_FILES; default: MODEL_DIR when "
                             "it has them).")
    preset: str | None = Field(default=None, description="Memory preset name or YAML path (see k3 "
                               "presets).")
    trunk: Path | None = Field(default=None, description="Stream the trunk from this packed directory "
                               "(k3 pack-trunk).")
    trunk_gb: float | None = Field(default=None, description="Trunk budget in GB (1e9 B): pinned layers "
                                   "+ ring.")
    trunk_ring: int | None = Field(default=None, description=f"Ring slots wanted (1..{MAX_RING}, "
                                   f"default {DEFAULT_RING}; the budget wins).")
    cache_gb: float | None = Field(default=None, description="Routed-expert cache budget in GB.")
    ultra_low_memory: bool | None = Field(default=None, description="Stream embedding and lm_head too "
                                          "(needs `trunk`).")
    backend: str | None = Field(default=None, description="Kernel backend: auto, numpy, numba, avx2, "
                                "... (k3 backends).")
    storage: str | None = Field(default=None, description="Storage backend: auto, direct, mmap, ...")
    cache_policy: str | None = Field(default=None, description="Expert-cache policy: auto, cycle-eta, "
                                     "lru, s3fifo, replay.")
    cache_trace: Path | None = Field(default=None, description="expert_trace.bin from an earlier run, "
                                     "for `cache_policy` replay.")
    threads: int | None = Field(default=None, description="Kernel threads (or $K3_THREADS / "
                                "$OMP_NUM_THREADS).")
    incremental: bool | None = Field(default=None, description="Carry KV cache and KDA state (the "
                                     "default), or re-run the whole prefix every step.")
    lookahead: str | None = Field(default=None, description="Router lookahead prefetch: off (the "
                                  "default), on, attn, out (docs/expert-cache.md).")
    expert_readers: int | None = Field(default=None, description=f"Expert-cache reader threads "
                                       f"(1..{READERS_LIMIT}; default: sized by the storage "
                                       "device's queue).")
    verify_trunk: bool = Field(default=False, description="Re-checksum every packed layer at open.")
    prefill_chunk: int | None = Field(default=None, description="Feed a longer prompt in chunks of N "
                                      "ids (default: the memory plan's activations budget; same "
                                      "logits).")
    positions: int = Field(default=1, ge=0, exclude=True)
    #: sequences decoding at once (a server's batch), each holding ``positions`` ids
    slots: int = Field(default=1, ge=1, exclude=True)
    #: bytes of kept prompt-prefix states (a server's prefix cache)
    prefix_cache_bytes: int = Field(default=0, ge=0, exclude=True)
    needs_tokenizer: bool = Field(default=False, exclude=True)
    given_as: Literal["flag", "keyword"] = Field(default="keyword", exclude=True)
    #: the routed experts are computed elsewhere (``k3core.cluster``'s workers): no expert
    #: cache is planned or opened here, and the checkpoint may hold none (a sharded head)
    remote_experts: bool = Field(default=False, exclude=True)

    @model_validator(mode="after")
    def _check(self) -> EngineRequest:
        from k3core.trunk.source import check_trunk_options

        for name, check in VALUE_CHECKS.items():
            check(getattr(self, name))
        check_trunk_options(self.trunk, self.trunk_gb, self.trunk_ring,
                            bool(self.ultra_low_memory))
        return self

    @classmethod
    def check_value(cls, name: str, value: object) -> None:
        """Refuse ``value`` for the field ``name`` as a request would, alone (``k3 tune``
        checks each candidate it is given this way): its type, then its range."""
        from pydantic import TypeAdapter

        try:
            kind = cls.model_fields[name].annotation
            value = TypeAdapter(kind).validate_python(value)  # type: ignore[arg-type]
        except ValidationError as exc:
            msg = exc.errors(include_input=False, include_url=False)[0]["msg"]
            raise UsageError(f"{param(name)}: {msg}") from None
        check = VALUE_CHECKS.get(name)
        if check is not None:
            check(value)

    @classmethod
    def options(cls) -> list[str]:
        """The fields a caller sets to configure the engine (``k3.load``'s keywords)."""
        return [k for k in cls.model_fields if k not in USE_FIELDS]

    def flags(self) -> dict[str, Any]:
        """The values that take part in flag > environment > preset > default."""
        return {"model_dir": self.model_dir, "tok": self.tok, "trunk_gb": self.trunk_gb,
                "cache_gb": self.cache_gb, "ultra_low_memory": self.ultra_low_memory,
                "backend": self.backend, "storage": self.storage,
                "cache_policy": self.cache_policy, "threads": self.threads,
                "incremental": self.incremental, "lookahead": self.lookahead,
                "expert_readers": self.expert_readers}


def _at_least_one(name: str) -> Callable[[int | None], None]:
    def check(v: int | None) -> None:
        if v is not None and v < 1:
            raise UsageError(f"{param(name)} must be >= 1, got {v}")
    return check


def _readers(v: int | None) -> None:
    if v is not None and not 1 <= v <= READERS_LIMIT:
        raise UsageError(f"{param('expert_readers')} must be in 1..{READERS_LIMIT}, got {v}")


def _cache_gb(v: float | None) -> None:
    check_gb(v, param("cache_gb"))


def _trunk_gb(v: float | None) -> None:
    check_gb(v, param("trunk_gb"), positive=True)


def _lookahead(v: str | None) -> None:
    if v is not None and v not in LOOKAHEAD_MODES:
        raise UsageError(f"{param('lookahead')} must be {', '.join(LOOKAHEAD_MODES[:-1])} or "
                         f"{LOOKAHEAD_MODES[-1]}, got {v!r}")


#: each engine field's own check (its range), in the reference's order; the combinations
#: (a trunk budget needs a trunk, ...) are :func:`k3core.trunk.source.check_trunk_options`'
VALUE_CHECKS: dict[str, Callable[[Any], None]] = {
    "threads": _at_least_one("threads"),
    "expert_readers": _readers,
    "prefill_chunk": _at_least_one("prefill_chunk"),
    "cache_gb": _cache_gb,
    "trunk_gb": _trunk_gb,
    "lookahead": _lookahead,
}

#: the fields of :class:`EngineRequest` that say how the engine is used, not configured
USE_FIELDS = ("positions", "slots", "prefix_cache_bytes", "needs_tokenizer", "given_as",
              "remote_experts")


class OutputRequest(_Strict):
    """Files a command-line run writes (each atomically, after the run)."""

    out: Path | None = None
    dump_logits: Path | None = None
    dump_cache_trace: Path | None = None
    save_state: Path | None = None
    load_state: Path | None = None

    def check(self, inputs: tuple[InputSpec, ...] = ()) -> None:
        """Refuse, before the run, every output that could not be written or would clobber
        what the run reads (``inputs``: MODEL_DIR, the packed trunk, the tokenizer, the
        prompt file, ...; the session being loaded is added here); see
        :func:`k3core.api.outputs.check_outputs`."""
        from k3core.api.outputs import TRACE_FILES, Output, check_outputs

        check_outputs([(self.out, "--out"), (self.dump_logits, "--dump-logits"),
                       Output(self.dump_cache_trace, "--dump-cache-trace", directory=True,
                              files=TRACE_FILES),
                       (self.save_state, "--save-state")],
                      inputs=(*inputs, (self.load_state, "--load-state")))


class ConstraintFiles(_Strict):
    """A run's constraint (``--json-schema FILE`` or ``--grammar FILE``: k3core.constrain.files)."""

    json_schema: Path | None = None
    grammar: Path | None = None

    def text(self) -> str | None:
        """The Lark grammar of the file given (``None``: none), read and checked."""
        from k3core.constrain.files import constraint_text

        return constraint_text(self.json_schema, self.grammar)


class RunRequest(_Strict):
    """One whole ``k3 run``: the engine, the prompt, the generation, the outputs."""

    prompt: PromptInput = Field(default_factory=PromptInput)
    generation: GenerationParams = Field(default_factory=GenerationParams)
    engine: EngineRequest = Field(default_factory=EngineRequest)
    outputs: OutputRequest = Field(default_factory=OutputRequest)
    constraint: ConstraintFiles = Field(default_factory=ConstraintFiles)
    verbosity: int = 0  # -1 quiet, 0 normal, 1 verbose

    def check(self) -> None:
        """The refusals that need no model file (exit 2), in the reference's order."""
        self.prompt.check()
        self.constraint.text()

    @classmethod
    def from_flags(cls, flags: Mapping[str, Any]) -> RunRequest:
        """Build from the command line's names (``gen``, ``stop_id``, ``prompt_file``...)."""
        f = dict(flags)
        take = _taker(f)
        prompt = {"text": take("prompt"), "file": take("prompt_file"), "ids": take("ids"),
                  "bos": bool(take("bos", False))}
        generation = {"max_tokens": take("gen", 8), "context": take("context"),
                      "temperature": take("temperature"),
                      "top_p": take("top_p"), "top_k": take("top_k"), "seed": take("seed"),
                      "stop": list(take("stop", []) or []),
                      "stop_ids": list(take("stop_id", []) or []),
                      "ignore_eos": bool(take("ignore_eos", False)),
                      "spec": take("spec"), "spec_width": take("spec_width"),
                      "spec_ngram": take("spec_ngram", 3)}
        # left out when not given, so a preset's spec keys can apply (spec_from_preset)
        generation = {k: v for k, v in generation.items()
                      if v is not None or k not in ("spec", "spec_width")}
        outputs = {k: take(k) for k in OutputRequest.model_fields}
        constraint = {k: take(k) for k in ConstraintFiles.model_fields}
        quiet, verbose = bool(take("quiet", False)), int(take("verbose", 0) or 0)
        verbosity = -1 if quiet else min(verbose, 2)
        engine = {k: take(k) for k in EngineRequest.options()}
        engine["verify_trunk"] = bool(engine["verify_trunk"])
        if f:
            raise UsageError(f"unknown run option(s): {', '.join(sorted(f))}")
        build(PromptInput, prompt).check()  # the reference refuses a prompt problem first
        return build(cls, {"engine": engine, "prompt": prompt, "generation": generation,
                           "outputs": outputs, "constraint": constraint, "verbosity": verbosity})

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def given(self) -> dict[str, Any]:
        """Only what the caller set (for printing: ``k3 run -v``)."""
        return self.model_dump(mode="json", exclude_defaults=True)


def build(model: type[M], data: Mapping[str, Any]) -> M:
    """Validate ``data`` into ``model``; a type error becomes one ``UsageError`` line."""
    try:
        return model.model_validate(dict(data))
    except ValidationError as exc:
        err = exc.errors(include_input=False, include_url=False)[0]
        where = ".".join(str(x) for x in err["loc"]) or "request"
        raise UsageError(f"{where}: {err['msg']}") from None


def _taker(f: dict[str, Any]) -> Callable[..., Any]:
    def take(name: str, default: object = None) -> object:
        v = f.pop(name, default)
        return default if v is None else v
    return take


def spec_from_preset(given: GenerationParams, params: GenerationParams,
                     preset: Preset | None) -> GenerationParams:
    """``params`` with the preset's ``spec``/``spec_width`` where the run did not give them
    (flag > preset > default, as for the engine settings)."""
    if preset is None:
        return params
    update = {k: getattr(preset, k) for k in ("spec", "spec_width")
              if k not in given.model_fields_set and getattr(preset, k, None) is not None}
    if not update:
        return params
    return build(GenerationParams, {**params.model_dump(), **update})
