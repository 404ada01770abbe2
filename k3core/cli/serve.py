"""``k3 serve MODEL_DIR``: an OpenAI-compatible HTTP server (see ``k3core.serve.app``).

Loopback only unless an API key is set: a non-loopback ``--host`` without ``--api-key``
(or ``$K3_API_KEY``) is refused (exit 2). Needs the ``serve`` extra (Starlette and uvicorn);
without it the command says how to install it (exit 2). Connections are capped below the
file limit and timed out (``--max-connections``, ``--timeout-header``, ``--timeout-idle``;
``k3core.serve.connections``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer

from k3core.api.errors import K3Error, UsageError
from k3core.api.units import check_gb, gb_bytes
from k3core.cli.guard import guarded
from k3core.cli.options import EngineFlags, engine_flags
from k3core.serve.loading import DEFAULT_CONTEXT

#: the most slots the default ``--max-batch`` takes (fewer when the memory plan says so)
DEFAULT_MOST_BATCH = 16

_S = "Server"
_X = "Engine"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _need_extra() -> None:
    try:
        import prometheus_client  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise UsageError("k3 serve needs the serve extra (Starlette, uvicorn and prometheus_client): "
                         "pip install 'k3[serve]'") from None


def _bind(host: str, port: int, backlog: int = 128) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets that say so, and
    # without it every keep-alive answer waits out the client's delayed ACK (~40 ms)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise K3Error(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(backlog)
    sock.setblocking(False)
    return sock


def _server_class() -> Any:
    import uvicorn

    class StopOnSignal(uvicorn.Server):
        """Ctrl-C or SIGTERM ends the server cleanly (exit 0), not with the signal re-raised:
        generations in progress are cancelled at once, so open streams end before the
        graceful-shutdown timeout."""

        on_stop: Any = None
        on_loop: Any = None

        async def serve(self, sockets: list[socket.socket] | None = None) -> None:
            if self.on_loop is not None:
                self.on_loop(asyncio.get_running_loop())
            await super().serve(sockets)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            def stop(signum: int, frame: Any) -> None:
                self.should_exit = True
                if self.on_stop is not None:
                    self.on_stop()

            previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return StopOnSignal


@guarded
@engine_flags(omit=("incremental",), panel=_X)
def serve(
    model_dir: Path = typer.Argument(..., help="Directory with the safetensors shards (and the tokenizer)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (non-loopback needs --api-key).", rich_help_panel=_S),
    port: int = typer.Option(8000, "--port", help="Port (0 = any free port; the one chosen is printed).", rich_help_panel=_S),
    api_key: str = typer.Option(None, "--api-key", envvar="K3_API_KEY", help="Require Authorization: Bearer KEY (or $K3_API_KEY).", rich_help_panel=_S, show_default=False),
    model_name: str = typer.Option(None, "--model-name", help="The model id clients ask for (default: MODEL_DIR's name).", rich_help_panel=_S),
    context: int = typer.Option(DEFAULT_CONTEXT, "--context", help="Tokens one conversation may hold (prompt + reply).", rich_help_panel=_S),
    max_queue: int = typer.Option(64, "--max-queue", help="Requests that may wait for a slot (then 429).", rich_help_panel=_S),
    max_batch: int = typer.Option(None, "--max-batch", help="Requests decoded together, their steps batched (default: as many as the memory plan fits, at most 16; each slot holds its KV cache at --context and its recurrent state).", rich_help_panel=_S, show_default=False),
    prefix_cache_gb: float = typer.Option(0.5, "--prefix-cache-gb", help="GB of kept prompt-prefix states: a request that starts with a kept prefix feeds only the rest (0: off).", rich_help_panel=_S),
    prefix_cache_dir: Path = typer.Option(None, "--prefix-cache-dir", help="Spill the prefix states --prefix-cache-gb evicts to this directory and read them back when a prompt starts with one (kept across restarts; files of another model are left alone).", rich_help_panel=_S, show_default=False),
    prefix_cache_disk_gb: float = typer.Option(None, "--prefix-cache-disk-gb", help="GB of spilled prefix states in --prefix-cache-dir, least recently used removed first (default 4).", rich_help_panel=_S, show_default=False),
    max_connections: int = typer.Option(None, "--max-connections", help="Connections open at once (default 256, less if the file limit needs it); past it the longest-idle one is closed, or a 503 when all are busy.", rich_help_panel=_S, show_default=False),
    timeout_header: float = typer.Option(10.0, "--timeout-header", help="Seconds a connection has to send a request's head (and the longest pause in its body).", rich_help_panel=_S),
    timeout_idle: float = typer.Option(30.0, "--timeout-idle", help="Seconds a keep-alive connection may idle between requests.", rich_help_panel=_S),
    cors_origin: list[str] = typer.Option([], "--cors-origin", help="Let pages from ORIGIN (scheme://host[:port], or *) call this server from a browser; repeatable. Off by default.", rich_help_panel=_S, show_default=False),
    chat_format: str = typer.Option("auto", "--chat-format", help="auto, xtml or plain.", rich_help_panel=_S),
    think: bool = typer.Option(None, "--think/--no-think", help="Chat replies think first (XTML); reasoning_effort overrides. Default: on, off for a model trained to answer without thinking (the demo model).", rich_help_panel=_S, show_default=False),
    thinking_effort: str = typer.Option("max", "--thinking-effort", help="low, high or max.", rich_help_panel=_S),
    *,
    flags: EngineFlags,
) -> None:
    """Serve MODEL_DIR over an OpenAI-compatible HTTP API (concurrent requests batched)."""
    if api_key is not None and not api_key.strip():
        raise UsageError("--api-key must not be empty")
    if not is_loopback(host) and api_key is None:
        raise UsageError(f"--host {host} is not a loopback address: anyone who can reach it could "
                         "use this machine; set --api-key KEY (or $K3_API_KEY) to serve beyond loopback")
    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be in 0..65535, got {port}")
    if max_queue < 1:
        raise UsageError(f"--max-queue must be >= 1, got {max_queue}")
    from k3core.run.batch import check_max_batch

    check_max_batch(max_batch)
    prefix_bytes = gb_bytes(check_gb(prefix_cache_gb, "--prefix-cache-gb") or 0.0)
    from k3core.run.prefix_spill import DEFAULT_DISK_GB, PrefixSpill

    if prefix_cache_disk_gb is not None and prefix_cache_dir is None:
        raise UsageError("--prefix-cache-disk-gb needs --prefix-cache-dir (the directory it bounds)")
    disk_bytes = gb_bytes(check_gb(prefix_cache_disk_gb, "--prefix-cache-disk-gb", positive=True)
                          or DEFAULT_DISK_GB)
    if prefix_cache_dir is not None:
        PrefixSpill.check_dir(prefix_cache_dir)
    from k3core.serve.connections import plan_limits

    plan_limits(max_connections, timeout_header, timeout_idle)  # bad flags before the model opens
    _need_extra()
    from k3core.serve.cors import check_origins

    cors_origins = check_origins(cors_origin)
    import uvicorn

    _Server = _server_class()

    from k3core.run.engine import open_engine
    from k3core.run.memory_plan import most_slots
    from k3core.run.plan import plan_engine
    from k3core.run.prefix_cache import PrefixCache
    from k3core.serve.app import create_app
    from k3core.serve.chat_format import check_format_options
    from k3core.serve.connections import Connections, protocol_class
    from k3core.serve.loading import check_context, conversation_request, default_thinking
    from k3core.serve.logs import log_config
    from k3core.serve.service import Service
    from k3core.serve.worker import Worker

    check_context(context)
    check_format_options(chat_format, think is not False, thinking_effort)
    request = conversation_request(model_dir, context, flags.given)
    request = request.model_copy(update={"prefix_cache_bytes": prefix_bytes})
    if max_batch is None:  # as many slots as the memory plan fits
        one = plan_engine(request)
        assert one.memory is not None
        max_batch = most_slots(one.memory, DEFAULT_MOST_BATCH)
    engine = open_engine(request.model_copy(update={"slots": max_batch}))
    try:
        assert engine.tokenizer is not None  # the request requires one
        if think is None:  # the model says (the demo model answers without thinking)
            think = default_thinking(engine.cfg.source)
        spill = (PrefixSpill(prefix_cache_dir, engine, disk_bytes)
                 if prefix_cache_dir is not None else None)
        prefix = PrefixCache(prefix_bytes, spill) if prefix_bytes or spill is not None else None
        service = Service(Worker(engine, context, prefix, max_batch), engine.tokenizer, model_name or model_dir.resolve().name,
                          chat_format=chat_format, thinking=think, effort=thinking_effort)
        limits, note = plan_limits(max_connections, timeout_header, timeout_idle)  # the model's files open
        conns = Connections(limits)
        app = create_app(service, api_key, max_queue, conns, cors_origins)
        sock = _bind(host, port, limits.backlog)
        bound = sock.getsockname()[1]
        shown = f"[{host}]" if ":" in host else host
        thinks = "" if think or service.fmt.name != "xtml" else ", no thinking unless asked"
        print(f"k3 serve: {service.model_name} ({service.fmt.name} chat format{thinks}, context {context}, "
              f"batch of up to {max_batch}) on "
              f"http://{shown}:{bound}/v1  ({engine.settings_line.removeprefix('k3: ')})",
              file=sys.stderr, flush=True)
        print(f"k3 serve: chat page on http://{shown}:{bound}/", file=sys.stderr, flush=True)
        if note is not None:
            print(f"k3 serve: {note}", file=sys.stderr)
        config = uvicorn.Config(app, log_config=log_config(), access_log=False, lifespan="off",
                                timeout_graceful_shutdown=5, http=protocol_class(conns), ws="none",
                                timeout_keep_alive=limits.timeout_idle, backlog=limits.backlog)  # type: ignore[arg-type]
        server = _Server(config)
        server.on_stop = service.cancel_all
        server.on_loop = lambda loop: loop.set_exception_handler(conns.loop_error)
        try:
            server.run(sockets=[sock])
        finally:
            conns.flush()  # the counts not yet summarized
            service.cancel_all()
            app.state.server.executor.shutdown(wait=True, cancel_futures=True)
            sock.close()
    finally:
        engine.close()
    print("k3 serve: stopped", file=sys.stderr)


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
