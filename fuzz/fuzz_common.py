"""Shared parts of the coverage-guided fuzz harnesses (atheris / libFuzzer).

Every harness is ``bytes -> one k3 reader``: the reader either returns a value the harness
then checks, or raises a :class:`~k3core.api.errors.K3Error` (a refusal). Anything else (an
``IndexError``, a ``MemoryError``, a ``RecursionError``, an assertion in the harness) is a
crash, which atheris reports with the input that caused it, saved as ``crash-*`` under
``build/fuzz/crashes/``.

Run one: ``.venv/bin/python fuzz/fuzz_config.py -max_total_time=60`` (any libFuzzer flag
works), or all of them: ``make fuzz FUZZ_SECONDS=60``. Each starts from a seed corpus made
from a synthetic tiny model (``build/fuzz/corpus/<target>/``, kept between runs so coverage
accumulates). Without atheris installed the harnesses still import, so the test suite runs
each one over its seeds (``tests/fuzz/test_fuzz_harnesses.py``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build" / "fuzz"


def instrumented(module_name: str) -> contextlib.AbstractContextManager[Any]:
    """Instrument k3core's modules for coverage, only when a harness runs as a fuzzer."""
    if module_name != "__main__":
        return contextlib.nullcontext()
    try:
        import atheris
    except ImportError:
        return contextlib.nullcontext()
    return atheris.instrument_imports(include=["k3core"])


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence warnings a hostile input may legitimately trigger (not crashes)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def tiny_model(root: Path | None = None) -> tuple[Path, Path]:
    """A 2-layer synthetic model and its packed trunk (made once, under ``build/fuzz``)."""
    from k3core.model.config import ModelConfig
    from k3core.model.shapes import size_config
    from k3core.tools.synth.writer import synthesize

    base = root or BUILD
    model, trunk = base / "tiny", base / "tiny-trunk"
    if not (trunk / "trunk.json").is_file():
        from k3_storage.plain import PlainStorage

        from k3core.checkpoint.index import CheckpointIndex
        from k3core.trunk.pack import pack_trunk

        cfg = ModelConfig.from_json_dict(size_config("tiny", {"num_hidden_layers": 2,
                                                              "full_attn_layers": [2]}))
        synthesize(model, cfg, 11, force=True)
        with CheckpointIndex.open(model, PlainStorage()) as idx:
            pack_trunk(idx, cfg, trunk, PlainStorage(), force=True)
    return model, trunk


def main(one_input: Callable[[bytes], None], seeds: list[bytes], target: str,
         json_dict: bool = False) -> None:
    """Fuzz ``one_input`` with atheris, seeded with ``seeds`` (libFuzzer flags in argv);
    ``json_dict`` adds ``fuzz/json.dict`` (JSON tokens and the readers' key names)."""
    try:
        import atheris
    except ImportError:
        sys.exit("atheris is not installed: `.venv/bin/pip install atheris` (or `make fuzz`, "
                 "which installs it); it has wheels for CPython 3.8-3.11 on Linux x86-64")
    corpus = BUILD / "corpus" / target
    crashes = BUILD / "crashes"
    corpus.mkdir(parents=True, exist_ok=True)
    crashes.mkdir(parents=True, exist_ok=True)
    for s in seeds:
        (corpus / hashlib.sha1(s).hexdigest()).write_bytes(s)
    args = [a for a in sys.argv]
    if not any(a.startswith("-artifact_prefix=") for a in args):
        args.insert(1, f"-artifact_prefix={crashes}{os.sep}{target}-")
    if json_dict and not any(a.startswith("-dict=") for a in args):
        args.insert(1, f"-dict={Path(__file__).with_name('json.dict')}")
    if not any(not a.startswith("-") for a in args[1:]):
        args.append(str(corpus))
    atheris.Setup(args, one_input)
    atheris.Fuzz()
