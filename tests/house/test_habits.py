"""The project's habits hold: `make help` lists every target, CI lints before it tests, and
CONTRIBUTING.md says how to work here."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
from imports import ROOT

MAKEFILE = ROOT / "Makefile"
_TARGET = re.compile(r"^([a-z][a-z-]*):(?!=)", re.M)


def _targets() -> set[str]:
    return set(_TARGET.findall(MAKEFILE.read_text()))


def test_every_make_target_says_what_it_does():
    text = MAKEFILE.read_text()
    silent = sorted(t for t in _targets() if f"\n## {t}: " not in text)
    assert silent == [], f"Makefile targets without a '## target: ...' comment: {silent}"


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_help_lists_every_target():
    out = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    listed = {line.split()[0] for line in out.stdout.splitlines()
              if line.startswith("  ") and not line.startswith("   ")}
    assert listed == _targets()


def test_ci_lints_before_it_tests():
    steps = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()
             if line.strip().startswith("make ")]
    assert steps == ["make lint", "make test"]


def test_contributing_names_the_commands_it_teaches():
    text = (ROOT / "CONTRIBUTING.md").read_text()
    for words in ("make test", "make test-long", "make fuzz", "make lint", "make bench",
                  "docs/kernel-contract.md", "bit-identical"):
        assert words in text.lower(), words
    for target in re.findall(r"`make ([a-z-]+)", text):
        assert target in _targets(), f"CONTRIBUTING.md names `make {target}`, which is no target"
