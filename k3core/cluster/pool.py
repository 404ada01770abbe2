"""Start or join a Ray cluster and create the expert-worker actors.

Without an address a local cluster is started for the run: a bounded number of CPUs (one
per worker), no dashboard, quiet logs, every file under a fresh temporary directory that
is removed afterwards. With ``--ray-address`` the run joins an existing cluster (``ray
start --head`` on one machine, ``ray start --address`` on the others) and each worker is
placed as :mod:`k3core.cluster.placement` says (on the node offering its ``k3_worker_<i>``
resource, else spread one per node); an address nothing answers on is refused at once (a
TCP probe with a 5 s timeout) rather than left to Ray's minutes of retries. A process that
already called ``ray.init`` is reused as it is (and left running). With ``restarts`` the
actors are restarted when they die (Ray's ``max_restarts``; a restarted worker holds
nothing until it is opened again, :mod:`k3core.cluster.retry`). Ray is imported here
only, and only when a pool is asked for.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from k3core.api.errors import K3Error, UsageError
from k3core.cluster.placement import Placement, alive_nodes, default_workers, place
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
    placements: list[Placement] = field(default_factory=list)
    closed: bool = field(default=False, repr=False)

    def name(self, w: int) -> str:
        """``expert worker W (HOST, node ID, pid P)``: who, on which node, which process."""
        i = self.info[w] if w < len(self.info) else {}
        node = str(i.get("node") or "?")[:8]
        return f"expert worker {w} ({i.get('host', '?')}, node {node}, pid {i.get('pid', '?')})"

    def lines(self) -> list[str]:
        """Where each worker runs (printed before the first token)."""
        return [p.line() for p in self.placements]

    def describe(self, w: int, timeout_s: float) -> dict[str, Any]:
        """Ask worker ``w`` who it is now (after a restart: a new pid, maybe a new node). While
        Ray says the actor is restarting (``ActorUnavailableError``: a restart slow on a busy
        machine) it is asked again, until ``timeout_s`` is spent (then ``GetTimeoutError``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                info = self.ray.get(self.actors[w].describe.remote(),
                                    timeout=max(0.0, deadline - time.monotonic()))
                break
            except self.ray.exceptions.ActorUnavailableError:
                if time.monotonic() >= deadline:
                    raise self.ray.exceptions.GetTimeoutError(
                        f"worker {w} was still restarting after {timeout_s:g} s") from None
                time.sleep(0.1)
        self.info[w] = info
        return info

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
            with _stderr_muted():  # Ray's core retries a refused join loudly, line by line
                ray.init(address=address, **quiet)
        except Exception as exc:
            said = f"{exc!s} {exc.__cause__!s}"
            hint = ("the cluster asks for Ray's token authentication: set RAY_AUTH_MODE=token "
                    "and give this machine the head's token (~/.ray/auth_token or "
                    "RAY_AUTH_TOKEN)" if "Authentication" in said or "auth token" in said.lower()
                    else "start it with `ray start --head` and pass the address it prints")
            raise UsageError(f"--ray-address {address}: cannot join the Ray cluster "
                             f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})",
                             hint=hint) from None
        _quiet_raylet(ray)
        return True, None
    tmp = tempfile.mkdtemp(prefix="k3ray-")
    try:
        ray.init(num_cpus=workers, include_dashboard=False, _temp_dir=tmp, **quiet)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise K3Error(f"could not start a local Ray cluster: {type(exc).__name__}: {exc}") from None
    _quiet_raylet(ray)
    return True, tmp


@contextlib.contextmanager
def _stderr_muted() -> Iterator[None]:
    """File descriptor 2 to /dev/null for the block: what Ray's C++ core prints there while
    it tries to join (the run says what went wrong in its own one line)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, 2)
        finally:
            os.close(null)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _quiet_raylet(ray: Any) -> None:
    """Keep the raylet's notices (a worker died, ...) off stdout, which carries the generated
    text: Ray's driver prints them there. The run says what happened in its own lines."""
    mod = getattr(getattr(ray, "_private", None), "worker", None)
    fn = getattr(mod, "print_to_stdstream", None)
    if mod is None or fn is None or getattr(fn, "_k3_quiet", False):
        return

    def quiet(data: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        if data.get("pid") == "raylet":
            return
        fn(data, *args, **kwargs)

    quiet._k3_quiet = True  # type: ignore[attr-defined]
    mod.print_to_stdstream = quiet


def start_pool(workers: int | None, address: str | None, timeout_s: float = START_TIMEOUT_S,
               restarts: int = 0) -> WorkerPool:
    """Create ``workers`` actors (default: one per ``k3_worker_<i>`` resource the cluster
    offers, else one per alive node), each restarted up to ``restarts`` times when it dies
    (-1: every time)."""
    ray = import_ray()
    if workers is not None and workers < 1:
        raise UsageError(f"--expert-workers must be >= 1, got {workers}")
    if workers is None and address is None:
        raise UsageError("give --expert-workers N (a local cluster) or --ray-address ADDRESS")
    started, tmp = _init(ray, workers, address)
    pool = WorkerPool(ray, [], [], started, tmp)
    try:
        nodes = alive_nodes(ray.nodes())
        n = workers or default_workers(nodes)
        where = f"the Ray cluster at {address}" if address is not None else "the Ray cluster"
        pool.placements = place(nodes, n, where)
        cls = ray.remote(num_cpus=1, max_restarts=restarts, max_task_retries=0)(ExpertWorker)
        pool.actors = [cls.options(**_options(ray, p)).remote(p.worker) for p in pool.placements]
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


def _options(ray: Any, p: Placement) -> dict[str, Any]:
    """Ray's scheduling options for one placement."""
    if p.resource is not None:
        return {"resources": {p.resource: 1}}
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(p.node.node_id, soft=False)}
