"""The docs stand on their own: every module is on the map, every cited file exists."""

from __future__ import annotations

import re
import subprocess

from imports import PACKAGE, ROOT

ARCH = ROOT / "docs/architecture.md"
_MD = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w-]+\.md)\b")
_K3CORE_PATH = re.compile(r"\bk3core(?:/\w+)+\.py\b")


def _tracked(*suffixes: str) -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:  # not a checkout (an unpacked sdist): look at the tree instead
        return [str(p.relative_to(ROOT)) for s in suffixes for p in ROOT.rglob(f"*{s}")
                if ".venv" not in p.parts]
    return [f for f in out.stdout.split() if f.endswith(suffixes)]


def test_the_architecture_module_table_lists_every_module():
    text = ARCH.read_text()
    missing = [str(p.relative_to(ROOT)) for p in sorted(PACKAGE.rglob("*.py"))
               if p.name != "__init__.py" and f"`{p.relative_to(ROOT)}`" not in text]
    assert missing == [], f"docs/architecture.md does not list {missing}"


def test_every_k3core_path_the_docs_name_exists():
    bad = []
    for f in _tracked(".md"):
        for n, line in enumerate((ROOT / f).read_text().splitlines(), 1):
            bad += [f"{f}:{n}: {m}" for m in _K3CORE_PATH.findall(line) if not (ROOT / m).exists()]
    assert bad == []


def test_every_cited_markdown_file_is_in_the_repository():
    """No code or doc cites a document the repository does not hold."""
    bad = []
    for f in _tracked(".py", ".md", ".c", ".h"):
        here = (ROOT / f).parent
        for n, line in enumerate((ROOT / f).read_text().splitlines(), 1):
            for m in _MD.findall(line):
                if not any(c.exists() and c.resolve().is_relative_to(ROOT)
                           for c in (ROOT / m, here / m)):
                    bad.append(f"{f}:{n}: {m}")
    assert bad == []
