"""The two-node measurement over an emulated link (``tools/cluster_netem.py``) runs, keeps
the ids of one node and cleans up after itself. A measurement, so ``slow``: no timing is
asserted, only that the figures are there and nothing is left behind."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip") or not os.path.exists("/dev/net/tun"),
                    reason="needs root, ip and /dev/net/tun (network namespaces)")
def test_two_nodes_over_an_emulated_link(tmp_path):
    pytest.importorskip("ray")
    before = _namespaces()
    work_before = set(Path(tempfile.gettempdir()).glob("k3netem-*"))
    res = subprocess.run([sys.executable, "-m", "tools.cluster_netem", "--gen", "8", "--repeats", "1",
                          "--json", str(tmp_path / "netem.json")],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    d = json.loads((tmp_path / "netem.json").read_text())
    runs = d["runs"]
    assert [r["ids"] for r in runs[1:]] == [runs[0]["ids"]] * 2  # the ids of one node
    assert runs[1]["round_trips_per_token"] == runs[2]["round_trips_per_token"] == 12
    assert runs[2]["bytes_per_token"] > 0
    assert d["measured_rtt_ms"]["emulated"] > d["measured_rtt_ms"]["bare"]
    assert "link round trip measured" in res.stdout
    assert _namespaces() == before  # its namespaces are gone
    assert set(Path(tempfile.gettempdir()).glob("k3netem-*")) <= work_before


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip") or not os.path.exists("/dev/net/tun"),
                    reason="needs root, ip and /dev/net/tun (network namespaces)")
def test_a_cluster_asking_for_a_token(tiny):
    """``ray start --head`` with token authentication, ``k3 run`` without the token: one
    line, exit 2, the fix named, bounded (a namespace of its own keeps its ports apart)."""
    pytest.importorskip("ray")
    sys.path.insert(0, str(ROOT))
    from tools import cluster_netem as cn

    work = Path(tempfile.mkdtemp(prefix="k3tok-"))  # short: Ray's socket paths live below it
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_TMPDIR=str(work))
    head = {**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0123456789abcdef" * 2}
    client = {**env, "RAY_AUTH_MODE": "disabled", "HOME": str(work)}  # no token here
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, work, ignore_errors=True)
        a, _b, ip_a, _ip_b, _link = stack.enter_context(cn.namespaces("tok", 251))
        with cn.ray_node(a, head, "--head", f"--node-ip-address={ip_a}", "--port=6379",
                         "--num-cpus=1"):
            probe = ("import socket, sys, time\nfor _ in range(600):\n    try:\n"
                     "        socket.create_connection((sys.argv[1], 6379), 1).close(); break\n"
                     "    except OSError:\n        time.sleep(0.1)\nelse:\n    sys.exit(1)\n")
            subprocess.run(cn.in_ns(a, sys.executable, "-c", probe, ip_a), timeout=120, check=True)
            res = subprocess.run(cn.in_ns(a, cn.K3, "run", str(tiny), "--ids", "3", "--gen", "1",
                                          "--ray-address", f"{ip_a}:6379", "--expert-workers", "1",
                                          "-q"),
                                 env=client, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr
    assert res.stderr.count("k3: error:") == 1 and "RAY_AUTH_MODE=token" in res.stderr
    assert "Traceback" not in res.stderr and "gcs_client" not in res.stderr
