"""Build the demo model's corpus from the CPython standard library of the running Python.

The corpus is every top-level ``*.py`` file of ``sysconfig.get_paths()['stdlib']`` (no
packages, no tests), which anyone with the same Python release has byte for byte. The
Python Software Foundation License covers these files (``LICENSE.txt`` of the CPython
distribution). A fixed list of files (:data:`HELD_OUT`) is the held-out split: training
and the tokenizer never see it.

``python -m tools.train.corpus OUT_DIR`` writes ``train.txt`` and ``heldout.txt`` (each file
preceded by a ``# ---- file: NAME ----`` line) and checks every file against the manifest
committed beside this script (``tools/train/corpus_manifest.json``); ``--write-manifest``
rewrites the manifest instead (done once, when the corpus was chosen).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
from pathlib import Path

MANIFEST = Path(__file__).with_name("corpus_manifest.json")
LICENSE = "PSF-2.0 (Python Software Foundation License; CPython LICENSE.txt)"
#: files kept out of training and of the tokenizer (ordinary library code of varied style)
HELD_OUT = (
    "bisect.py", "calendar.py", "fnmatch.py", "heapq.py", "queue.py", "sched.py",
    "shlex.py", "textwrap.py", "colorsys.py", "graphlib.py", "netrc.py", "stat.py",
)


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path) -> list[Path]:
    """The top-level ``*.py`` files of the standard library, sorted by name."""
    return sorted((p for p in root.glob("*.py") if p.is_file()), key=lambda p: p.name)


def header(name: str) -> bytes:
    return f"# ---- file: {name} ----\n".encode()


def build(root: Path) -> tuple[dict[str, object], bytes, bytes]:
    """The manifest and the two splits' bytes."""
    files = []
    train, held = [], []
    for p in source_files(root):
        data = p.read_bytes()
        split = "heldout" if p.name in HELD_OUT else "train"
        files.append({"name": p.name, "bytes": len(data),
                      "sha256": hashlib.sha256(data).hexdigest(), "split": split})
        (held if split == "heldout" else train).append(header(p.name) + data)
    manifest = {
        "source": "CPython standard library, top-level *.py of sysconfig.get_paths()['stdlib']",
        "python": sys.version.split()[0],
        "license": LICENSE,
        "held_out": list(HELD_OUT),
        "files": files,
    }
    return manifest, b"".join(train), b"".join(held)


def check(manifest: dict[str, object], want: dict[str, object]) -> list[str]:
    """Differences between the manifest just built and the committed one."""
    problems = []
    if manifest["python"] != want["python"]:
        problems.append(f"Python {manifest['python']} here, the manifest is for {want['python']}")
    got = {f["name"]: f for f in manifest["files"]}  # type: ignore[attr-defined]
    exp = {f["name"]: f for f in want["files"]}  # type: ignore[attr-defined]
    for name in sorted(set(got) | set(exp)):
        if name not in got:
            problems.append(f"{name}: missing here")
        elif name not in exp:
            problems.append(f"{name}: not in the manifest")
        elif got[name]["sha256"] != exp[name]["sha256"]:
            problems.append(f"{name}: sha256 differs")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--write-manifest", action="store_true")
    args = ap.parse_args(argv)
    manifest, train, held = build(stdlib_dir())
    if args.write_manifest:
        MANIFEST.write_text(json.dumps(manifest, indent=1) + "\n")
    else:
        problems = check(manifest, json.loads(MANIFEST.read_text()))
        if problems:
            for p in problems[:20]:
                print(f"corpus: {p}", file=sys.stderr)
            print("corpus: this Python's standard library is not the corpus of the manifest",
                  file=sys.stderr)
            return 1
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "train.txt").write_bytes(train)
    (args.out_dir / "heldout.txt").write_bytes(held)
    n = len(manifest["files"])  # type: ignore[arg-type]
    print(f"corpus: {n} files, train {len(train)} bytes, held-out {len(held)} bytes "
          f"-> {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
