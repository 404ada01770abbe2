"""Where each expert worker runs: the node offering its ``k3_worker_<i>`` resource, else
spread one per node with a CPU; a worker no node names is refused (exit 2). No Ray needed."""

from __future__ import annotations

import pytest

from k3core.api.errors import UsageError
from k3core.cluster.placement import alive_nodes, default_workers, place


def _node(nid, address, alive=True, **resources):
    return {"NodeID": nid, "NodeManagerAddress": address, "Alive": alive,
            "Resources": {"CPU": 1.0, **resources}}


def test_named_nodes_take_their_workers():
    nodes = alive_nodes([_node("b" * 56, "10.0.0.2", k3_worker_0=1.0),
                         _node("a" * 56, "10.0.0.1", k3_worker_1=1.0),
                         _node("c" * 56, "10.0.0.3", alive=False, k3_worker_2=1.0)])
    assert default_workers(nodes) == 2  # the dead node's resource does not count
    ps = place(nodes, 2)
    assert [p.node.address for p in ps] == ["10.0.0.2", "10.0.0.1"]
    assert [p.resource for p in ps] == ["k3_worker_0", "k3_worker_1"]
    assert "expert worker 1 -> node 10.0.0.1 (aaaaaaaa), which offers k3_worker_1" in ps[1].line()


def test_a_worker_no_node_names_is_refused():
    nodes = alive_nodes([_node("a" * 56, "10.0.0.1", k3_worker_0=1.0), _node("b" * 56, "10.0.0.2")])
    with pytest.raises(UsageError) as err:
        place(nodes, 3, "the Ray cluster at 10.0.0.1:6379")
    e = err.value
    assert e.exit_code == 2
    assert "no node offers k3_worker_1 for worker 1 (nor for workers 2)" in e.message
    assert "k3_worker_0 on 10.0.0.1" in e.message and "--resources" in (e.hint or "")


def test_without_names_one_worker_a_node():
    nodes = alive_nodes([_node("b" * 56, "10.0.0.2"), _node("a" * 56, "10.0.0.1"),
                         {**_node("h" * 56, "10.0.0.0"), "Resources": {"CPU": 0.0}}])
    assert default_workers(nodes) == 2  # the head without CPUs runs no worker
    ps = place(nodes, 3)
    assert [p.node.address for p in ps] == ["10.0.0.1", "10.0.0.2", "10.0.0.1"]
    assert all(p.resource is None for p in ps)
    with pytest.raises(UsageError, match="no alive node"):
        place([], 1)
