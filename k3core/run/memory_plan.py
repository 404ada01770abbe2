"""The memory plan: every large buffer of a run, summed BEFORE anything large is allocated.

Rows (docs/engine-behaviours.md §3 item 5, plus what a Python process costs by itself):

=====================  ============================================================
trunk                  the ``--trunk-gb`` budget when streaming (never more than the
                       whole trunk), else the bytes of every bound layer
embed + lm_head        the model tables: lm_head and the three hidden-size vectors
                       (embedding rows are read per token id, the table is never
                       loaded); in ultra-low-memory mode one stream chunk, two
                       alignment pads and the three vectors
expert cache           the ``--cache-gb`` budget rounded down to whole slots (never
                       more than every expert of the model)
recurrent state        KDA state + conv history for every KDA layer run; one slot in
                       ultra-low-memory full recompute
buffers                activations and per-layer scratch for one forward pass: T =
                       prompt + gen + 1 positions, or one prefill chunk when T is longer
                       (the activations budget below), estimated from the model's widths;
                       and the transient expert buffers of one layer's visit (the union
                       of the pass's rows' experts, topk a row, at most every expert of
                       a layer and at most the cache's slots: a prompt's experts the
                       policy does not admit are read into buffers of their own)
KV cache               every mode: T x the latent KV bytes per position (kv_lora + qk_rope
                       float32 per MLA layer run); full recompute holds one too, for the
                       sequence it recomputes
prefix cache           a server's kept prompt-prefix states (``--prefix-cache-gb``)
=====================  ============================================================

A server decodes up to ``slots`` sequences at once (``k3 serve --max-batch``): each slot holds
its own recurrent state and a KV cache of T positions, and a batched pass's buffers hold a
prefill chunk beside up to ``INTERLEAVE_CHUNK`` rows of every other slot (newcomers' prompts
go in at most that many ids a pass) and the transient buffers of the experts its union
reads, so those three rows grow with the slots.
:func:`most_slots` is the most that fit.

=====================  ============================================================
python + libraries     this process's resident set when the plan is made (measured)
=====================  ============================================================

:meth:`MemoryPlan.check` refuses (``MemoryPlanError``, exit 1) when the total exceeds 95 %
of the memory available; :func:`check_kv` refuses (``UsageError``, exit 2) a request whose
KV cache alone exceeds 90 % of it, before anything else is computed. Sizes in messages are
decimal (1 GB = 10^9 bytes). The plan is a forecast; the run report quotes the measured peak.

Prefill chunk: a prompt is fed in chunks of at most :func:`prefill_chunk` ids (the most whose
buffers fit the activations budget, ``min(ACTIVATIONS_CAP, ACTIVATIONS_SHARE x available)``)
or ``--prefill-chunk N``; the logits are the one-pass logits bit for bit, and each routed
expert is read once per chunk.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import psutil

from k3core.api.errors import MemoryPlanError, UsageError, param
from k3core.api.units import ALIGN, human
from k3core.model.config import ModelConfig
from k3core.model.scheduler import INTERLEAVE_CHUNK
from k3core.model.sizes import ModelSizes, cache_slots, sizes_from_config, slot_bytes
from k3core.model.state import kv_bytes_per_position, recurrent_bytes_per_layer

#: bytes of lm_head read per chunk in ultra-low-memory mode
STREAM_CHUNK = 64 << 20
#: refuse when the plan exceeds this share of available memory
PLAN_LIMIT = 0.95
#: refuse when the KV cache alone exceeds this share of available memory
KV_LIMIT = 0.90
#: the activations (buffers row) of one prefill chunk: at most this many bytes ...
ACTIVATIONS_CAP = 2 * 10**9
#: ... and at most this share of the memory available
ACTIVATIONS_SHARE = 0.10


def available_bytes() -> int:
    """Memory the kernel says can be handed out now without swapping (MemAvailable)."""
    return int(psutil.virtual_memory().available)


def total_bytes() -> int:
    return int(psutil.virtual_memory().total)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far, in bytes."""
    if sys.platform == "win32":  # pragma: no cover - exercised on Windows only
        import psutil

        return int(getattr(psutil.Process().memory_info(), "peak_wset", 0))
    import resource

    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(kb) * (1 if sys.platform == "darwin" else 1024)


def process_rss() -> int:
    """This interpreter's resident set right now (Python, NumPy, the imported libraries)."""
    return int(psutil.Process().memory_info().rss)


@dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """The planned bytes of one run and the memory available when it was planned."""

    trunk: int
    tables: int
    expert_cache: int
    recurrent: int
    buffers: int
    kv_cache: int
    baseline: int
    available: int
    streamed: bool = True
    ultra: bool = False
    positions: int = 0
    cache_slots: int | None = None
    #: sequences decoding at once (each with its KV cache and recurrent state)
    slots: int = 1
    prefix_cache: int = 0
    #: what one more slot adds: its KV cache, its recurrent state, its rows of a pass
    per_slot: int = 0
    notes: list[str] = field(default_factory=list)
    #: ids per forward pass of a prompt (longer prompts go in chunks of this many)
    prefill_chunk: int = 0

    @property
    def total(self) -> int:
        return (self.trunk + self.tables + self.expert_cache + self.recurrent + self.buffers
                + self.kv_cache + self.prefix_cache + self.baseline)

    def rows(self) -> list[tuple[str, int]]:
        """``(label, bytes)`` for the seven rows (eight with a prefix cache), then ``TOTAL``;
        with several slots the per-sequence rows say so."""
        trunk = "trunk (STREAMED)" if self.streamed else "trunk (resident)"
        tables = "embed + lm_head (STREAMED)" if self.ultra else "embed + lm_head"
        each = f" ({self.slots} slots)" if self.slots > 1 else ""
        rows = [
            (trunk, self.trunk),
            (tables, self.tables),
            ("expert cache", self.expert_cache),
            (f"recurrent state{each}", self.recurrent),
            ("buffers", self.buffers),
            (f"KV cache{each}", self.kv_cache),
        ]
        if self.prefix_cache:
            rows.append(("prefix cache", self.prefix_cache))
        return rows + [("python + libraries", self.baseline), ("TOTAL", self.total)]

    def lines(self) -> list[str]:
        """The ``memory plan`` block as the run report prints it."""
        out = ["memory plan"]
        out += [f"  {label:<28}{human(n):>12}" for label, n in self.rows()]
        out.append(f"  {'available':<28}{human(self.available):>12}")
        return out

    def fits(self) -> bool:
        return self.total <= PLAN_LIMIT * self.available

    def check(self) -> None:
        """Refuse (exit 1) when the plan exceeds 95 % of the memory available."""
        if self.fits():
            return
        short = self.total - self.available
        shortfall = (f"a shortfall of {human(short)}" if short > 0 else
                     f"over the {PLAN_LIMIT:.0%} safety line by "
                     f"{human(self.total - PLAN_LIMIT * self.available)}")
        raise MemoryPlanError(
            f"REFUSING TO START: this needs {human(self.total)} and the machine has "
            f"{human(self.available)} available, {shortfall}. Options: a larger box, a smaller "
            f"{param('cache_gb')} or {param('trunk_gb')} (or a smaller {param('preset')}), or "
            f"fewer {param('layers')}." + (
                f" The {self.slots} slots' KV caches and recurrent state take "
                f"{human(self.kv_cache + self.recurrent)}: a smaller --max-batch or --context."
                if self.slots > 1 else "")
        )


def check_kv(cfg: ModelConfig, positions: int, available: int | None = None,
             n_layers: int | None = None) -> int:
    """Refuse (exit 2) a request whose KV cache alone exceeds 90 % of available memory.

    Returns the KV bytes. ``positions`` is prompt + gen + 1.
    """
    kv = kv_bytes(cfg, positions, n_layers)
    avail = available_bytes() if available is None else available
    if kv > KV_LIMIT * avail:
        raise UsageError(
            f"the KV cache for {positions} positions needs {human(kv)} "
            f"({kv_bytes(cfg, 1, n_layers) / 1e6:.2f} MB/position) and the machine has "
            f"{human(avail)} available: this is a memory limit, not an engine ceiling; ask for a "
            f"shorter request (fewer prompt tokens or a smaller {param('max_tokens')}); every "
            "decoding mode, full recompute included, holds this latent cache"
        )
    return kv


def kv_bytes(cfg: ModelConfig, positions: int, n_layers: int | None = None) -> int:
    """Latent fp32 KV bytes for ``positions`` over the MLA layers among those run."""
    if n_layers is None or n_layers >= cfg.n_layers:
        return positions * kv_bytes_per_position(cfg)
    n_mla = sum(1 for L in range(n_layers) if cfg.is_mla(L))
    per_layer = kv_bytes_per_position(cfg) // max(cfg.n_mla, 1)
    return positions * per_layer * n_mla


def buffer_bytes(cfg: ModelConfig, positions: int, n_layers: int | None = None) -> int:
    """Activations and per-layer scratch for ``positions`` tokens (an estimate).

    The reference's shape, ``(T*hidden + T*maxb*hidden + scratch(T) + vocab) * 4``, with
    ``maxb`` = AttnRes blocks + 2 and scratch(T) the widest layer's per-token temporaries
    (KDA projections, the MLA latent row, query and head outputs, the MLP intermediates)
    times two for the kernels' own temporaries.
    """
    c = cfg
    T = positions
    L = n_layers or c.n_layers
    maxb = L // max(c.attn_res_block, 1) + 2
    P = c.kda_heads * c.kda_head_dim
    kda = 6 * P + c.kda_heads + c.kda_head_dim
    # projections, the latent row, the query and the per-head outputs (absorbed attention
    # never expands keys or values per head)
    mla = c.q_lora + 2 * (c.kv_lora + c.qk_rope) + c.n_heads * (c.qk_nope + c.qk_rope + 2 * c.v_head)
    mlp = max(3 * c.dense_inter,
              c.n_experts + c.topk * (c.latent + 2 * c.moe_inter) + 3 * c.n_shared * c.moe_inter)
    scratch = 2 * T * max(kda, mla, mlp)
    return 4 * (T * c.hidden + T * maxb * c.hidden + scratch + c.vocab)


def transient_expert_bytes(n_experts: int, topk: int, expert_bytes: int, rows: int,
                           cache_slots: int | None = None) -> int:
    """Buffers of the routed experts a pass of ``rows`` rows reads outside the cache's slots.

    A layer's visit asks for the union of its rows' experts (``topk`` a row, at most the
    layer's ``n_experts``); one the policy does not admit (a prompt's one-off experts) is read
    into a buffer of its own, alive until the visit is served, and a visit serves at most as
    many experts at once as the cache has slots (``k3core/experts/cache.py``). ``cache_slots``
    None: the cache is not sized yet (the bound is the union alone)."""
    if expert_bytes <= 0 or rows <= 0:
        return 0
    most = min(n_experts, rows * topk)
    if cache_slots is not None:
        most = min(most, cache_slots)
    return most * slot_bytes(expert_bytes)


def prefill_chunk(cfg: ModelConfig, available: int, n_layers: int | None = None) -> int:
    """The most ids one forward pass may take: their buffers (:func:`buffer_bytes`) fit the
    activations budget ``min(ACTIVATIONS_CAP, ACTIVATIONS_SHARE x available)``; at least 1."""
    budget = min(ACTIVATIONS_CAP, int(ACTIVATIONS_SHARE * max(available, 0)))
    base = buffer_bytes(cfg, 0, n_layers)
    per_id = buffer_bytes(cfg, 1, n_layers) - base  # buffer_bytes is linear in the positions
    return max(1, (budget - base) // max(per_id, 1))


@dataclass(frozen=True, kw_only=True)
class MemoryRequest:
    """The shape of a run the plan sums: budgets, positions, decoding mode."""

    streamed: bool
    cache_bytes: int
    prompt_len: int
    gen: int
    incremental: bool
    n_layers: int | None = None
    trunk_budget: int | None = None
    trunk_bytes_resident: int | None = None
    ultra: bool = False
    stream_chunk: int = STREAM_CHUNK
    #: ``--prefill-chunk``: ids per forward pass (None: the activations budget decides)
    prefill_chunk: int | None = None
    #: sequences decoding at once (``k3 serve --max-batch``)
    slots: int = 1
    #: bytes of kept prompt-prefix states (``k3 serve --prefix-cache-gb``)
    prefix_cache: int = 0


def plan_memory(
    cfg: ModelConfig,
    req: MemoryRequest,
    *,
    sizes: ModelSizes | None = None,
    expert_bytes: int | None = None,
    baseline: int | None = None,
    available: int | None = None,
) -> MemoryPlan:
    """Sum every buffer of a run.

    ``req.streamed`` runs need ``req.trunk_budget`` (bytes of pinned layers + ring);
    resident runs take ``trunk_bytes_resident`` or, when omitted, the planned bytes of the layers run.
    ``sizes`` defaults to :func:`sizes_from_config`; ``expert_bytes`` overrides its expert size
    (slots are rounded down to whole ones). ``baseline`` defaults to this process's RSS and
    ``available`` to MemAvailable: tests inject both.
    """
    streamed, cache_bytes, prompt_len, gen = req.streamed, req.cache_bytes, req.prompt_len, req.gen
    incremental, n_layers, ultra = req.incremental, req.n_layers, req.ultra
    trunk_budget, trunk_bytes_resident = req.trunk_budget, req.trunk_bytes_resident
    if prompt_len < 0 or gen < 0 or cache_bytes < 0:
        raise UsageError(f"prompt length, {param('max_tokens')} and {param('cache_gb')} must "
                         "not be negative")
    L = cfg.n_layers if n_layers is None else n_layers
    if not 1 <= L <= cfg.n_layers:
        raise UsageError(f"{param('layers')} must be in 1..{cfg.n_layers}, got {L}")
    sz = (sizes or sizes_from_config(cfg)).first(L)
    notes: list[str] = []
    whole = sz.trunk_bytes
    if streamed:
        if trunk_budget is None or trunk_budget < 0:
            raise UsageError(f"a streamed trunk needs a non-negative trunk budget "
                             f"({param('trunk_gb')})")
        trunk = min(trunk_budget, whole + ALIGN * L)
        if trunk < trunk_budget:
            notes.append(f"trunk budget {human(trunk_budget)} exceeds the whole trunk; planning "
                         f"{human(trunk)}")
    else:
        trunk = whole if trunk_bytes_resident is None else trunk_bytes_resident
    E = cfg.hidden
    if ultra:
        tables = min(req.stream_chunk, sz.tables_bytes) + 2 * ALIGN + 3 * E * 4
    else:  # the embedding is gathered a row at a time (ModelTables with a row reader)
        tables = sz.tables_bytes - cfg.vocab * sz.embed_row_bytes
    expert = sz.expert_bytes if expert_bytes is None else expert_bytes
    cache, slots = cache_bytes, None
    if expert > 0:
        slots = cache_slots(cache_bytes, expert, sz.n_experts * sz.n_moe_layers)
        cache = slots * slot_bytes(expert)
    n_kda = sum(1 for i in range(L) if not cfg.is_mla(i))
    per_layer = recurrent_bytes_per_layer(cfg)
    recurrent = per_layer * (min(n_kda, 1) if ultra and not incremental else n_kda)
    if req.prefill_chunk is not None and req.prefill_chunk < 1:
        raise UsageError(f"{param('prefill_chunk')} must be >= 1, got {req.prefill_chunk}")
    avail = available_bytes() if available is None else available
    chunk = req.prefill_chunk or prefill_chunk(cfg, avail, L)
    T = prompt_len + gen + 1
    n_slots = req.slots
    if n_slots < 1 or req.prefix_cache < 0:
        raise UsageError(f"the batch must be at least 1 (got {n_slots}) and the prefix cache "
                         f"not negative")
    kv = kv_bytes(cfg, T, L) * n_slots  # full recompute holds one for the sequence it recomputes
    if T > chunk:
        notes.append(f"the prompt goes in chunks of {chunk} ids (buffers for one chunk)")
    # one pass may hold a chunk of one sequence's prompt and every other slot's rows: a
    # decode step's one, or a newcomer's prompt in chunks of the scheduler's interleave
    rows = min(T, chunk) + (n_slots - 1) * min(T, INTERLEAVE_CHUNK)

    def transient(rows: int) -> int:
        return transient_expert_bytes(sz.n_experts, sz.topk, expert, rows, slots or 0)

    return MemoryPlan(
        trunk=trunk,
        tables=tables,
        expert_cache=cache,
        recurrent=recurrent * n_slots,
        buffers=buffer_bytes(cfg, rows, L) + transient(rows),
        kv_cache=kv,
        slots=n_slots,
        prefix_cache=req.prefix_cache,
        per_slot=(kv // n_slots + recurrent
                  + buffer_bytes(cfg, rows + min(T, INTERLEAVE_CHUNK), L) - buffer_bytes(cfg, rows, L)
                  + transient(rows + min(T, INTERLEAVE_CHUNK)) - transient(rows)),
        baseline=process_rss() if baseline is None else baseline,
        available=avail,
        streamed=streamed,
        ultra=ultra,
        positions=T,
        cache_slots=slots,
        notes=notes,
        prefill_chunk=chunk,
    )


def most_slots(plan: MemoryPlan, most: int) -> int:
    """The most slots (at most ``most``, at least 1) whose KV caches, recurrent states and
    rows of a pass (``plan.per_slot`` each) fit beside the rest of ``plan`` under the 95 %
    line."""
    room = PLAN_LIMIT * plan.available - plan.total
    extra = int(room // plan.per_slot) if plan.per_slot > 0 else most
    return max(1, min(most, plan.slots + extra))
