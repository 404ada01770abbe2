"""The demo model's corpus and chat transcripts (tools/train/corpus.py, tools/train/chat_data.py).

No network and no torch: the pieces that choose files, read licences, split by source and
shape the chat transcripts, on small inputs built here, plus the committed manifest's
promises (every source pinned by version and sha256, a licence for each, held-out sources
that are not trained on).
"""

from __future__ import annotations

import io
import json
import random
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from k3core.serve.chat_format import XtmlFormat  # noqa: E402
from k3core.tokenizer.encoding import Tokenizer  # noqa: E402
from tools.train import chat_data, corpus  # noqa: E402

DEMO = ROOT / "demo-model"


def test_manifest_pins_every_source_with_its_licence() -> None:
    m = json.loads(corpus.MANIFEST.read_text())
    names = [e["name"] for e in m["sources"]]
    assert names == ["cpython-stdlib"] + [d for d, _ in corpus.SOURCES]
    for e in m["sources"]:
        assert e["license"] and e["version"]
        assert len(e.get("sha256") or e.get("files_sha256")) == 64
    held = set(m["held_out"]["sources"])
    assert held == set(corpus.HELD_OUT_SOURCES)
    for e in m["sources"]:
        split = e["split"]
        trained = any(k.startswith("train_") for k in split)
        assert trained != (e["name"] in held), e["name"]
    stdlib = m["sources"][0]["split"]
    assert stdlib["heldout_code_files"] == len(corpus.HELD_OUT_STDLIB)


def test_file_kinds() -> None:
    kind = corpus._kind
    assert kind("src/pkg/mod.py") == "code"
    assert kind("src/pkg/tests/test_mod.py") is None
    assert kind("docs/usage.rst") == "prose"
    assert kind("doc/en/how-to/x.rst") == "prose"
    assert kind("docs/license.rst") is None
    assert kind("README.md") == "prose" and kind("CHANGES.rst") == "prose"
    assert kind("setup.cfg") is None and kind("LICENSE.txt") is None
    assert kind("src/pkg/notes.txt") is None  # prose only from the documentation


def _archive(tmp: Path) -> Path:
    path = tmp / "demo-1.0.tar.gz"
    files = {
        "demo-1.0/PKG-INFO": "Metadata-Version: 2.4\nName: demo\nLicense-Expression: MIT\n\nbody",
        "demo-1.0/src/demo/core.py": 'def f(x):\n    """Return x doubled for the caller."""\n'
                                     "    return 2 * x\n",
        "demo-1.0/tests/test_core.py": "def test_f():\n    pass\n",
        "demo-1.0/docs/index.rst": "Demo\n====\n\nDemo doubles numbers for anyone who asks "
                                   "politely, and it does so quickly.\n",
        "demo-1.0/docs/bad.rst": b"\xff\xfe not text",
    }
    with tarfile.open(path, "w:gz") as tf:
        for name, text in files.items():
            data = text if isinstance(text, bytes) else text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def test_archive_pieces_and_licence(tmp_path: Path) -> None:
    pieces, lic = corpus.archive_pieces("demo", _archive(tmp_path))
    assert lic == "MIT"
    assert [(p.path, p.kind) for p in pieces] == [("docs/index.rst", "prose"),
                                                  ("src/demo/core.py", "code")]
    funcs = corpus.documented_functions([p for p in pieces if p.kind == "code"])
    assert [f["name"] for f in funcs] == ["f"]
    assert funcs[0]["summary"] == "Return x doubled for the caller."


def test_licence_falls_back_to_classifiers() -> None:
    info = "Name: x\nClassifier: License :: OSI Approved :: BSD License\n\nbody"
    assert corpus._license(info) == "BSD License"
    assert corpus._license("Name: x\n\n") == "see the archive's LICENSE file"


def test_topics_prose() -> None:
    src = b"topics = {'b': 'Second topic.\\n', 'a': 'First topic.\\n'}\n"
    assert corpus.topics_prose(src) == b"First topic.\n\n\nSecond topic.\n"


def test_prose_sections() -> None:
    text = ("Title\n=====\n\nThe first paragraph says what the section is about, at some "
            "length so it counts.\n\nMore of the same section, which is kept.\n\n"
            "Other\n-----\n\nshort\n")
    got = chat_data.prose_sections(text)
    assert got[0][0] == "Title"
    assert got[0][1].startswith("The first paragraph") and "Other" not in got[0][1]
    assert all(t != "Other" for t, _ in got)  # too short a body


def test_transcripts_are_xtml_replies_that_end_their_turn() -> None:
    tok = Tokenizer.from_dir(DEMO)
    fmt = XtmlFormat(tok, thinking=False)
    funcs = [{"name": "double", "summary": "Return x doubled.", "origin": "demo/core.py",
              "source": "def double(x):\n    return 2 * x"}]
    turns = chat_data.function_turns(funcs * 4, random.Random(0))
    for user, reply in turns:
        assert user.role == "user" and reply.role == "assistant"
        ids = fmt.render([user, reply], add_generation_prompt=False)
        prompt = fmt.render([user])
        assert ids[: len(prompt)] == prompt  # the reply continues the generation prompt
        parsed = fmt.parse_reply(ids[len(prompt):])
        assert parsed.finished and parsed.well_formed
        assert parsed.content == reply.content
