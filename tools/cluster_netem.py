"""Two Ray nodes over an emulated link on this machine: s/token, bytes and round trips.

    sudo .venv/bin/python -m tools.cluster_netem [--model DIR] [--gen 32] [--rtt-ms 0.2]
        [--rate-gbit 10] [--repeats 3] [--json OUT]

Two network namespaces, made for the run and removed afterwards, joined by an emulated
link (:mod:`tools.netem_link`: two TUN devices and a delay line in this process, netem's
delay and rate in user space) with addresses of their own (``10.213.<n>.1`` and ``.2``,
inside the namespaces only). Node A (the head's namespace) runs ``ray start --head``
offering ``k3_worker_0`` and the ``k3 run`` head; node B runs ``ray start --address A``
offering ``k3_worker_1``; each node reads its own share (``k3 shard-experts``,
``K3_EXPERT_SHARES``). The same prompt, greedy:

1. one node: ``k3 run MODEL`` alone;
2. two nodes, the link without a delay (its forwarding cost only);
3. two nodes, the link with half the round-trip time each way and the rate cap;

2 and 3 alternated ``--repeats`` times. For each it prints the decode s/token (the median
step after each run's first), the bytes and round trips per token from the runs' ``--out``
records, the round-trip time measured across the link (TCP, 64 bytes), and what
docs/cluster.md's arithmetic (round trips x RTT + bytes / rate) projects 3 adds over 2.
The ids of every run must be the first run's; the tool fails otherwise. It needs root
(``ip netns``, ``/dev/net/tun``) and Ray; it is a measurement, not a test
(``tests/cluster/test_cluster_netem.py`` runs it, marked slow). Everything it starts it
stops by the process ids it started (and the processes left in its own namespaces), never
by name.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tools.netem_link import DelayLine

K3 = str(Path(sys.executable).with_name("k3"))
RAY = str(Path(sys.executable).with_name("ray"))
PORT = 6379
PROMPT_IDS = "3,7,11,5,2,9,4,8"


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, check=check, timeout=120)


@contextlib.contextmanager
def namespaces(tag: str, subnet: int) -> Iterator[tuple[str, str, str, str, DelayLine]]:
    """Two namespaces joined by an emulated link: ``(ns_a, ns_b, addr_a, addr_b, link)``."""
    a, b = f"k3ne-a-{tag}", f"k3ne-b-{tag}"
    ip_a, ip_b = f"10.213.{subnet}.1", f"10.213.{subnet}.2"
    made: list[str] = []
    link: DelayLine | None = None
    try:
        for ns in (a, b):
            sh("ip", "netns", "add", ns)
            made.append(ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        link = DelayLine(a, b, ip_a, ip_b, tag)
        yield a, b, ip_a, ip_b, link
    finally:
        for ns in made:
            kill_namespace(ns)
        if link is not None:
            link.close()
        for ns in made:
            sh("ip", "netns", "del", ns, check=False)


def kill_namespace(ns: str) -> None:
    """Kill the processes left in ``ns`` (a namespace this tool made: only its own)."""
    out = sh("ip", "netns", "pids", ns, check=False).stdout.split()
    for pid in out:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def in_ns(ns: str, *args: str) -> list[str]:
    return ["ip", "netns", "exec", ns, *args]


@contextlib.contextmanager
def ray_node(ns: str, env: dict[str, str], *args: str) -> Iterator[subprocess.Popen[bytes]]:
    """``ray start --block ...`` in ``ns``, in a process group of its own (killed after);
    its output goes to ``$RAY_TMPDIR/ray-start-NS.log``."""
    log = open(Path(env["RAY_TMPDIR"]) / f"ray-start-{ns}.log", "wb")
    head = ["--include-dashboard=false"] if "--head" in args else []
    p = subprocess.Popen(in_ns(ns, RAY, "start", "--block", "--disable-usage-stats", *head, *args),
                         env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield p
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        log.close()


def wait_nodes(ns: str, env: dict[str, str], address: str, n: int, timeout_s: float = 90) -> None:
    """Until ``n`` nodes are alive (else exit, with the nodes' own output)."""
    code = ("import ray,logging,sys; ray.init(address=sys.argv[1], logging_level=logging.ERROR,"
            "log_to_driver=False); print(sum(1 for x in ray.nodes() if x['Alive']))")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = subprocess.run(in_ns(ns, sys.executable, "-c", code, address), env=env,
                           capture_output=True, text=True, timeout=60)
        if r.returncode == 0 and r.stdout.strip().splitlines()[-1:] == [str(n)]:
            return
        time.sleep(1)
    logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
                     for p in sorted(Path(env["RAY_TMPDIR"]).glob("ray-start-*.log")))
    raise SystemExit(f"{n} Ray node(s) did not come up within {timeout_s:g} s "
                     f"(last try: {r.stderr.strip()[-800:]})\n{logs}")


ECHO = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 7007)); s.listen(1); s.settimeout(60)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while (d := c.recv(64)):
    c.sendall(d)
"""
PING = """
import socket, statistics, sys, time
for _ in range(100):
    try:
        c = socket.create_connection((sys.argv[1], 7007), timeout=5); break
    except OSError:
        time.sleep(0.05)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
ts = []
for _ in range(300):
    t = time.perf_counter(); c.sendall(b"x" * 64); n = 0
    while n < 64:
        n += len(c.recv(64))
    ts.append(time.perf_counter() - t)
print(statistics.median(ts[20:]))
"""


def ping(a: str, b: str, ip_b: str, env: dict[str, str]) -> float:
    """The median TCP round trip of 64 bytes from ``a`` to ``b`` across the link (s)."""
    srv = subprocess.Popen(in_ns(b, sys.executable, "-c", ECHO, ip_b), env=env)
    try:
        r = subprocess.run(in_ns(a, sys.executable, "-c", PING, ip_b), env=env,
                           capture_output=True, text=True, timeout=120, check=True)
        return float(r.stdout.strip())
    finally:
        srv.wait(30)


def k3_run(ns: str | None, env: dict[str, str], model: Path, out: Path, gen: int,
           *extra: str) -> dict[str, Any]:
    cmd = [K3, "run", str(model), "--ids", PROMPT_IDS, "--gen", str(gen), "--backend", "numpy",
           "--storage", "mmap", "--out", str(out), "-q", *extra]
    r = subprocess.run(in_ns(ns, *cmd) if ns else cmd, env=env, capture_output=True, text=True,
                       timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"k3 run failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
    rec: dict[str, Any] = json.loads(out.read_text())
    return rec


def summary(name: str, recs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median decode step (after each run's first) over ``recs``, and the traffic."""
    steps = [s for rec in recs for s in (rec["step_seconds"][1:] or rec["step_seconds"])]
    rec = recs[0]
    c = rec.get("cluster") or {}
    return {"run": name, "runs": len(recs), "s_per_token": statistics.median(steps),
            "bytes_per_token": c.get("bytes_sent_per_token", 0) + c.get("bytes_received_per_token", 0),
            "round_trips_per_token": c.get("round_trips_per_token", 0),
            "ids": rec["generated_ids"]}


def measure(model: Path, work: Path, gen: int, rtt_ms: float, rate_gbit: float,
            repeats: int) -> dict[str, Any]:
    shares = work / "shares"
    r = subprocess.run([K3, "shard-experts", str(model), str(shares), "--workers", "2", "-q"],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"k3 shard-experts failed: {r.stderr.strip()}")
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    # a private cluster in namespaces of its own: no token authentication (Ray's default
    # when ~/.ray/auth_token exists would ask every client for it)
    base.update(RAY_USAGE_STATS_ENABLED="0", RAY_TMPDIR=str(work), RAY_AUTH_MODE="disabled")
    tag, subnet = str(os.getpid() % 100000), os.getpid() % 250 + 1
    rows: list[dict[str, Any]] = []
    rows.append(summary("one node", [k3_run(None, base, model, work / "one.json", gen)
                                     for _ in range(repeats)]))
    with namespaces(tag, subnet) as (a, b, ip_a, ip_b, link):
        address = f"{ip_a}:{PORT}"
        env_a = {**base, "K3_EXPERT_SHARES": str(shares)}
        env_b = {**env_a}
        with contextlib.ExitStack() as nodes:
            nodes.enter_context(ray_node(a, env_a, "--head", f"--node-ip-address={ip_a}",
                                         f"--port={PORT}", "--num-cpus=1", "--resources",
                                         '{"k3_worker_0": 1}', f"--object-store-memory={100 << 20}"))
            wait_nodes(a, env_a, address, 1)  # B joins a head that answers
            nodes.enter_context(ray_node(b, env_b, f"--address={address}",
                                         f"--node-ip-address={ip_b}", "--num-cpus=1", "--resources",
                                         '{"k3_worker_1": 1}', f"--object-store-memory={100 << 20}"))
            wait_nodes(a, env_a, address, 2)
            cluster = ["--ray-address", address, "--expert-workers", "2",
                       "--expert-shares", str(shares)]
            head = shares / "head"
            rtt_bare = ping(a, b, ip_b, env_a)
            link.set(rtt_ms / 2e3, rate_gbit * 1e9)
            rtt_netem = ping(a, b, ip_b, env_a)
            bare: list[dict[str, Any]] = []
            slow: list[dict[str, Any]] = []
            for _ in range(repeats):  # alternated, so a busy moment of the machine hits both
                link.set(0.0, 0.0)
                bare.append(k3_run(a, env_a, head, work / "bare.json", gen, *cluster))
                link.set(rtt_ms / 2e3, rate_gbit * 1e9)
                slow.append(k3_run(a, env_a, head, work / "netem.json", gen, *cluster))
            rows.append(summary("two nodes, link without delay", bare))
            rows.append(summary(f"two nodes, {rtt_ms:g} ms RTT, {rate_gbit:g} Gbit/s", slow))
    for row in rows[1:]:
        if row["ids"] != rows[0]["ids"]:
            raise SystemExit(f"{row['run']}: ids {row['ids']} differ from one node's {rows[0]['ids']}")
    added = rows[2]["s_per_token"] - rows[1]["s_per_token"]
    wire = rows[2]["bytes_per_token"] * 8 / (rate_gbit * 1e9)
    projected = rows[2]["round_trips_per_token"] * rtt_ms / 1e3 + wire
    # the same arithmetic with the round-trip time the link really added
    projected_measured = rows[2]["round_trips_per_token"] * (rtt_netem - rtt_bare) + wire
    return {"rtt_ms": rtt_ms, "rate_gbit": rate_gbit, "gen": gen, "model": str(model),
            "measured_rtt_ms": {"bare": rtt_bare * 1e3, "emulated": rtt_netem * 1e3},
            "runs": rows, "netem_added_s_per_token": added,
            "projected_added_s_per_token": projected,
            "projected_added_s_per_token_measured_rtt": projected_measured}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.cluster_netem", description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, help="model directory (default: a tiny synthetic one)")
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--rtt-ms", type=float, default=0.2)
    ap.add_argument("--rate-gbit", type=float, default=10.0)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each cluster setting, alternated")
    ap.add_argument("--json", type=Path, help="write the figures here too")
    args = ap.parse_args(argv)
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        print("cluster_netem: needs root, ip and tc (network namespaces and netem)", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="k3netem-"))
    try:
        model = args.model
        if model is None:
            model = work / "tiny"
            subprocess.run([K3, "synth", str(model), "--size", "tiny", "-q"], check=True,
                           capture_output=True, timeout=300)
        res = measure(model, work, args.gen, args.rtt_ms, args.rate_gbit, args.repeats)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for row in res["runs"]:
        print(f"{row['run']:<44} {row['s_per_token'] * 1e3:8.2f} ms/token  "
              f"{row['bytes_per_token'] / 1e3:8.2f} kB/token  "
              f"{row['round_trips_per_token']:5.1f} round trips/token")
    m = res["measured_rtt_ms"]
    print(f"link round trip measured: {m['bare']:.3f} ms bare, {m['emulated']:.3f} ms emulated")
    print(f"the delay added {res['netem_added_s_per_token'] * 1e3:.2f} ms/token; docs/cluster.md's "
          f"arithmetic (round trips x RTT + bytes / rate) projects "
          f"{res['projected_added_s_per_token'] * 1e3:.2f} ms at {res['rtt_ms']:g} ms, "
          f"{res['projected_added_s_per_token_measured_rtt'] * 1e3:.2f} ms at the RTT measured")
    if args.json is not None:
        args.json.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
