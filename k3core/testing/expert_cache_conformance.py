"""Conformance suite for the routed-expert cache (:mod:`k3core.experts.cache`) under a policy.

A cache-policy plugin proves it never changes a byte the MoE sees with one subclass::

    from k3.testing import ExpertCacheConformance

    class TestMinePolicyInTheCache(ExpertCacheConformance):
        policy_name = "mine"

Every check runs under every storage backend that can run here (``direct``, ``mmap``,
``plain``, ...) and compares each expert the cache hands to ``use`` with the bytes read
straight from the shard by this module's own header parser (:class:`ShardTruth`, plain
``open``/``seek``/``read``, nothing of k3's reader), tensor by tensor:

* the cache fixture shard, written on the fly (:func:`cache_fixture`: 24 experts of 1,632
  bytes, a size that is a multiple of no block; every byte derived from the expert index, so
  a slot holding the wrong expert or a torn read shows) under eviction pressure: ``top-k + 1``
  slots and a few more;
* a synthetic model's real layout (:func:`model_cache`), and the same model re-laid so its
  experts' six tensors are scattered, with gaps, and one expert split across two shards
  (:func:`scatter_experts`): read tensor by tensor;
* prefill-sized visits whose distinct experts outnumber the slots (served in several batches,
  each expert used exactly once per visit);
* honest metrics: nothing is a *hit* in the step that read it (an earlier batch's or the
  prefetcher's read is *reuse*), and ``requests == hits + misses + reuse``;
* an expert the policy declines is served from a transient buffer and not retained;
* a policy answering an invalid victim is refused (:class:`~k3core.api.errors.PluginError`) and
  leaves no slot reserved without its bytes.

Helpers are importable on their own: :class:`ShardTruth`, :func:`write_shard`,
:func:`scatter_experts`, :func:`fixture_cache`, :func:`model_cache`, :func:`drive`,
:func:`visits_of`, :class:`ScriptedPolicy`.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable, Container, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from k3core.api.cache_policy import CachePolicy, key_expert, key_layer, make_key
from k3core.api.errors import PluginError
from k3core.api.experts import ExpertWeights
from k3core.api.kernels import Mxfp4
from k3core.api.storage import StorageBackend
from k3core.checkpoint.index import INDEX_NAME, CheckpointIndex
from k3core.experts.cache import ExpertCache
from k3core.experts.locator import ExpertLocator
from k3core.experts.simulator import TraceView
from k3core.model import names
from k3core.model.config import ModelConfig, load_config
from k3core.plugins.registry import get_registry
from k3core.testing.faulty_backend import available_storage
from k3core.testing.threads import thread_errors_fail

FIXTURE_SHARD = "model-00001-of-00001.safetensors"
#: the cache fixture: layer 0, experts 0..23, each w1/w2/w3 an MXFP4 [8, 128] matrix
FIXTURE_EXPERTS, FIXTURE_ROWS, FIXTURE_COLS = 24, 8, 128
FIXTURE_TOPK = 4
#: the fixture's header length: its data start 20,608 bytes in, a multiple of no block size
FIXTURE_HEADER = 20600

Bytes = dict[str, bytes]  # "w1.weight_packed" -> the tensor's bytes


# ---- ground truth, read without k3's reader ---------------------------------------------------
class ShardTruth:
    """Every tensor of a model directory, by name: ``(shard, absolute offset, nbytes, entry)``."""

    def __init__(self, model_dir: Path):
        self.where: dict[str, tuple[Path, int, int, dict[str, Any]]] = {}
        for shard in sorted(Path(model_dir).glob("*.safetensors")):
            with open(shard, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                a, b = entry["data_offsets"]
                self.where[name] = (shard, 8 + n + a, b - a, entry)

    def read(self, name: str) -> bytes:
        path, off, n, _ = self.where[name]
        with open(path, "rb") as f:
            f.seek(off)
            data = f.read(n)
        assert len(data) == n, f"{path} is shorter than its header says"
        return data

    def expert(self, layer: int, expert: int) -> Bytes:
        out = {}
        for part in names.EXPERT_PARTS:
            for fld in ("weight_packed", "weight_scale"):
                out[f"{part}.{fld}"] = self.read(names.expert_name(layer, expert, part, fld))
        return out


def served_bytes(w: ExpertWeights) -> Bytes:
    """The bytes of each tensor ``use`` was handed, copied out of the slot."""
    out: Bytes = {}
    for part in ("w1", "w2", "w3"):
        m = getattr(w, part)
        assert isinstance(m, Mxfp4), f"{part} is not MXFP4"
        out[f"{part}.weight_packed"] = m.packed.tobytes()
        out[f"{part}.weight_scale"] = m.scales.tobytes()
    return out


# ---- layouts --------------------------------------------------------------------------------
def write_shard(path: Path, tensors: Sequence[tuple[str, dict[str, Any], bytes]], gap: int = 0,
                header_size: int = 0) -> None:
    """A safetensors shard with the tensors in the given order (``(name, entry, bytes)``), each
    followed by ``gap`` filler bytes, so a layout the ``safetensors`` package never writes
    (it sorts by name) can be tested. ``entry`` gives ``dtype`` and ``shape``; the header is
    padded with spaces to ``header_size`` bytes when it is shorter."""
    header: dict[str, Any] = {}
    pos = 0
    for name, entry, data in tensors:
        header[name] = {"dtype": entry["dtype"], "shape": entry["shape"],
                        "data_offsets": [pos, pos + len(data)]}
        pos += len(data) + gap
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    raw += b" " * max(0, header_size - len(raw))
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _, _, data in tensors:
            f.write(data + b"\x5a" * gap)


def scatter_experts(src: Path, dst: Path, *, gap: int = 100, split: tuple[int, int] | None = (1, 0)) -> Path:
    """Copy model ``src`` to ``dst`` with every MoE shard rewritten so no expert is contiguous.

    Tensors are ordered by field, then matrix, then expert (all ``w1.weight_packed`` first),
    with ``gap`` filler bytes after each; ``split = (layer, expert)`` moves that expert's
    ``w2`` tensors into a shard of their own (updating the index), so it straddles two files.
    """
    shutil.copytree(src, dst)
    truth = ShardTruth(dst)
    index = json.loads((dst / INDEX_NAME).read_text())
    by_shard: dict[Path, list[str]] = {}
    for name, (path, *_rest) in truth.where.items():
        by_shard.setdefault(path, []).append(name)
    moved: list[tuple[str, dict[str, Any], bytes]] = []
    for path, tensor_names in by_shard.items():
        if not any(".experts." in n for n in tensor_names):
            continue

        def order(n: str) -> tuple[Any, ...]:
            parsed = names.split_layer_name(n)
            m = names.EXPERT_RE.match(parsed[1]) if parsed else None
            if m is None:
                return (0, n)
            return (1, m.group(3), m.group(2), int(m.group(1)))

        keep: list[tuple[str, dict[str, Any], bytes]] = []
        split_prefix = (names.layer_name(split[0], f"block_sparse_moe.experts.{split[1]}.w2.")
                        if split is not None else None)
        for n in sorted(tensor_names, key=order):
            item = (n, truth.where[n][3], truth.read(n))
            (moved if split_prefix and n.startswith(split_prefix) else keep).append(item)
        write_shard(path, keep, gap)
    if moved:
        extra = "model-extra-w2.safetensors"
        write_shard(dst / extra, moved, gap)
        for n, _, _ in moved:
            index["weight_map"][n] = extra
        (dst / INDEX_NAME).write_text(json.dumps(index, indent=1, sort_keys=True))
    return dst


# ---- caches to test -------------------------------------------------------------------------
class UniformLocator(ExpertLocator):
    """The fixture shard's layout: all three matrices MXFP4 ``[rows, cols]`` (the fixture's
    ``w2`` has the same shape as ``w1``, unlike a real model's ``[latent, inter]``)."""

    def __init__(self, index: CheckpointIndex, n_experts: int, rows: int, cols: int):
        cfg = SimpleNamespace(latent=cols, moe_inter=rows, n_experts=n_experts,
                              is_dense=lambda layer: False)
        super().__init__(cfg, index)  # type: ignore[arg-type]
        self.logical = {p: (rows, cols) for p in ("w1", "w2", "w3")}


@dataclass
class Rig:
    """A cache under test with what checks it: the truth and every served expert."""

    cache: ExpertCache
    index: CheckpointIndex
    truth: ShardTruth
    policy: CachePolicy
    topk: int
    served: list[tuple[int, int, int]] = field(default_factory=list)  # (step, layer, expert)

    def close(self) -> None:
        self.cache.close()
        self.index.close()


PolicyMaker = str | Callable[..., CachePolicy]  # a registered name, or a factory (a class)


def make_policy(name: PolicyMaker, capacity: int, *, n_layers: int, n_experts: int, topk: int,
                trace: np.ndarray | None = None) -> CachePolicy:
    """A policy (registered ``name``, or built by the factory ``name``) with the options the
    engine passes (``trace`` for trace-driven policies)."""
    opts: dict[str, Any] = {"n_layers": n_layers, "n_experts": n_experts, "topk": topk}
    if trace is not None:
        opts["trace"] = trace
    if not isinstance(name, str):
        return name(capacity=capacity, **opts)
    policy, _, _ = get_registry().create("cache", name, capacity=capacity, **opts)
    return policy


def make_storage(name: str) -> StorageBackend:
    storage, _, _ = get_registry().create("storage", name)
    return storage


def fixture_bytes(expert: int, tensor: int, n: int) -> bytes:
    """Byte ``k`` of tensor ``tensor`` (0..5) of expert ``expert``: distinct for every expert
    at every position (53 is odd) and shifting along the tensor, so a slot holding another
    expert, or a read landing a few bytes off, shows."""
    k = np.arange(n, dtype=np.int64)
    return ((expert * 53 + tensor * 31 + k * 7 + k // 256) % 256).astype(np.uint8).tobytes()


def cache_fixture(d: Path) -> Path:
    """Write the cache fixture shard into directory ``d`` (unless it is there); returns ``d``.

    One layer of 24 experts, each ``w1``/``w2``/``w3`` an MXFP4 ``[8, 128]`` matrix (packed
    ``[8, 64]`` and scales ``[8, 4]``): 1,632 bytes an expert, a size that is a multiple of
    no block, after a header that leaves the data at an offset that is one neither."""
    shard = d / FIXTURE_SHARD
    if shard.exists():
        return d
    d.mkdir(parents=True, exist_ok=True)
    tensors: list[tuple[str, dict[str, Any], bytes]] = []
    for e in range(FIXTURE_EXPERTS):
        for p, part in enumerate(names.EXPERT_PARTS):
            for f, (fld, cols) in enumerate((("weight_packed", FIXTURE_COLS // 2),
                                             ("weight_scale", FIXTURE_COLS // 32))):
                data = fixture_bytes(e, 2 * p + f, FIXTURE_ROWS * cols)
                tensors.append((names.expert_name(0, e, part, fld),
                                {"dtype": "U8", "shape": [FIXTURE_ROWS, cols]}, data))
    tmp = d / (FIXTURE_SHARD + ".partial")
    write_shard(tmp, tensors, header_size=FIXTURE_HEADER)
    tmp.replace(shard)
    return d


def fixture_cache(workdir: Path, storage: StorageBackend, policy: CachePolicy | PolicyMaker, slots: int, *,
                  readers: int = 4, trace: np.ndarray | None = None) -> Rig:
    """An :class:`ExpertCache` over the cache fixture (:func:`cache_fixture`) in ``workdir``."""
    d = cache_fixture(workdir / "cache-fixture")
    index = CheckpointIndex.open(d, storage)
    locator = UniformLocator(index, FIXTURE_EXPERTS, FIXTURE_ROWS, FIXTURE_COLS)
    if not isinstance(policy, CachePolicy):
        policy = make_policy(policy, slots, n_layers=1, n_experts=FIXTURE_EXPERTS,
                             topk=FIXTURE_TOPK, trace=trace)
    cache = ExpertCache(index, locator, policy, slots, locator.max_bytes(range(1)), readers=readers)
    return Rig(cache, index, ShardTruth(d), policy, FIXTURE_TOPK)


def model_cache(model_dir: Path, storage: StorageBackend, policy: CachePolicy | PolicyMaker, slots: int, *,
                readers: int = 4, trace: np.ndarray | None = None) -> Rig:
    """An :class:`ExpertCache` over a model directory's routed experts (the real locator)."""
    cfg: ModelConfig = load_config(model_dir)
    index = CheckpointIndex.open(model_dir, storage)
    locator = ExpertLocator(cfg, index)
    if not isinstance(policy, CachePolicy):
        policy = make_policy(policy, slots, n_layers=cfg.n_layers, n_experts=cfg.n_experts,
                             topk=cfg.topk, trace=trace)
    cache = ExpertCache(index, locator, policy, slots, locator.max_bytes(range(cfg.n_layers)),
                        readers=readers)
    return Rig(cache, index, ShardTruth(model_dir), policy, cfg.topk)


# ---- driving it ------------------------------------------------------------------------------
def visits_of(pairs: np.ndarray) -> list[list[tuple[int, list[int]]]]:
    """A trace as passes of layer visits ``[(layer, requests), ...]`` (as the engine makes them)."""
    view = TraceView.of(pairs)
    passes: list[list[tuple[int, list[int]]]] = []
    for start, end, layer, new_pass in view.visits:
        if new_pass:
            passes.append([])
        passes[-1].append((layer, [int(e) for e in pairs[start:end, 1]]))
    return passes


def drive(rig: Rig, passes: Sequence[Sequence[tuple[int, Sequence[int]]]], *,
          prefetch: bool = True, check: bool = True) -> None:
    """Run the passes through the cache as the MoE does (``begin_step``, ``prefetch`` when the
    routing is known, ``run_layer``), checking every expert handed to ``use``: its bytes equal
    the shard's, it was requested, and it is used once per visit."""
    for visits in passes:
        rig.cache.begin_step()
        for layer, requests in visits:
            used: list[int] = []

            def use(e: int, w: ExpertWeights, layer: int = layer, used: list[int] = used) -> None:
                used.append(e)
                rig.served.append((rig.cache.step, layer, e))
                if check:
                    got = served_bytes(w)
                    want = rig.truth.expert(layer, e)
                    bad = [k for k in want if got[k] != want[k]]
                    assert not bad, f"expert {layer}/{e} served wrong bytes in {bad}"

            if prefetch:
                rig.cache.prefetch(layer, list(requests))
            rig.cache.run_layer(layer, list(requests), use)
            assert sorted(used) == sorted(set(int(e) for e in requests)), (
                f"layer {layer}: use() called for {sorted(used)}, requests {sorted(set(requests))}")


def check_resident(rig: Rig) -> None:
    """Every slot the cache holds a key for has exactly that expert's bytes."""
    c = rig.cache
    assert len(c.slot_of) <= c.capacity, f"{len(c.slot_of)} experts resident in {c.capacity} slots"
    for key, slot in c.slot_of.items():
        assert c.key_of[slot] == key, f"slot {slot} is listed for {key:#x} but holds {c.key_of[slot]!r}"
        assert key in c.published, f"slot {slot} holds key {key:#x} whose read never completed"
        ref = c.locator.ref(key_layer(key), key_expert(key))
        got = served_bytes(c.locator.views(ref, c._slot_buf(slot, ref)))
        assert got == rig.truth.expert(key_layer(key), key_expert(key)), f"slot {slot} ({key:#x}) is stale"


def fixture_trace(steps: int, positions: int, seed: int, topk: int = FIXTURE_TOPK) -> np.ndarray:
    """Layer-0 requests: ``steps`` visits of ``positions`` rows of ``topk`` distinct experts,
    skewed so some experts come back and others churn."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, FIXTURE_EXPERTS + 1) ** 0.8
    p = p / p.sum()
    rows = []
    for _ in range(steps * positions):
        rows.append(rng.choice(FIXTURE_EXPERTS, size=topk, replace=False, p=p))
    e = np.concatenate(rows)
    return np.stack([np.zeros_like(e), e], axis=1).astype(np.int32)


class ScriptedPolicy(CachePolicy):
    """Wraps a policy; can decline chosen keys or answer a bad victim once (tests only)."""

    name = "scripted"

    def __init__(self, inner: CachePolicy, *, decline: Container[int] = (), admit_all: bool = False):
        super().__init__(inner.capacity, n_layers=inner.n_layers, n_experts=inner.n_experts)
        self.inner = inner
        self.decline = decline
        self.admit_all = admit_all  # keep every miss the inner policy would bypass
        #: answer ``bad_victim(protected)`` instead, once, after ``bad_after`` good answers
        self.bad_victim: Callable[[Container[int]], int | None] | None = None
        self.bad_after = 0
        self.resident: set[int] = set()

    def begin_token(self) -> None:
        self.inner.begin_token()

    def begin_layer(self, layer: int, keys: Sequence[int]) -> None:
        self.inner.begin_layer(layer, keys)

    def on_hit(self, key: int) -> None:
        self.inner.on_hit(key)

    def admit(self, key: int, protected: Container[int]) -> bool:
        ok = self.inner.admit(key, protected) or self.admit_all
        return ok and key not in self.decline

    def choose_victim(self, protected: Container[int]) -> int | None:
        if self.bad_victim is not None:
            if self.bad_after <= 0:
                bad, self.bad_victim = self.bad_victim(protected), None
                return bad
            self.bad_after -= 1
        return self.inner.choose_victim(protected)

    def on_insert(self, key: int) -> None:
        self.resident.add(key)
        self.inner.on_insert(key)

    def on_evict(self, key: int) -> None:
        self.resident.discard(key)
        self.inner.on_evict(key)


# ---- the suite ------------------------------------------------------------------------------
def _storage_params() -> list[str]:
    return available_storage()


class ExpertCacheConformance:
    """Subclass with ``policy_name = "..."`` (a registered cache policy) or ``factory = MyPolicy``
    (called with ``capacity=`` and the engine's options)."""

    policy_name: str = "lru"
    factory: Callable[..., CachePolicy] | None = None

    @property
    def policy(self) -> PolicyMaker:
        return self.factory if self.factory is not None else self.policy_name
    #: shared by the suite: a tiny model with 32 experts top-4 (12 MoE layers)
    model_overrides: dict[str, Any] = {"num_experts": 32, "num_experts_per_token": 4}

    @pytest.fixture(autouse=True)
    def _thread_errors_fail(self) -> Iterator[None]:
        """An exception in a thread the plugin started fails the test (never only a warning)."""
        with thread_errors_fail():
            yield

    @pytest.fixture(params=_storage_params())
    def storage(self, request: pytest.FixtureRequest) -> StorageBackend:
        return make_storage(request.param)

    @pytest.fixture(scope="class")
    @classmethod
    def workdir(cls) -> Iterator[Path]:
        from k3core.testing.disk import disk_tmpdir

        with disk_tmpdir("k3-cache-conf-") as d:
            yield d

    @pytest.fixture(scope="class")
    @classmethod
    def model(cls, workdir: Path) -> Path:
        from k3core.model.shapes import size_config
        from k3core.tools.synth.writer import synthesize

        cfg = ModelConfig.from_json_dict(size_config("tiny", cls.model_overrides))
        return synthesize(workdir / "tiny", cfg, 3)

    @pytest.fixture(scope="class")
    @classmethod
    def scattered(cls, model: Path, workdir: Path) -> Path:
        return scatter_experts(model, workdir / "tiny-scattered")

    def _fixture_rig(self, workdir: Path, storage: StorageBackend, slots: int, pairs: np.ndarray,
                     **kw: Any) -> Rig:
        return fixture_cache(workdir, storage, self.policy, slots, trace=pairs, **kw)

    # -- exact bytes -------------------------------------------------------------------------
    @pytest.mark.parametrize("slots", [FIXTURE_TOPK + 1, 9])
    def test_fixture_bytes_exact_under_eviction(self, workdir: Path, storage: StorageBackend, slots: int) -> None:
        pairs = fixture_trace(30, 1, seed=slots)
        rig = self._fixture_rig(workdir, storage, slots, pairs)
        try:
            drive(rig, visits_of(pairs))
            st = rig.cache.stats
            # under pressure: experts were evicted or, where the policy declined them, not kept
            assert st.evictions + st.extra["transient"] > 0 and st.drops == 0, (
                f"under pressure: {st.evictions} evictions, {st.extra['transient']} transient, "
                f"{st.drops} drops (expected evictions or transients, and no drops)")
            assert st.requests == len(pairs), f"{st.requests} requests counted, {len(pairs)} made"
            check_resident(rig)
        finally:
            rig.close()

    def test_model_bytes_exact_under_eviction(self, model: Path, storage: StorageBackend) -> None:
        from k3core.testing.synthetic_trace import incremental_trace

        pairs = incremental_trace(12, 32, 4, 6, prompt=3, skew=0.7, seed=4)
        rig = model_cache(model, storage, self.policy, 9, trace=pairs)
        try:
            assert rig.cache.locator.ref(1, 0).contiguous, "the model's expert 1/0 is not contiguous"
            drive(rig, visits_of(pairs))
            st = rig.cache.stats
            assert st.evictions + st.extra["transient"] > 0 and st.drops == 0, (
                f"under pressure: {st.evictions} evictions, {st.extra['transient']} transient, "
                f"{st.drops} drops (expected evictions or transients, and no drops)")
            check_resident(rig)
        finally:
            rig.close()

    def test_scattered_experts_read_per_tensor(self, scattered: Path, storage: StorageBackend) -> None:
        from k3core.testing.synthetic_trace import incremental_trace

        pairs = incremental_trace(12, 32, 4, 5, prompt=2, skew=0.5, seed=6)
        pairs = np.concatenate([np.asarray([[1, 0], [1, 1], [1, 2], [1, 3]], dtype=np.int32), pairs])
        rig = model_cache(scattered, storage, self.policy, 5, trace=pairs)
        try:
            ref = rig.cache.locator.ref(1, 0)
            assert not ref.contiguous and len({p.path for p in ref.parts}) == 2, (
                "the scattered model's expert 1/0 is not split across two shards")
            assert not rig.cache.locator.ref(2, 5).contiguous, "expert 2/5 is not scattered"
            drive(rig, visits_of(pairs))
            st = rig.cache.stats
            assert st.evictions + st.extra["transient"] > 0, (
                f"5 slots, yet {st.evictions} evictions and {st.extra['transient']} transients")
            check_resident(rig)
        finally:
            rig.close()

    # -- batches bigger than the cache -------------------------------------------------------
    def test_prefill_visits_larger_than_the_cache(self, workdir: Path, storage: StorageBackend) -> None:
        pairs = fixture_trace(4, 12, seed=11)  # 48 requests per visit over 24 experts
        slots = FIXTURE_TOPK + 1
        rig = self._fixture_rig(workdir, storage, slots, pairs)
        try:
            passes = visits_of(pairs)
            assert all(len(set(reqs)) > slots for visits in passes for _, reqs in visits), (
                "a visit of the trace fits in the cache (the test needs bigger ones)")
            drive(rig, passes, prefetch=True)
            drive(rig, passes, prefetch=False)
            st = rig.cache.stats
            assert st.requests == st.hits + st.misses + st.extra["reuse"], (
                f"{st.requests} requests but {st.hits} hits + {st.misses} misses + "
                f"{st.extra['reuse']} reuse")
            check_resident(rig)
        finally:
            rig.close()

    # -- honest metrics ----------------------------------------------------------------------
    def test_reads_of_this_step_are_reuse_not_hits(self, workdir: Path, storage: StorageBackend) -> None:
        first = [0, 1, 2, 3, 4, 5, 6, 0, 1, 7, 2, 8]  # 9 distinct, repeats across batches
        pairs = np.asarray([(0, e) for e in first + first], dtype=np.int32)
        rig = self._fixture_rig(workdir, storage, 6, pairs)
        try:
            st = rig.cache.stats
            drive(rig, [[(0, first)]])
            assert st.hits == 0, "nothing resident before the first step can be a hit"
            assert (st.misses, st.extra["reuse"]) == (9, 3), (
                f"9 distinct experts, 3 asked again: {st.misses} misses and "
                f"{st.extra['reuse']} reuse counted")
            want_bytes = 9 * rig.cache.locator.ref(0, 0).nbytes
            assert st.bytes_read == want_bytes, f"{st.bytes_read} bytes read, 9 experts are {want_bytes}"
            resident_before = set(rig.cache.slot_of)
            assert resident_before, "with free slots, the policy must have kept something"
            drive(rig, [[(0, first)]])
            assert st.requests == 24 == st.hits + st.misses + st.extra["reuse"], (
                f"24 requests made: {st.requests} counted, {st.hits} hits + {st.misses} misses + "
                f"{st.extra['reuse']} reuse")
            # a second-step hit must have been resident before the step began (how many of
            # those survive the step's own misses is the policy's business)
            wanted = {make_key(0, e) for e in first}
            assert st.hits <= len(resident_before & wanted), (
                f"{st.hits} hits, but only {len(resident_before & wanted)} wanted experts were "
                "resident when the step began")
            assert st.misses - 9 >= len(wanted - resident_before), "a miss counted as a hit"
            check_resident(rig)
        finally:
            rig.close()

    def test_prefetch_makes_no_hits(self, workdir: Path, storage: StorageBackend) -> None:
        reqs = [3, 5, 7, 9]
        pairs = np.asarray([(0, e) for e in reqs * 4], dtype=np.int32)
        rig = self._fixture_rig(workdir, storage, 8, pairs)
        try:
            st = rig.cache.stats
            def counts(want: tuple[int, int, int], when: str) -> None:
                got = (st.hits, st.misses, st.extra["reuse"])
                assert got == want, f"{when}: (hits, misses, reuse) {got}, expected {want}"

            drive(rig, [[(0, reqs)]], prefetch=True)
            counts((0, 4, 0), "the first step, prefetched")
            drive(rig, [[(0, reqs)]], prefetch=True)
            counts((4, 4, 0), "the same experts again, next step")
            # a second visit of the layer within one step finds what this step read: reuse
            drive(rig, [[(0, [3, 5, 11]), (0, [3, 11, 7])]], prefetch=True)
            counts((4 + 4, 4 + 1, 1), "two visits of the layer in one step")  # 11: reuse
        finally:
            rig.close()

    def test_a_hit_serves_the_weights_it_served_before(self, workdir: Path,
                                                       storage: StorageBackend) -> None:
        """A resident expert's weights (views over its slot) are built once: every hit serves
        the same object, and a slot that takes another expert serves that expert's bytes."""
        reqs = [3, 5, 7, 9]
        pairs = np.asarray([(0, e) for e in reqs * 3 + [11, 12, 13, 14, 15]], dtype=np.int32)
        rig = self._fixture_rig(workdir, storage, 4, pairs)
        try:
            seen: dict[int, list[ExpertWeights]] = {}

            def collect(e: int, w: ExpertWeights) -> None:
                seen.setdefault(e, []).append(w)

            for _ in range(3):
                rig.cache.begin_step()
                rig.cache.run_layer(0, reqs, collect)
            st = rig.cache.stats
            assert st.hits > 0, "four experts in four slots: the later steps must hit"
            for e in reqs:
                if make_key(0, e) in rig.cache.slot_of:  # resident all along
                    assert all(w is seen[e][-1] for w in seen[e][1:]), f"expert {e} rebuilt"
            drive(rig, [[(0, [11, 12, 13, 14, 15])]])  # checks the bytes of every one
            check_resident(rig)
        finally:
            rig.close()

    # -- transient experts -------------------------------------------------------------------
    def test_declined_experts_are_served_and_not_retained(self, workdir: Path, storage: StorageBackend) -> None:
        declined = {make_key(0, 2), make_key(0, 5)}
        reqs = [1, 2, 3, 5]
        pairs = np.asarray([(0, e) for e in reqs * 3], dtype=np.int32)
        inner = make_policy(self.policy, 8, n_layers=1, n_experts=FIXTURE_EXPERTS,
                            topk=FIXTURE_TOPK, trace=pairs)
        rig = fixture_cache(workdir, storage, ScriptedPolicy(inner, decline=declined), 8)
        try:
            for step in range(3):
                drive(rig, [[(0, reqs)]])
                kept = declined & set(rig.cache.slot_of)
                assert not kept, f"step {step}: declined experts {sorted(kept)} were kept"
                transient = rig.cache.stats.extra["transient"]
                assert transient == 2 * (step + 1), (
                    f"step {step}: {transient} served transiently, expected {2 * (step + 1)}")
            st = rig.cache.stats
            assert (st.hits, st.misses) == (4, 8), (  # 1 and 3 hit twice; 2 and 5 always read
                f"(hits, misses) {(st.hits, st.misses)}, expected (4, 8)")
            check_resident(rig)
        finally:
            rig.close()

    # -- a policy that answers wrongly -------------------------------------------------------
    @pytest.mark.parametrize("kind", ["protected", "not-resident"])
    def test_invalid_victim_is_refused(self, workdir: Path, storage: StorageBackend, kind: str) -> None:
        reqs1, reqs2 = [0, 1, 2, 3, 4], [0, 5, 6, 7]
        pairs = np.asarray([(0, e) for e in reqs1 + reqs2], dtype=np.int32)
        inner = make_policy(self.policy, 5, n_layers=1, n_experts=FIXTURE_EXPERTS,
                            topk=FIXTURE_TOPK, trace=pairs)

        def bad(protected: Container[int]) -> int:
            assert make_key(0, 0) in protected and make_key(0, 5) in protected, (
                "the cache did not protect the experts of the batch being read")
            return make_key(0, 0) if kind == "protected" else make_key(0, 23)

        policy = ScriptedPolicy(inner, admit_all=True)
        rig = fixture_cache(workdir, storage, policy, 5)
        try:
            drive(rig, [[(0, reqs1)]])
            # the miss of 5 gets a good victim (its slot reserved, its read not yet sent),
            # the miss of 6 a bad one: 5's reservation must be handed back
            policy.bad_victim, policy.bad_after = bad, 1
            with pytest.raises(PluginError, match="chose victim") as err:
                drive(rig, [[(0, reqs2)]])
            said = "protected" if kind == "protected" else "not resident"
            assert said in str(err.value), f"the refusal does not say {said!r}: {err.value}"
            check_resident(rig)  # nothing reserved without its bytes
            assert set(rig.cache.slot_of) == policy.resident, (
                f"after the refusal the cache holds {sorted(rig.cache.slot_of)}, the policy was "
                f"told of {sorted(policy.resident)}")
            drive(rig, [[(0, reqs2)]])  # the cache still serves exact bytes afterwards
            check_resident(rig)
        finally:
            rig.close()
