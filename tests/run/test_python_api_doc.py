"""Every ``python`` block of ``docs/python-api.md`` runs, in order, on a tiny synthetic model."""

from __future__ import annotations

import re
from pathlib import Path

from k3core.model.config import ModelConfig
from k3core.model.shapes import size_config
from k3core.tools.synth.writer import synthesize

DOC = Path(__file__).resolve().parents[2] / "docs/python-api.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def test_the_blocks_exist():
    assert len(BLOCK.findall(DOC.read_text())) >= 8


def test_every_example_runs(tmp_path, capsys):
    model = synthesize(tmp_path / "tiny", ModelConfig.from_json_dict(size_config("tiny")), seed=0)
    scope: dict[str, object] = {"MODEL": str(model), "__name__": "python_api_doc"}
    for i, code in enumerate(BLOCK.findall(DOC.read_text())):
        exec(compile(code, f"{DOC.name} block {i + 1}", "exec"), scope)
    out = capsys.readouterr().out
    assert "k3: kernel=" in out and "refused: max_tokens must be in 0..4096" in out
    engine = scope["engine"]
    assert engine.closed  # type: ignore[attr-defined]
