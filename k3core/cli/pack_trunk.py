"""``k3 pack-trunk MODEL_DIR TRUNK_DIR``: pack every layer's trunk into one aligned file."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import typer

from k3core.api.units import human
from k3core.checkpoint.index import CheckpointIndex
from k3core.cli.guard import guarded
from k3core.cli.progress import Progress
from k3core.model.config import load_config
from k3core.plugins.registry import get_registry
from k3core.run.model_dir import config_path
from k3core.trunk.codec import parse_codec
from k3core.trunk.pack import check_target
from k3core.trunk.pack import pack_trunk as pack
from k3core.trunk.parts import stream_unit_sizes
from k3core.trunk.plan import floor_flag, trunk_floor


@guarded
def pack_trunk(
    model_dir: Path = typer.Argument(..., help="Directory with the safetensors shards."),
    trunk_dir: Path = typer.Argument(..., help="Directory to write trunk.bin and trunk.json into."),
    storage: str = typer.Option("auto", "--storage", help="Storage backend to read the shards with."),
    config: Path = typer.Option(None, "--config", help="Model config (default MODEL_DIR/config.json)."),
    force: bool = typer.Option(False, "--force", help="Replace a packed trunk already in TRUNK_DIR."),
    codec: str = typer.Option("auto", "--codec", help="Lossless codec NAME[:LEVEL]: none, zstd, "
                              "lz4, bp-zstd, bp-lz4, bp-nib, bp-bits (bp-: bf16 byte planes "
                              "first; bp-bits stores bell-shaped weights smallest of the fast "
                              "ones; docs/trunk.md compares them), or auto: whichever streams "
                              "fastest from the trunk's disk, measured first (docs/trunk.md)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress on stderr."),
) -> None:
    """Copy every layer's non-expert tensors into TRUNK_DIR/trunk.bin (4096-aligned runs)."""
    auto = codec.strip() == "auto"
    chosen = None if auto else parse_codec(codec)
    cfg_path = config_path(model_dir, config)
    cfg = load_config(cfg_path)
    backend, sname, note = get_registry().create("storage", storage, for_path=model_dir)
    if note:
        print(f"note: {note}", file=sys.stderr)
    reads = [(cfg_path, "--config" if config else "the config")]
    t0 = time.perf_counter()
    with CheckpointIndex.open(model_dir, backend) as index:
        if chosen is None:  # measured only for a trunk that may be written
            from k3core.tools.bench.codec_choice import choose_codec

            check_target(index, trunk_dir, force, reads)
            choice = choose_codec(index, cfg, trunk_dir, sname)
            if not quiet:
                print("\n".join(choice.lines()), file=sys.stderr)
            chosen = parse_codec(choice.spec)
        with Progress("pack-trunk", byte_units=True, quiet=quiet) as bar:

            def on_layer(done: int, n: int, nbytes: int, total: int) -> None:
                bar.update(nbytes, total, f"layer {done}/{n}")

            man = pack(index, cfg, trunk_dir, backend, force=force, progress=on_layer,
                       codec=chosen, reads=reads)
    secs = time.perf_counter() - t0
    largest = max(lay.nbytes for lay in man.layers)
    if man.compressed:
        raw = sum(lay.nbytes for lay in man.layers)
        print(f"codec {chosen.spec}: {human(raw)} of raw runs stored in "
              f"{human(man.total_bytes)} (ratio {raw / man.total_bytes:.3f}), "
              f"{sum(len(lay.windows) for lay in man.layers)} windows")
    print(f"packed {man.n_layers} layers, {human(man.total_bytes)} into "
          f"{man.bin_path} in {secs:.2f} s ({man.total_bytes / max(secs, 1e-9) / 1e6:.0f} MB/s, "
          f"storage '{sname}')")
    floor = trunk_floor(stream_unit_sizes(man))
    print(f"largest layer run {human(largest)}, largest streaming part {human(floor)}: "
          f"{floor_flag(floor)} is the floor (one ring slot of that part)")


def register(app: typer.Typer) -> None:
    app.command("pack-trunk")(pack_trunk)
