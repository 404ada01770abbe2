"""Start or join a Ray cluster and create the expert-worker actors.

Without an address a local cluster is started for the run: a bounded number of CPUs (one
per worker), no dashboard, quiet logs, every file under a fresh temporary directory that
is removed afterwards. With ``--ray-address`` the run joins an existing cluster (``ray
start --head`` on one machine, ``ray start --address`` on the others) and the workers are
spread over its nodes; an address nothing answers on is refused at once (a TCP probe with
a 5 s timeout) rather than left to Ray's minutes of retries. A process that already called
``ray.init`` is reused as it is (and left running). Ray is imported here only, and only when a pool is asked for.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass, field
from typing import Any

from k3core.api.errors import K3Error, UsageError
from k3core.cluster.worker import ExpertWorker

INSTALL_HINT = "install the extra: pip install 'k3[ray]'"
START_TIMEOUT_S = 120.0
PROBE_TIMEOUT_S = 5.0


def import_ray() -> Any:
    """The ``ray`` module, or a usage error saying how to get it (exit 2)."""
    try:
        import ray
    except ImportError:
        raise UsageError("--expert-workers and --ray-address need Ray, which is not installed",
                         hint=INSTALL_HINT) from None
    return ray


@dataclass
class WorkerPool:
    """The actors of one run, and whether this pool started (and must stop) Ray."""

    ray: Any
    actors: list[Any]
    info: list[dict[str, Any]]
    started: bool = False
    temp_dir: str | None = None
    closed: bool = field(default=False, repr=False)

    def name(self, w: int) -> str:
        i = self.info[w] if w < len(self.info) else {}
        return f"expert worker {w} ({i.get('host', '?')}, pid {i.get('pid', '?')})"

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for a in self.actors:
            try:
                self.ray.kill(a, no_restart=True)
            except Exception:  # already gone
                pass
        if self.started:
            self.ray.shutdown()
            if self.temp_dir is not None:
                shutil.rmtree(self.temp_dir, ignore_errors=True)


def check_address(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Refuse (exit 2) an address nothing answers on, before Ray would wait minutes for it."""
    if address == "auto":
        return
    hostport = address.removeprefix("ray://")
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--ray-address {address}: expected HOST:PORT (what `ray start --head` "
                         "prints), ray://HOST:PORT or auto")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise UsageError(f"--ray-address {address}: nothing answers there ({exc.strerror or exc})",
                         hint="start the cluster with `ray start --head` and pass the address "
                              "it prints") from None


def _init(ray: Any, workers: int | None, address: str | None) -> tuple[bool, str | None]:
    if address is not None:
        check_address(address)
    if ray.is_initialized():
        return False, None
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    quiet = {"logging_level": logging.ERROR, "log_to_driver": False, "configure_logging": True}
    if address is not None:
        try:
            ray.init(address=address, **quiet)
        except Exception as exc:
            raise UsageError(f"--ray-address {address}: cannot join the Ray cluster "
                             f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})",
                             hint="start it with `ray start --head` and pass the address it prints") from None
        return True, None
    tmp = tempfile.mkdtemp(prefix="k3ray-")
    try:
        ray.init(num_cpus=workers, include_dashboard=False, _temp_dir=tmp, **quiet)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise K3Error(f"could not start a local Ray cluster: {type(exc).__name__}: {exc}") from None
    return True, tmp


def start_pool(workers: int | None, address: str | None, timeout_s: float = START_TIMEOUT_S) -> WorkerPool:
    """Create ``workers`` actors (default: one per alive node of the cluster)."""
    ray = import_ray()
    if workers is not None and workers < 1:
        raise UsageError(f"--expert-workers must be >= 1, got {workers}")
    if workers is None and address is None:
        raise UsageError("give --expert-workers N (a local cluster) or --ray-address ADDRESS")
    started, tmp = _init(ray, workers, address)
    pool = WorkerPool(ray, [], [], started, tmp)
    try:
        n = workers or max(1, sum(1 for node in ray.nodes() if node.get("Alive")))
        cls = ray.remote(num_cpus=1, max_restarts=0, max_task_retries=0)(ExpertWorker)
        pool.actors = [cls.options(scheduling_strategy="SPREAD").remote(w) for w in range(n)]
        try:
            pool.info = ray.get([a.describe.remote() for a in pool.actors], timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise K3Error(f"{n} expert worker(s) did not start within {timeout_s:g} s (does the "
                          f"cluster have {n} free CPUs?)") from None
        except ray.exceptions.RayError as exc:
            raise K3Error(f"an expert worker failed to start: {str(exc).splitlines()[0]}") from None
    except BaseException:
        pool.close()
        raise
    return pool
