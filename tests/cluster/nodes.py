"""Several raylets on this machine, on loopback only: a Ray cluster of nodes for the tests.

:func:`local_nodes` starts this file as a child process of its own, which builds the
cluster with Ray's ``cluster_utils.Cluster`` (a head without CPUs, then one raylet per
node spec: its CPUs, its custom resources and its own environment, e.g.
``K3_EXPERT_SHARES``), prints the head's address and waits; closing its stdin stops the
cluster, and a bounded wait then kills what is left (by the child's own process group).
Every address is 127.0.0.1 (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` keeps Ray from swapping
loopback for the machine's address) and every file under a temporary directory
(``RAY_TMPDIR``, removed afterwards). The cluster lives in its own process, so the test
process's own Ray session is left alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 60.0
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


@contextlib.contextmanager
def local_nodes(nodes: list[dict[str, Any]]) -> Iterator[str]:
    """A cluster of ``nodes`` (each ``{"resources": {...}, "env": {...}, "num_cpus": 1}``);
    yields the head's address."""
    tmp = tempfile.mkdtemp(prefix="k3nodes-")  # short: Ray's socket paths live below it
    spec = json.dumps({"temp_dir": tmp, "nodes": nodes})
    proc = subprocess.Popen([sys.executable, __file__, spec], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, **LOOPBACK_ENV, "RAY_TMPDIR": tmp})
    try:
        assert proc.stdout is not None
        line = _readline(proc, START_TIMEOUT_S)
        if not line.startswith("address "):
            raise RuntimeError(f"the test cluster did not start: {line!r}")
        yield line.split()[1]
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the group this child leads, nothing else
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def _readline(proc: subprocess.Popen[str], timeout_s: float) -> str:
    import selectors

    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout_s):
        raise RuntimeError(f"the test cluster did not start within {timeout_s:g} s")
    return proc.stdout.readline().strip()


def _serve(spec: dict[str, Any]) -> None:
    import logging

    from ray.cluster_utils import Cluster

    logging.disable(logging.WARNING)
    os.makedirs(os.path.join(spec["temp_dir"], "ray"), exist_ok=True)  # $RAY_TMPDIR/ray
    common = {"node_ip_address": "127.0.0.1", "temp_dir": os.path.join(spec["temp_dir"], "ray"),
              "object_store_memory": 80 << 20}
    c = Cluster(initialize_head=True, connect=False,
                head_node_args={**common, "num_cpus": 0, "include_dashboard": False})
    try:
        for n in spec["nodes"]:
            c.add_node(**common, num_cpus=n.get("num_cpus", 1), resources=n.get("resources", {}),
                       env_vars=n.get("env", {}))
        c.wait_for_nodes()
        print(f"address {c.address}", flush=True)
        sys.stdin.read()  # until the test closes it
    finally:
        c.shutdown()


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))
