"""``k3 shard-experts``: a head with every tensor but the routed experts, one share per worker
with exactly its experts under the plan, manifests with checksums; its refusals."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from k3core.checkpoint.index import CheckpointIndex
from k3core.cli.app import app
from k3core.cluster.plan import plan_shares
from k3core.cluster.shares import HEAD_MANIFEST, SHARE_MANIFEST, read_head_manifest
from k3core.experts.locator import ExpertLocator
from k3core.model import names
from k3core.model.config import load_config
from k3core.plugins.registry import get_registry

runner = CliRunner()


def k3(*args):
    return runner.invoke(app, [str(a) for a in args])


def _index(d):
    storage, _, _ = get_registry().create("storage", "mmap")
    return CheckpointIndex.open(d, storage)


def _experts(index) -> set[tuple[int, int]]:
    out = set()
    for name in index.tensors:
        split = names.split_layer_name(name)
        if split is not None and names.is_routed_expert(split[1]):
            out.add((split[0], int(names.EXPERT_RE.match(split[1]).group(1))))
    return out


def test_head_and_shares_hold_what_the_plan_says(tiny, tiny_shares):
    out = tiny_shares[3]
    cfg = load_config(tiny / "config.json")
    with _index(tiny) as whole:
        plan = plan_shares(cfg, ExpertLocator(cfg, whole), cfg.n_layers, 3)
        every = set(whole.tensors)
        data = {n: whole.read(n).tobytes() for n in every}
    with _index(out / "head") as head:
        assert _experts(head) == set()  # the head holds no routed expert
        trunk = set(head.tensors)
        assert all(head.read(n).tobytes() == data[n] for n in trunk)
    held: set[str] = set()
    for w in range(3):
        with _index(out / f"worker-{w}") as share:
            owned = {(L, e) for L, es in plan.owned(w).items() for e in es}
            assert _experts(share) == owned  # exactly its own experts
            assert set(share.tensors) == {n for n in share.tensors
                                          if names.split_layer_name(n) is not None}
            assert all(share.read(n).tobytes() == data[n] for n in share.tensors)
            loc = ExpertLocator(cfg, share)
            L, e = min(owned)
            assert loc.ref(L, e).contiguous  # an expert's six tensors stay one run
            held |= set(share.tensors)
    assert trunk | held == every and not trunk & held
    man = read_head_manifest(out / "head")
    assert man.workers == 3 and man.plan.owner == plan.owner
    share = json.loads((out / "worker-1" / SHARE_MANIFEST).read_text())
    assert share["worker"] == 1 and share["workers"] == 3
    assert share["plan_fingerprint"] == man.plan_fingerprint and share["model"] == man.model
    assert (out / "head" / "tiktoken.model").is_file()
    assert not (out / "worker-0" / "tiktoken.model").exists()


def test_prints_each_share_and_refuses_a_non_empty_out_dir(tiny, tmp_path):
    out = tmp_path / "sh"
    res = k3("shard-experts", tiny, out, "--workers", "2", "--storage", "mmap", "-q")
    assert res.exit_code == 0, res.output
    assert "worker-0: " in res.output and "worker-1: " in res.output
    assert "48 routed experts" in res.output and "(every tensor but the routed experts)" in res.output
    assert (out / "head" / HEAD_MANIFEST).is_file()
    before = sorted(p.name for p in out.iterdir())
    again = k3("shard-experts", tiny, out, "--workers", "2", "--storage", "mmap", "-q")
    assert again.exit_code == 2 and "is not empty" in again.output
    assert sorted(p.name for p in out.iterdir()) == before
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]  # nothing left behind


def test_bad_worker_counts_and_inputs(tiny, tmp_path):
    for n, needle in (("0", "--workers must be >= 1"), ("9", "only 8 routed experts")):
        res = k3("shard-experts", tiny, tmp_path / "x", "--workers", n, "-q")
        assert res.exit_code == 2 and needle in res.output, res.output
        assert not (tmp_path / "x").exists()
    res = k3("shard-experts", tmp_path / "nothing", tmp_path / "y", "--workers", "2", "-q")
    assert res.exit_code == 2 and "does not exist" in res.output
    res = k3("shard-experts", tiny, tiny / "inside", "--workers", "2", "-q")
    assert res.exit_code == 3 and "MODEL_DIR" in res.output
    assert "Traceback" not in res.output


def test_a_head_alone_is_refused(tiny_shares):
    res = k3("run", tiny_shares[2] / "head", "--ids", "3", "--gen", "1")
    assert res.exit_code == 2, res.output
    assert "holds no routed expert" in res.output and "--expert-shares" in res.output
