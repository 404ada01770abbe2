"""``k3 bench``: measurements the project quotes, each next to its own yardstick.

* ``k3 bench kernels``: every op at the real Kimi K3 widths per kernel backend, as GB/s of
  input bytes beside the memory read bandwidth measured in the same run;
* ``k3 bench io``: random expert-sized reads through each storage backend beside the raw
  O_DIRECT and buffered probe at the same sizes and queue depths, in the same run;
* ``k3 bench ladder``: the memory ladder (same as ``k3 bench-ladder``);
* ``k3 bench codec``: ratio and one-core decode GB/s of each trunk codec on a model's own
  trunk bytes, beside CRC-32 and copy speed in the same run;
* ``k3 bench decode``: a model's s/token and prefill tokens/s beside the bandwidth floor of
  the same run, bytes read and touched, exposed I/O wait and kernel calls per token, with
  the ids checked against ``--backend numpy``;
* ``k3 bench serve``: a real ``k3 serve`` driven over HTTP, one client and then ``--clients``
  at once: generated tokens/s, time to first token and inter-token latency, and the ratios.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from k3core.api.errors import UsageError
from k3core.api.units import ALIGN, check_gb, check_mb
from k3core.cli.bench_ladder import bench_ladder
from k3core.cli.guard import guarded
from k3core.cli.options import EngineFlags, engine_flags
from k3core.cli.progress import Stages
from k3core.model.sizes import EXPERT_BYTES
from k3core.tools.bench.codec import (
    DEFAULT_CODECS,
    DEFAULT_DISKS,
    DEFAULT_MAX_BYTES,
    run_codec_bench,
)
from k3core.tools.bench.codec import format_lines as codec_lines
from k3core.tools.bench.io import DiskBenchResult, probe_disk
from k3core.tools.bench.kernels import format_table, run_kernel_bench
from k3core.trunk.windows import WINDOW_BYTES

bench_app = typer.Typer(help="Benchmarks: kernels, storage I/O, the memory ladder, trunk codecs, decode, serve.",
                        no_args_is_help=True)


@bench_app.command("kernels")
@guarded
def kernels(
    backends: str = typer.Option("", "--backends", help="Comma-separated names (default: every available one)."),
    threads: int = typer.Option(1, "--threads", help="Threads for every backend and the bandwidth loop."),
    repeat: int = typer.Option(5, "--repeat", help="Timed calls per op (median reported)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Time each op at the real widths; GB/s of weight bytes next to memory read bandwidth."""
    names = [n for n in backends.split(",") if n]
    result = run_kernel_bench(names, threads, repeat)
    print(result.to_json() if as_json else format_table(result))


def _ratios(res: DiskBenchResult, backends: list[str], sizes: list[int], depths: list[int]) -> list[str]:
    out = []
    for b in backends:
        for size in sizes:
            for d in depths:
                got = res.mb_per_s(f"storage {b}", size, d)
                raw = res.mb_per_s("raw O_DIRECT", size, d)
                if got and raw:
                    out.append(f"{b} at {size / 1e6:.1f} MB, QD{d}: {got:,.0f} MB/s = {100 * got / raw:.0f}% of raw O_DIRECT")
    return out


@bench_app.command("io")
@guarded
def io(
    target: Path = typer.Argument(..., help="A file to read, or a directory to write a probe file in."),
    probe_gb: float = typer.Option(1.0, "--probe-gb", help="Size of the probe file written in a directory (GB)."),
    storage: str = typer.Option("direct,mmap", "--storage", help="Storage backends to measure beside the raw probe."),
    read_mb: str = typer.Option(f"{EXPERT_BYTES / 1e6:.6f}", "--read-mb", help="Read sizes in MB (comma-separated)."),
    depths: str = typer.Option("1,4,16", "--depths", help="Queue depths."),
    reads: int = typer.Option(40, "--reads", help="Reads per measurement."),
    as_json: bool = typer.Option(False, "--json", help="Print the samples as JSON."),
) -> None:
    """Random reads the way the engine reads, per storage backend and raw, same run."""
    check_gb(probe_gb, "--probe-gb", positive=True)
    try:
        mbs = [float(x) for x in read_mb.split(",") if x]
        qds = [int(x) for x in depths.split(",") if x]
    except ValueError as exc:
        raise UsageError(f"bench io: {exc}") from None
    for mb in mbs:
        check_mb(mb, "--read-mb")
    sizes = [int(round(mb * 1e6)) // ALIGN * ALIGN or ALIGN for mb in mbs]
    if not sizes or not qds or min(qds) < 1 or reads < 1 or not probe_gb > 0:
        raise UsageError("bench io: read sizes, depths >= 1, --reads >= 1 and --probe-gb > 0 are required")
    names = [n for n in storage.split(",") if n]
    res = probe_disk(target, probe_bytes=int(probe_gb * 1e9), read_sizes=sizes, depths=qds, reads=reads,
                     backends=names)
    if as_json:
        print(json.dumps({"path": str(res.path), "file_size": res.file_size, "notes": res.notes,
                          "samples": [dict(zip(DiskBenchResult.HEADER, r, strict=True)) for r in res.rows()],
                          "ratios": _ratios(res, names, sizes, qds)}))
        return
    t = Table(title=f"k3 bench io: {res.path} ({res.file_size / 1e9:.2f} GB)")
    for col in DiskBenchResult.HEADER:
        t.add_column(col)
    for row in res.rows():
        t.add_row(*row)
    console = Console(highlight=False)
    console.print(t)
    for line in res.notes + _ratios(res, names, sizes, qds):
        console.print(line, markup=False)


bench_app.command("ladder")(bench_ladder)


@bench_app.command("codec")
@guarded
def codec(
    model: Path = typer.Argument(..., help="Model directory (or any directory of safetensors shards)."),
    codecs: str = typer.Option(",".join(DEFAULT_CODECS), "--codecs", help="Codecs NAME[:LEVEL], comma-separated."),
    max_mb: float = typer.Option(DEFAULT_MAX_BYTES / 1e6, "--max-mb", help="Raw MB measured at most (whole runs spread over the walk)."),
    window_kb: int = typer.Option(WINDOW_BYTES // 1024, "--window-kb", help="Raw window size in KiB (the packer's is 1024)."),
    repeat: int = typer.Option(3, "--repeat", help="Decode passes per codec (the fastest is kept)."),
    disks: str = typer.Option(",".join(f"{d:g}" for d in DEFAULT_DISKS), "--disk-gb-s", help="Disk speeds (GB/s) to show the delivered raw GB/s for."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Ratio and one-core decode GB/s of each trunk codec on the model's own trunk bytes."""
    specs = [c for c in codecs.split(",") if c.strip()]
    if not specs:
        raise UsageError("bench codec: --codecs lists no codec")
    try:
        speeds = tuple(float(d) for d in disks.split(",") if d.strip())
    except ValueError:
        raise UsageError(f"bench codec: --disk-gb-s expects GB/s values like 0.5,2; got {disks!r}") from None
    for d in speeds:
        check_gb(d, "--disk-gb-s", positive=True)
    check_mb(max_mb, "--max-mb")
    res = run_codec_bench(model, specs, int(max_mb * 1e6), repeat, window_kb * 1024, speeds)
    print(res.to_json() if as_json else "\n".join(codec_lines(res)))


#: what the engine flags mean to k3 bench decode, beyond a run's meaning
DECODE_NOTES = {
    "backend": "the backend timed (the ids are checked against numpy)",
    "threads": "the bandwidth loop's too",
    "prefill_chunk": "the prefill runs only (checked against one numpy pass)",
    "incremental": "the mode timed",
}


@bench_app.command("decode")
@guarded
@engine_flags(after="model", notes=DECODE_NOTES)
def decode(
    model: Path = typer.Argument(..., help="Model directory (a checkpoint in the released layout)."),
    ids: str = typer.Option("3,7,11,5,9", "--ids", help="Prompt ids of the decode runs."),
    gen: int = typer.Option(32, "--gen", help="Tokens per decode run (the first is not timed)."),
    prefill: int = typer.Option(128, "--prefill", help="Random prompt ids of the prefill runs (0: none)."),
    repeat: int = typer.Option(3, "--repeat", help="Runs of each kind, each from a fresh engine (medians)."),
    batch: int = typer.Option(1, "--batch", help="Sequences decoded together per timed round (>1: aggregate tokens/s against 1 sequence)."),
    context: str = typer.Option("", "--context", help="Also decode at built contexts of these many positions (e.g. 1K,8K,32K): s/token and latent attention's cost per position against its FLOP floor."),
    check: bool = typer.Option(True, "--check/--no-check", help="Check the ids against --backend numpy."),
    bandwidth_mb: float = typer.Option(1024.0, "--bandwidth-mb", help="Buffer of the read-bandwidth loop (MB)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    spec: str = typer.Option("off", "--spec", help="Speculative decoding: off, ngram or auto (docs/speculative.md)."),
    spec_width: int = typer.Option(4, "--spec-width", help="Drafts verified per pass at most (1..16)."),
    spec_ngram: int = typer.Option(3, "--spec-ngram", help="Longest context suffix looked up (1..8)."),
    prompt_file: Path | None = typer.Option(None, "--prompt-file", help="Decode prompt as text (the model's tokenizer), instead of --ids."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress on stderr."),
    *,
    flags: EngineFlags,
) -> None:
    """s/token, prefill tokens/s, bytes, I/O wait, calls per token, next to the bandwidth floor."""
    from k3core.api.errors import K3Error
    from k3core.model.speculative import SpecOptions
    from k3core.tools.bench.decode import _ids, contexts_of, format_report, run_decode_bench

    request = flags.request(model_dir=model)
    check_mb(bandwidth_mb, "--bandwidth-mb")
    units = {"timed": "token", "prefill": "run", "yardsticks": "loop", "check": "token",
             "context": "token"}
    with Stages("bench decode", quiet=quiet, units=units) as stages:
        res = run_decode_bench(request, ids=_ids(ids), gen=gen, prefill=prefill, repeat=repeat,
                               check=check, bandwidth_bytes=int(bandwidth_mb * 1e6),
                               spec=SpecOptions(spec, spec_width, spec_ngram),
                               prompt_file=prompt_file, batch=batch,
                               contexts=contexts_of(context), progress=stages)
    print(res.to_json() if as_json else format_report(res))
    if res.check.ids_match is False:
        raise K3Error("bench decode: the generated ids differ from --backend numpy")
    if res.check.spec_ids_match is False:
        raise K3Error("bench decode: the generated ids differ from --spec off")
    if res.check.batch_ids_match is False:
        raise K3Error("bench decode: batched rows' ids differ from their prompts run alone on --backend numpy")
    if res.context.context_ids_match is False:
        raise K3Error("bench decode: the ids at a built context differ from --backend numpy")


def _serve_flags(given: dict[str, object]) -> list[str]:
    """The engine flags given, as ``k3 serve``'s command line."""
    from k3core.cli.options import FLAGS

    out = []
    for name, value in given.items():
        if value is None or value is False or value == []:
            continue
        flag = FLAGS[name][0]
        out += [flag] if value is True else [f"{flag}={v}" for v in (value if isinstance(value, list) else [value])]
    return out


@bench_app.command("serve")
@guarded
@engine_flags(omit=("incremental",), after="model")
def serve(
    model: Path = typer.Argument(..., help="Model directory (with its tokenizer)."),
    clients: int = typer.Option(4, "--clients", help="Clients at once in the concurrent phase."),
    requests: int = typer.Option(16, "--requests", help="Requests of the concurrent phase (the lone client sends 3 at most)."),
    prompt_tokens: int = typer.Option(128, "--prompt-tokens", help="Random prompt ids per request (distinct per request)."),
    max_tokens: int = typer.Option(64, "--max-tokens", help="Tokens each request generates (ignore_eos)."),
    warmup: int = typer.Option(1, "--warmup", help="Requests sent first and not measured."),
    seed: int = typer.Option(0, "--seed", help="Seed of the prompt ids."),
    serve_arg: list[str] = typer.Option([], "--serve-arg", help="One more argument for k3 serve (repeatable: --serve-arg=--max-queue=128)."),
    start_timeout: float = typer.Option(300.0, "--start-timeout", help="Seconds the server may take to answer /health."),
    timeout: float = typer.Option(600.0, "--timeout", help="Seconds a request may go without a byte from the server."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress on stderr."),
    *,
    flags: EngineFlags,
) -> None:
    """Tokens/s, time to first token and inter-token latency of a real k3 serve, 1 client against N."""
    import sys

    from k3core.model.config import load_config
    from k3core.run.prompt import MAX_PROMPT
    from k3core.run.request import MAX_GEN
    from k3core.tools.bench.serve import ServerFailed, Workload, format_report, run_serve_bench

    for flag, value in (("--clients", clients), ("--requests", requests),
                        ("--prompt-tokens", prompt_tokens), ("--max-tokens", max_tokens)):
        if value < 1:
            raise UsageError(f"bench serve: {flag} must be >= 1, got {value}")
    if warmup < 0:
        raise UsageError(f"bench serve: --warmup must be >= 0, got {warmup}")
    if max_tokens > MAX_GEN or prompt_tokens + max_tokens > MAX_PROMPT:
        raise UsageError(f"bench serve: --max-tokens must be at most {MAX_GEN} and --prompt-tokens + "
                         f"--max-tokens at most {MAX_PROMPT}, got {max_tokens} and {prompt_tokens + max_tokens}")
    if not start_timeout > 0 or not timeout > 0:
        raise UsageError("bench serve: --start-timeout and --timeout must be > 0")
    if not model.is_dir():
        raise UsageError(f"bench serve: MODEL_DIR {model} is not a directory")
    flags.request(model_dir=model)  # bad engine flags refused here, before a server starts
    vocab = load_config(flags.given.get("config") or model).vocab
    extra = _serve_flags(flags.given)
    if prompt_tokens + max_tokens > MAX_GEN and not any(a.startswith("--context") for a in serve_arg):
        extra.append(f"--context={prompt_tokens + max_tokens}")  # past the server's default
    if not any(a.startswith("--max-queue") for a in serve_arg):
        extra.append(f"--max-queue={max(64, clients)}")
    work = Workload(clients, requests, prompt_tokens, max_tokens, warmup, seed)
    units = {"warm-up": "request", "lone": "request", "concurrent": "request"}
    with Stages("bench serve", quiet=quiet, units=units) as stages:
        try:
            res = run_serve_bench(model, work, vocab=vocab, server_args=[*extra, *serve_arg],
                                  start_timeout=start_timeout, timeout=timeout,
                                  progress=stages, note=stages.note)
        except ServerFailed as exc:
            stages.close(ok=False)
            for line in exc.tail:
                print(f"  server: {line}", file=sys.stderr)
            raise
    print(res.to_json() if as_json else format_report(res))


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")
