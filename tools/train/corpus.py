"""Build the demo model's corpus: Python code and English prose, every source pinned.

Sources (:data:`SOURCES`, with their licences in the manifest):

* the CPython standard library of the running Python (``sysconfig.get_paths()['stdlib']``):
  every ``*.py`` below it outside test directories, ``site-packages``, the bundled wheels and
  the ``encodings`` tables, as **code**; the Language Reference topics of
  ``pydoc_data/topics.py`` (the text ``help()`` prints) as **prose**;
* source distributions of well-known packages from the package index, each pinned by
  version and by the sha256 of its archive: their ``*.py`` files (outside test directories)
  as **code**, their documentation (``*.rst``, ``*.txt``, ``*.md`` under ``doc``/``docs``,
  and the top-level README and changelog) as **prose**.

``pip download --no-deps --no-binary :all:`` fetches the archives into ``WORK/sources`` (this
is the only step that reaches the network, and only when an archive is missing); every
archive is checked against the manifest before it is read. Files are deduplicated by content
(the first in source order is kept). Held out by source, never seen by the tokenizer or the
training: the whole ``flask`` distribution (code and documentation) and twelve standard
library modules (:data:`HELD_OUT_STDLIB`, the old demo corpus's held-out split).

``python -m tools.train.corpus OUT_DIR`` writes ``train_code.txt``, ``train_prose.txt``,
``heldout_code.txt``, ``heldout_prose.txt`` (each file preceded by a
``# ---- file: SOURCE/PATH ----`` line), ``train.txt`` and ``heldout.txt`` (code then prose)
and ``functions.json`` (the training code's documented functions, for the chat transcripts
of :mod:`tools.train.chat_data`). ``--write-manifest`` rewrites
``tools/train/corpus_manifest.json`` from what it read (done once, when the corpus was chosen).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import subprocess
import sys
import sysconfig
import tarfile
from dataclasses import dataclass
from pathlib import Path

MANIFEST = Path(__file__).with_name("corpus_manifest.json")
STDLIB_LICENSE = "PSF-2.0 (Python Software Foundation License; CPython LICENSE.txt)"
#: (distribution, version) fetched as source archives from the package index
SOURCES = (
    ("requests", "2.34.2"), ("click", "8.5.1"), ("jinja2", "3.1.6"), ("werkzeug", "3.1.9"),
    ("attrs", "26.1.0"), ("pytest", "9.2.0"), ("sphinx", "9.0.4"), ("docutils", "0.23"),
    ("python-dateutil", "4.0.0"), ("rich", "15.0.0"), ("more-itertools", "11.2.1"),
    ("packaging", "26.4"), ("pluggy", "1.7.0"), ("setuptools", "84.2.1"),
    ("django", "5.2.20"), ("sqlalchemy", "2.1.9"), ("flask", "3.1.3"),
)
HELD_OUT_SOURCES = ("flask",)
HELD_OUT_STDLIB = (
    "bisect.py", "calendar.py", "fnmatch.py", "heapq.py", "queue.py", "sched.py",
    "shlex.py", "textwrap.py", "colorsys.py", "graphlib.py", "netrc.py", "stat.py",
)
_SKIP_DIRS = {"test", "tests", "testing", "idle_test", "site-packages", "_bundled", "locale",
              "encodings", "migrations", "__pycache__", "egg-info"}
_PROSE_SUFFIX = (".rst", ".txt", ".md")
_PROSE_SKIP = re.compile(r"licen[cs]e|copying|authors|requirements|sources\.txt|top_level|"
                         r"entry_points|dependency_links|not-zip-safe|robots", re.I)
_TOP_PROSE = re.compile(r"^(readme|changes|changelog|history|news)", re.I)
_LICENSE_FIELDS = ("License-Expression", "License")
#: where an archive's metadata states its licence loosely, what its licence file says
LICENSE_READ = {
    "jinja2": "BSD-3-Clause (LICENSE.txt)",
    "docutils": "Public Domain and BSD-2-Clause for the files read here (COPYING.rst; its "
                "GPL covers only an Emacs mode, not read)",
}


@dataclass
class Piece:
    source: str
    path: str
    kind: str  # "code" or "prose"
    data: bytes


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def header(source: str, path: str) -> bytes:
    return f"# ---- file: {source}/{path} ----\n".encode()


def _skipped(parts: tuple[str, ...]) -> bool:
    return any(p in _SKIP_DIRS or p.endswith(".egg-info") for p in parts)


def stdlib_pieces(root: Path) -> list[Piece]:
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if _skipped(rel.parts[:-1]) or not p.is_file():
            continue
        if rel.as_posix() == "pydoc_data/topics.py":
            out.append(Piece("cpython", rel.as_posix(), "prose", topics_prose(p.read_bytes())))
            continue
        out.append(Piece("cpython", rel.as_posix(), "code", p.read_bytes()))
    return out


def topics_prose(src: bytes) -> bytes:
    """The text of ``pydoc_data/topics.py``: its topics in key order, blank-line separated."""
    tree = ast.parse(src)
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            topics = {ast.literal_eval(k): ast.literal_eval(v)
                      for k, v in zip(node.keys, node.values, strict=True) if k is not None}
            return "\n\n".join(topics[k] for k in sorted(topics)).encode()
    raise ValueError("pydoc_data/topics.py holds no topics")


def _kind(rel: str) -> str | None:
    parts = rel.split("/")
    if _skipped(tuple(parts[:-1])):
        return None
    name = parts[-1]
    if name.endswith(".py"):
        return "code"
    if not name.lower().endswith(_PROSE_SUFFIX) or _PROSE_SKIP.search(name):
        return None
    if len(parts) == 1:
        return "prose" if _TOP_PROSE.match(name) else None
    return "prose" if parts[0].lower() in ("doc", "docs") else None


def archive_pieces(dist: str, archive: Path) -> tuple[list[Piece], str]:
    """The code and prose of one source archive, and the licence its metadata states."""
    pieces, lic = [], ""
    with tarfile.open(archive) as tf:
        members = sorted((m for m in tf.getmembers() if m.isfile()), key=lambda m: m.name)
        for m in members:
            rel = m.name.split("/", 1)[1] if "/" in m.name else m.name
            f = tf.extractfile(m)
            if f is None:
                continue
            if rel == "PKG-INFO":
                lic = _license(f.read().decode("utf-8", "replace"))
                continue
            kind = _kind(rel)
            if kind is None:
                continue
            data = f.read()
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                continue
            pieces.append(Piece(dist, rel, kind, data))
    return pieces, lic


def _license(pkg_info: str) -> str:
    fields: dict[str, str] = {}
    classifiers = []
    for line in pkg_info.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(": ")
        if key in _LICENSE_FIELDS and key not in fields:
            fields[key] = value.strip()
        if key == "Classifier" and value.startswith("License ::"):
            classifiers.append(value.split("::")[-1].strip())
    for key in _LICENSE_FIELDS:
        if fields.get(key) and len(fields[key]) < 80:
            return fields[key]
    return "; ".join(classifiers) or "see the archive's LICENSE file"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name.lower())


def fetch(sources_dir: Path, dist: str, version: str) -> Path:
    """The source archive of ``dist==version`` in ``sources_dir``, downloaded if missing."""
    sources_dir.mkdir(parents=True, exist_ok=True)
    want = _norm(f"{dist}-{version}.tar.gz")
    found = [p for p in sources_dir.glob("*.tar.gz") if _norm(p.name) == want]
    if found:
        return found[0]
    print(f"corpus: fetching {dist}=={version} (source archive) from the package index",
          file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary",
                    ":all:", "-d", str(sources_dir), f"{dist}=={version}"], check=True)
    found = [p for p in sources_dir.glob("*.tar.gz") if _norm(p.name) == want]
    if not found:
        raise SystemExit(f"corpus: pip fetched no {dist}-{version}.tar.gz into {sources_dir}")
    return found[0]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def build(sources_dir: Path) -> tuple[dict[str, object], dict[str, list[Piece]]]:
    """The manifest and the pieces of each split (``train``/``heldout`` x ``code``/``prose``)."""
    entries: list[dict[str, object]] = []
    pieces = stdlib_pieces(stdlib_dir())
    digest = hashlib.sha256()
    for p in pieces:
        digest.update(f"{p.path}\0{sha256(p.data)}\n".encode())
    entries.append({"name": "cpython-stdlib", "version": sys.version.split()[0],
                    "license": STDLIB_LICENSE, "origin": "sysconfig.get_paths()['stdlib']",
                    "files_sha256": digest.hexdigest()})
    for dist, version in SOURCES:
        archive = fetch(sources_dir, dist, version)
        got, lic = archive_pieces(dist, archive)
        pieces += got
        entries.append({"name": dist, "version": version, "license": LICENSE_READ.get(dist, lic),
                        "origin": f"source archive {archive.name} (package index)",
                        "sha256": sha256(archive.read_bytes())})
    splits: dict[str, list[Piece]] = {f"{s}_{k}": [] for s in ("train", "heldout")
                                      for k in ("code", "prose")}
    seen: set[str] = set()
    counts: dict[str, dict[str, int]] = {}
    for p in pieces:
        h = sha256(p.data)
        if h in seen or not p.data.strip():
            continue
        seen.add(h)
        held = p.source in HELD_OUT_SOURCES or (
            p.source == "cpython" and p.path in HELD_OUT_STDLIB)
        split = f"{'heldout' if held else 'train'}_{p.kind}"
        splits[split].append(p)
        c = counts.setdefault(p.source, {})
        c[f"{split}_files"] = c.get(f"{split}_files", 0) + 1
        c[f"{split}_bytes"] = c.get(f"{split}_bytes", 0) + len(p.data)
    for e in entries:
        key = "cpython" if e["name"] == "cpython-stdlib" else str(e["name"])
        e["split"] = counts.get(key, {})
    manifest: dict[str, object] = {
        "about": "the demo model's corpus (tools/train/corpus.py); deduplicated by content",
        "held_out": {"sources": list(HELD_OUT_SOURCES), "stdlib": list(HELD_OUT_STDLIB)},
        "sources": entries,
    }
    return manifest, splits


def check(manifest: dict[str, object], want: dict[str, object]) -> list[str]:
    """Differences between the sources just read and the committed manifest's."""
    problems = []
    got = {e["name"]: e for e in manifest["sources"]}  # type: ignore[attr-defined]
    exp = {e["name"]: e for e in want["sources"]}  # type: ignore[attr-defined]
    for name in sorted(set(got) | set(exp)):
        if name not in got or name not in exp:
            problems.append(f"{name}: {'missing here' if name not in got else 'not in the manifest'}")
            continue
        for key in ("version", "sha256", "files_sha256"):
            if got[name].get(key) != exp[name].get(key):
                problems.append(f"{name}: {key} differs ({got[name].get(key)} here)")
    return problems


def documented_functions(pieces: list[Piece]) -> list[dict[str, str]]:
    """Top-level and method definitions with a docstring: name, signature line, summary, source."""
    out = []
    for p in pieces:
        text = p.data.decode("utf-8", "replace")
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node)
            if not doc or node.name.startswith("__") or node.end_lineno is None:
                continue
            summary = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
            body = lines[node.lineno - 1 : node.end_lineno]
            indent = len(body[0]) - len(body[0].lstrip())
            src = "\n".join(ln[indent:] if ln[:indent].strip() == "" else ln for ln in body)
            if not 10 <= len(summary) <= 200 or len(src) > 1500:
                continue
            out.append({"name": node.name, "summary": summary, "source": src,
                        "origin": f"{p.source}/{p.path}"})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--sources", type=Path, default=None,
                    help="where the source archives are kept (default: OUT_DIR/../sources)")
    ap.add_argument("--write-manifest", action="store_true")
    args = ap.parse_args(argv)
    sources_dir = args.sources or args.out_dir.parent / "sources"
    manifest, splits = build(sources_dir)
    if args.write_manifest:
        MANIFEST.write_text(json.dumps(manifest, indent=1) + "\n")
    else:
        problems = check(manifest, json.loads(MANIFEST.read_text()))
        if problems:
            for p in problems[:20]:
                print(f"corpus: {p}", file=sys.stderr)
            print("corpus: these sources are not the corpus of the manifest", file=sys.stderr)
            return 1
    args.out_dir.mkdir(parents=True, exist_ok=True)
    blobs = {name: b"".join(header(p.source, p.path) + p.data.rstrip(b"\n") + b"\n\n"
                            for p in ps) for name, ps in splits.items()}
    for name, blob in blobs.items():
        (args.out_dir / f"{name}.txt").write_bytes(blob)
    (args.out_dir / "train.txt").write_bytes(blobs["train_code"] + blobs["train_prose"])
    (args.out_dir / "heldout.txt").write_bytes(blobs["heldout_code"] + blobs["heldout_prose"])
    funcs = documented_functions(splits["train_code"])
    (args.out_dir / "functions.json").write_text(json.dumps(funcs) + "\n")
    sizes = ", ".join(f"{k} {len(v) / 1e6:.2f} MB ({len(splits[k])} files)"
                      for k, v in blobs.items())
    print(f"corpus: {sizes}; {len(funcs)} documented functions -> {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
