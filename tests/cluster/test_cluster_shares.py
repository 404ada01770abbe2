"""A head holding no routed expert and N workers holding only their shares (``k3
shard-experts``) give the ids and logit bytes of one node, resident and streamed trunk;
a share that does not match the head's plan is refused before the first token, naming the
worker and the file."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from typer.testing import CliRunner

from k3core.api.errors import CheckpointError, K3Error, UsageError
from k3core.cli.app import app
from k3core.run.engine import open_engine
from k3core.run.generate import generate
from k3core.run.request import EngineRequest

PROMPT = [3, 7, 11, 5]
GEN = 3
runner = CliRunner()


def _request(model, trunk=None, remote=False) -> EngineRequest:
    return EngineRequest(model_dir=model, backend="numpy", storage="mmap", trunk=trunk,
                         remote_experts=remote)


@pytest.fixture(scope="module")
def head_trunks(tiny_shares, tmp_path_factory):
    """A packed trunk of each head: the head alone is all pack-trunk needs."""
    out = {}
    for n, d in tiny_shares.items():
        t = tmp_path_factory.mktemp("head-trunk") / f"n{n}"
        res = runner.invoke(app, ["pack-trunk", str(d / "head"), str(t), "--storage", "mmap", "-q"])
        assert res.exit_code == 0, res.output
        out[n] = t
    return out


def _run(pool, n, shares, trunk=None):
    from k3core.cluster.executor import ClusterExperts

    eng = open_engine(_request(shares / "head", trunk, remote=True))
    ex = ClusterExperts(n, pool=pool, shares=str(shares))
    lines: list[str] = []
    try:
        assert eng.plan.memory is not None and eng.plan.memory.expert_cache == 0
        ex.start(eng, lines.append)
        res = generate(eng.model, PROMPT, GEN, keep_logits=True)
        record = ex.report(lines.append)
    finally:
        ex.close()
        eng.close()
    return res, record, lines


@pytest.mark.parametrize("streamed", [False, True], ids=["resident", "streamed"])
@pytest.mark.parametrize("n", [2, 3])
def test_shares_give_the_bits_of_one_node(pool, tiny, tiny_trunk, tiny_shares, head_trunks,
                                          n, streamed):
    eng = open_engine(_request(tiny, tiny_trunk if streamed else None))
    try:
        ref = generate(eng.model, PROMPT, GEN, keep_logits=True)
    finally:
        eng.close()
    res, record, lines = _run(pool, n, tiny_shares[n], head_trunks[n] if streamed else None)
    assert res.generated_ids == ref.generated_ids
    for a, b in zip(res.step_logits, ref.step_logits, strict=True):
        assert a.dtype == b.dtype == np.float32 and a.tobytes() == b.tobytes()
    for w in range(n):  # every worker read its own share directory, checked whole
        assert record["workers"][w]["share"] == str(tiny_shares[n] / f"worker-{w}")
        assert record["workers"][w]["share_check"] == "full"
    assert sum(s["requests"] for s in record["worker_stats"]) > 0
    assert any("share " in line and "checked" in line for line in lines)


def _refused(pool, shares, n=2) -> K3Error:
    from k3core.cluster.executor import ClusterExperts

    eng = open_engine(_request(shares / "head", remote=True))
    ex = ClusterExperts(n, pool=pool, shares=str(shares))
    made: list[int] = []
    try:
        with pytest.raises(K3Error) as err:
            ex.start(eng, lambda s: None)
            generate(eng.model, PROMPT, 1, on_step=lambda st: made.append(st.token))
    finally:
        ex.close()
        eng.close()
    assert made == []  # before the first token
    assert "Traceback" not in err.value.message
    return err.value


@pytest.fixture
def copied(tiny_shares, tmp_path):
    out = tmp_path / "shares"
    shutil.copytree(tiny_shares[2], out)
    return out


def test_a_missing_share(pool, copied):
    shutil.rmtree(copied / "worker-1")
    err = _refused(pool, copied)
    assert isinstance(err, UsageError) and err.exit_code == 2
    assert "expert worker 1" in err.message and "worker-1 does not exist on this node" in err.message
    assert "K3_EXPERT_SHARES" in (err.hint or "")  # the fix travels back from the worker


def test_a_share_of_another_model(pool, copied, other_tiny, tmp_path):
    res = runner.invoke(app, ["shard-experts", str(other_tiny), str(tmp_path / "other"),
                              "--workers", "2", "--storage", "mmap", "-q"])
    assert res.exit_code == 0, res.output
    shutil.rmtree(copied / "worker-0")
    shutil.copytree(tmp_path / "other" / "worker-0", copied / "worker-0")
    err = _refused(pool, copied)
    assert isinstance(err, CheckpointError) and err.exit_code == 1
    assert "expert worker 0" in err.message and "share.json is of another model" in err.message


def test_a_share_of_another_worker_count(pool, copied, tiny_shares):
    shutil.rmtree(copied / "worker-1")
    shutil.copytree(tiny_shares[3] / "worker-1", copied / "worker-1")
    err = _refused(pool, copied)
    assert isinstance(err, CheckpointError) and err.exit_code == 1
    assert "expert worker 1" in err.message and "share.json" in err.message
    assert "worker 1 of 3; this run needs worker 1 of 2" in err.message


def test_a_damaged_file(pool, copied):
    shard = sorted((copied / "worker-1").glob("*.safetensors"))[3]
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0x01  # one bit of an expert, same size
    shard.write_bytes(bytes(data))
    err = _refused(pool, copied)
    assert isinstance(err, CheckpointError) and err.exit_code == 1
    assert "expert worker 1" in err.message and f"file {shard.name} is damaged" in err.message


def test_a_share_cut_short_on_the_command_line(ray_session, copied, tmp_path):
    shard = sorted((copied / "worker-0").glob("*.safetensors"))[0]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 8)
    res = runner.invoke(app, ["run", str(copied / "head"), "--ids", "3,7", "--gen", "2",
                              "--backend", "numpy", "--storage", "mmap", "--expert-workers", "2",
                              "--expert-shares", str(copied), "--out", str(tmp_path / "o.json")])
    assert res.exit_code == 1, res.output
    assert "expert worker 0" in res.output and shard.name in res.output
    assert "Traceback" not in res.output and not (tmp_path / "o.json").exists()


def test_the_workers_must_match_the_heads_count(ray_session, tiny_shares):
    res = runner.invoke(app, ["run", str(tiny_shares[2] / "head"), "--ids", "3", "--gen", "1",
                              "--expert-workers", "3", "--expert-shares", str(tiny_shares[2])])
    assert res.exit_code == 2, res.output
    assert "sharded for 2 expert workers" in res.output


def test_expert_shares_need_a_head(ray_session, tiny, tiny_shares):
    res = runner.invoke(app, ["run", str(tiny), "--ids", "3", "--gen", "1", "--expert-workers", "2",
                              "--expert-shares", str(tiny_shares[2])])
    assert res.exit_code == 2, res.output
    assert "--expert-shares needs MODEL_DIR to be the head/" in res.output


def test_the_heads_manifest_records_the_plan(tiny_shares):
    d = json.loads((tiny_shares[3] / "head" / "expert-shares.json").read_text())
    assert d["workers"] == 3 and len(d["shares"]) == 3
    assert all(f.endswith(".safetensors") or f.endswith(".json")
               for s in d["shares"] for f in s["files"])
