"""The house rules of k3core's import graph, checked on the source of every module."""

from __future__ import annotations

import json
import subprocess
import sys

from imports import PACKAGE, RANK, STAGE, STAGES, cycles, edges, modules, room


def _graph(lazy: bool) -> dict[str, set[str]]:
    g: dict[str, set[str]] = {}
    for e in edges(modules()):
        if lazy or not e.lazy:
            g.setdefault(e.src, set()).add(e.dst)
    return g


def test_no_import_cycle_at_import_time():
    assert cycles(_graph(lazy=False)) == []


def test_no_import_cycle_even_through_function_level_imports():
    assert cycles(_graph(lazy=True)) == []


def test_lower_rooms_never_import_higher_ones():
    bad = []
    for e in edges(modules()):
        src, dst = room(e.src), room(e.dst)
        if src and dst and src != dst and RANK[dst] >= RANK[src]:
            bad.append(f"{e.src}:{e.line} imports {e.dst} ({src} may not import {dst})")
    assert bad == []


def test_every_run_module_has_a_stage():
    run = {m for m in modules() if m.startswith("k3core.run.")}
    assert sorted(run - set(STAGE)) == [], "place it in STAGES (tests/house/imports.py)"
    assert sorted(set(STAGE) - run) == []


def test_the_run_stages_import_in_stage_order():
    """request < plan < bind < report < session < engine < runner, function-level and
    type-checking imports included: no stage reaches up to a later one."""
    names = {rank: name for rank, name in enumerate(STAGES)}
    bad = [f"{e.src}:{e.line} imports {e.dst} ({names[STAGE[e.src]]} may not import "
           f"{names[STAGE[e.dst]]})"
           for e in edges(modules())
           if e.src in STAGE and e.dst in STAGE and STAGE[e.dst] > STAGE[e.src]]
    assert bad == []


def test_the_architecture_page_draws_the_same_stages():
    """docs/architecture.md's table of the stages' import order is this one, row by row."""
    import re

    from imports import ROOT

    text = (ROOT / "docs/architecture.md").read_text()
    section = text.split("### The stages' import order", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| (\w+) \| (`.*`) \|$", section, re.M)
    drawn = {stage: tuple(re.findall(r"`(\w+)`", mods)) for stage, mods in rows}
    assert drawn == STAGES


def test_every_room_is_a_known_package_with_a_docstring():
    import ast

    for child in sorted(PACKAGE.iterdir()):
        if child.is_dir() and (child / "__init__.py").exists():
            assert child.name in RANK, f"k3core/{child.name} has no rank in tests/house/imports.py"
            tree = ast.parse((child / "__init__.py").read_text())
            assert ast.get_docstring(tree), f"k3core/{child.name}/__init__.py needs a docstring"


def test_k3core_top_level_holds_only_the_package_face():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert top == ["__init__.py", "__main__.py"]


def test_commands_never_import_the_app_module():
    bad = [e for e in edges(modules())
           if e.src.startswith("k3core.cli.") and e.dst == "k3core.cli.app"
           and e.src not in ("k3core.cli.__main__",)]
    assert bad == []


def _imported_after(code: str) -> set[str]:
    probe = f"import sys, json\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_help_and_version_load_no_numeric_library_and_no_command():
    for argv in (["--help"], ["--version"]):
        mods = _imported_after(
            "from k3core.cli.app import app\n"
            "try:\n"
            f"    app({argv!r})\n"
            "except SystemExit:\n"
            "    pass"
        )
        heavy = {"numpy", "numba", "pydantic", "safetensors", "tiktoken", "pluggy", "rich"}
        assert not heavy & mods, (argv, sorted(heavy & mods))
        commands = {m for m in mods if m.startswith("k3core.cli.")} - {
            "k3core.cli.app"}
        assert commands == set(), (argv, commands)


def test_run_command_imports_only_what_a_run_uses():
    mods = _imported_after("import k3core.cli.run")
    k3 = {m for m in mods if m.startswith("k3core.")}
    unrelated = {m for m in k3 if m.startswith(("k3core.tools.", "k3core.testing"))
                 or (m.startswith("k3core.cli.") and m not in ("k3core.cli.run", "k3core.cli.guard",
                                                                "k3core.cli.interrupts",
                                                                "k3core.cli.options"))}
    assert unrelated == set()
