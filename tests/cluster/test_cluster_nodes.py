"""A cluster of nodes joined as with ``ray start``: two raylets on this machine (loopback),
each offering one worker's ``k3_worker_<i>`` resource and holding only that worker's share
(``K3_EXPERT_SHARES`` in the node's environment). ``k3 run HEAD --ray-address`` places each
worker on its node, each reads only its own share, and the ids and logit bytes are one
node's; a worker count the nodes do not name is refused at once (exit 2)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .nodes import LOOPBACK_ENV, local_nodes

K3 = str(Path(sys.executable).with_name("k3"))
RUN_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def node_shares(tiny_shares, tmp_path_factory):
    """Each node's own directory, holding only its worker's share."""
    roots = []
    for w in range(2):
        root = tmp_path_factory.mktemp(f"node{w}")
        shutil.copytree(tiny_shares[2] / f"worker-{w}", root / f"worker-{w}")
        roots.append(root)
    return roots


@pytest.fixture(scope="module")
def two_nodes(node_shares):
    pytest.importorskip("ray")
    nodes = [{"num_cpus": 1, "resources": {f"k3_worker_{w}": 1},
              "env": {"K3_EXPERT_SHARES": str(root)}} for w, root in enumerate(node_shares)]
    with local_nodes(nodes) as address:
        yield address


def _k3(*args):
    return subprocess.run([K3, *map(str, args)], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, env={**os.environ, **LOOPBACK_ENV})


def test_two_nodes_each_with_its_share(tiny, tiny_shares, node_shares, two_nodes, tmp_path):
    base = ["--ids", "3,7,11", "--gen", "3", "--backend", "numpy", "--storage", "mmap"]
    one = _k3("run", tiny, *base, "--dump-logits", tmp_path / "one.bin", "--out", tmp_path / "one.json")
    assert one.returncode == 0, one.stderr
    res = _k3("run", tiny_shares[2] / "head", *base, "--ray-address", two_nodes,
              "--expert-workers", "2", "--expert-shares", tmp_path / "not-on-the-nodes",
              "--dump-logits", tmp_path / "two.bin", "--out", tmp_path / "two.json")
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "one.bin").read_bytes() == (tmp_path / "two.bin").read_bytes()
    a = json.loads((tmp_path / "one.json").read_text())
    b = json.loads((tmp_path / "two.json").read_text())
    assert a["generated_ids"] == b["generated_ids"]
    c = b["cluster"]
    nodes = {w["node"] for w in c["workers"]}
    assert len(nodes) == 2  # one worker a node
    for w in range(2):
        assert c["workers"][w]["share"] == str(node_shares[w] / f"worker-{w}")
        assert f"which offers k3_worker_{w}" in c["placement"][w]
        assert not (node_shares[1 - w] / f"worker-{w}").exists()  # only its own share there
    assert "expert worker 0 -> node 127.0.0.1" in res.stderr
    assert b["memory_plan"]["rows"]["expert cache"] == 0
    assert res.stdout == one.stdout  # the same text, and nothing of Ray's on stdout


def test_a_worker_no_node_names(tiny_shares, tiny, two_nodes):
    res = _k3("run", tiny, "--ids", "3", "--gen", "1", "--backend", "numpy", "--storage", "mmap",
              "--ray-address", two_nodes, "--expert-workers", "3")
    assert res.returncode == 2, res.stderr
    assert "no node offers k3_worker_2 for worker 2" in res.stderr
    assert res.stderr.count("k3: error:") == 1 and "Traceback" not in res.stderr
