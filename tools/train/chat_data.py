"""Chat transcripts for the demo model, built from its training corpus.

The demo model is trained on a little of the Kimi K3 XTML transcript format
(:mod:`k3core.serve.chat_format`, thinking off, the demo model's default) so ``k3 chat`` and
``k3 serve`` replies stay in their channels and end with the end-of-message id. Every
transcript is a user turn and an assistant reply, built from the **training** split only:

* a documented function of the training code (:func:`tools.train.corpus.documented_functions`)
  gives "write a function that ..." (the reply: the function in a ``python`` code block) and
  "what does ``name`` do?" (the reply: its docstring's summary);
* a section of the training prose (an rst or markdown heading and its first paragraphs)
  gives "what is / explain TITLE" (the reply: the paragraphs).

The question templates are chosen by a seeded generator, so the transcripts repeat exactly.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import numpy as np

from k3core.serve.chat_format import Message, XtmlFormat
from k3core.tokenizer.encoding import Tokenizer

_WRITE = ("Write a Python function `{name}` that {what}",
          "Implement `{name}` in Python: {what}",
          "Can you show me a function that {what}",
          "I need a Python function for this: {what}")
_ASK = ("What does `{name}` do?", "Explain the function `{name}` from {origin}.",
        "What is `{name}` for?")
_TOPIC = ("What is {title}?", "Explain {title}.", "Tell me about {title}.",
          "Can you describe {title} briefly?")
_HEADING = re.compile(r"^(?P<title>[^\n]{3,80})\n(?P<rule>[=\-~^*#]{3,})\n", re.M)
_MD_HEADING = re.compile(r"^#{1,4} (?P<title>[^\n]{3,80})\n", re.M)
_FILE = re.compile(rb"^# ---- file: .* ----\n", re.M)


def _lower_first(s: str) -> str:
    return s[:1].lower() + s[1:] if s[:2] != s[:2].upper() else s


def function_turns(funcs: list[dict[str, str]], rng: random.Random) -> list[list[Message]]:
    out = []
    for f in funcs:
        if rng.random() < 0.65:
            q = rng.choice(_WRITE).format(name=f["name"], what=_lower_first(f["summary"]))
            a = f"```python\n{f['source']}\n```"
        else:
            module = f["origin"].split("/", 1)[-1]
            q = rng.choice(_ASK).format(name=f["name"], origin=f"`{module}`")
            a = f"`{f['name']}` in `{module}`: {f['summary']}"
        out.append([Message("user", q), Message("assistant", a)])
    return out


def prose_sections(text: str) -> list[tuple[str, str]]:
    """(title, first paragraphs) of each heading in one prose file."""
    heads = [(m.group("title").strip(), m.end()) for m in _HEADING.finditer(text)
             if len(m.group("rule")) >= len(m.group("title").strip()) - 2]
    heads += [(m.group("title").strip(), m.end()) for m in _MD_HEADING.finditer(text)]
    out = []
    for title, end in heads:
        if not re.search(r"[A-Za-z]{3}", title) or title.startswith(("..", ":", "#")):
            continue
        paras = []
        for para in text[end:].lstrip("\n").split("\n\n"):
            p = para.strip()
            if not p or _HEADING.match(para.lstrip("\n") + "\n") or p.startswith(("..", "#")):
                break
            paras.append(p)
            if sum(map(len, paras)) > 400:
                break
        body = "\n\n".join(paras)
        if 80 <= len(body) <= 1200:
            out.append((title, body))
    return out


def prose_turns(prose: bytes, rng: random.Random) -> list[list[Message]]:
    out = []
    for chunk in _FILE.split(prose):
        for title, body in prose_sections(chunk.decode("utf-8", "replace")):
            q = rng.choice(_TOPIC).format(title=title)
            out.append([Message("user", q), Message("assistant", body)])
    return out


def build(corpus_dir: Path, tok: Tokenizer, seed: int = 0) -> np.ndarray:
    """Every transcript's ids, shuffled (seeded) and concatenated."""
    rng = random.Random(seed)
    funcs = json.loads((corpus_dir / "functions.json").read_text())
    turns = function_turns(funcs, rng)
    turns += prose_turns((corpus_dir / "train_prose.txt").read_bytes(), rng)
    rng.shuffle(turns)
    fmt = XtmlFormat(tok, thinking=False)
    ids: list[int] = []
    for t in turns:
        ids += fmt.render(t, add_generation_prompt=False)
    return np.array(ids, dtype=np.int32)
