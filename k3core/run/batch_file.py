"""A batch file (``k3 run MODEL --batch-file FILE``): many prompts, one JSON object a line.

The file is JSON Lines: each non-blank line is one JSON object holding exactly one of
``prompt`` (text, tokenized as ``--prompt`` is) or ``ids`` (a list of token ids, as
``--ids``), and optionally ``id`` (a JSON string or number, echoed back in the line's
result), ``bos`` (prepend the BOS token; default: ``--bos``) and any field of
:class:`~k3core.run.request.GenerationParams` (``max_tokens``, ``context``,
``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``, ``stop_ids``, ``ignore_eos``,
``spec``, ``spec_width``, ``spec_ngram``). ``stop`` may be one string or a list of them.
The command line's generation flags are the defaults; a line's fields override them, so a
line's result is what ``k3 run`` gives for that prompt with those flags. Blank lines are
skipped; the prompts are numbered in the file's order from 0 (their ``index``).

The whole file is checked before anything is generated, in two passes, each refusal one
``UsageError`` (exit 2) naming the file and the line (``prompts.jsonl line 3: ...``):

* :func:`read_batch_file`, before the model is opened: the file is a regular file of at
  most :data:`MAX_BATCH_FILE` bytes of UTF-8 holding at least one prompt; each line is one
  JSON object (no duplicate keys, no ``NaN``), with exactly one of ``prompt``/``ids``, no
  unknown field, each field of its type (strictly: ``"8"`` is not an integer, ``true`` is
  not a number) and the generation's values in range (as the flags are checked);
* :func:`prompt_ids`, once the plan has found the tokenizer and the vocabulary (before any
  weight is bound): a text prompt needs a tokenizer, every id (the prompt's and
  ``stop_ids``) lies in the vocabulary, the prompt is neither empty nor over
  :data:`~k3core.run.prompt.MAX_PROMPT` ids, and it leaves room to generate in its
  ``context``.

A message names a line's fields in the file's words (``max_tokens``, not ``--gen``). Running
the prompts and writing their results is :mod:`k3core.run.batch_runner`'s.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from k3core.api.errors import K3Error, UsageError
from k3core.api.files import FileRejected, read_capped
from k3core.api.safejson import JSONRejected, json_kind, parse_json
from k3core.run.prompt import MAX_PROMPT, MAX_PROMPT_FILE
from k3core.run.request import GenerationParams
from k3core.tokenizer.encoding import Tokenizer, TokenLimitExceeded

__all__ = ["MAX_BATCH_FILE", "BatchLine", "prompt_ids", "read_batch_file"]

#: the largest batch file read (bytes), the prompt-file limit
MAX_BATCH_FILE = MAX_PROMPT_FILE
#: the fields of a line that are not generation parameters
PROMPT_FIELDS = ("prompt", "ids", "id", "bos")
#: every field a line may hold
LINE_FIELDS = (*PROMPT_FIELDS, *GenerationParams.model_fields)

#: a line's ``id``: echoed back as given
LineId = str | int | float | None


@dataclass(frozen=True)
class BatchLine:
    """One prompt of a batch file, checked as far as the file alone allows.

    ``params`` are the command line's generation parameters with the line's fields over
    them; their ``model_fields_set`` is what either gave (so a preset's ``spec`` applies
    where neither did, as for one run)."""

    index: int  # among the prompts, from 0
    line: int  # in the file, from 1
    id: LineId
    prompt: str | None
    ids: tuple[int, ...] | None
    bos: bool
    params: GenerationParams

    def where(self, path: Path) -> str:
        return f"{path} line {self.line}"


def read_batch_file(path: Path, defaults: GenerationParams, *,
                    bos: bool = False) -> list[BatchLine]:
    """Every prompt of the batch file at ``path``, checked (the first pass: see the module).

    ``defaults``: the command line's generation parameters (only the fields it set are
    carried into a line's, with the line's own over them); ``bos``: ``--bos``, a line's
    default for ``bos``."""
    try:
        data = read_capped(path, MAX_BATCH_FILE)
    except FileRejected as exc:
        raise UsageError(f"--batch-file {path}: {exc}") from None
    given = {k: getattr(defaults, k) for k in defaults.model_fields_set}
    out: list[BatchLine] = []
    for n, raw in enumerate(data.split(b"\n"), 1):
        if n == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark
            raw = raw[3:]
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UsageError(f"{path} line {n}: not UTF-8 (byte {exc.start + 1} of the "
                             "line)") from None
        if not text.strip():
            continue
        try:
            out.append(_line(text, len(out), n, given, bos))
        except K3Error as exc:
            raise UsageError(f"{path} line {n}: {exc.message}") from None
    if not out:
        raise UsageError(f"--batch-file {path}: no prompts (the file is empty or blank); a line is "
                         'one JSON object such as {"prompt": "Hello"} or {"ids": [3, 7, 11]}')
    return out


def prompt_ids(lines: list[BatchLine], path: Path, tok: Tokenizer | None, vocab: int,
               bos_id: int | None) -> list[list[int]]:
    """Each line's prompt ids, checked against the model (the second pass: see the module).

    ``tok`` is the run's tokenizer (``None``: none found), ``vocab`` the model's vocabulary
    size and ``bos_id`` the BOS token's id (``None``: neither the tokenizer nor the config
    names one)."""
    out = []
    for b in lines:
        try:
            out.append(_ids(b, tok, vocab, bos_id))
        except K3Error as exc:
            raise UsageError(f"{b.where(path)}: {exc.message}") from None
    return out


# ---- one line -----------------------------------------------------------------------------
def _line(text: str, index: int, n: int, given: Mapping[str, Any], bos: bool) -> BatchLine:
    try:
        obj = parse_json(text.encode("utf-8"))
    except JSONRejected as exc:
        raise UsageError(str(exc)) from None
    if not isinstance(obj, dict):
        raise UsageError(f"a line is one JSON object, not {json_kind(obj)}, e.g. "
                         '{"prompt": "Hello"} or {"ids": [3, 7, 11]}')
    unknown = [k for k in obj if k not in LINE_FIELDS]
    if unknown:
        raise UsageError(f"unknown field {unknown[0]!r} (a line takes {', '.join(LINE_FIELDS)})")
    has = [k for k in ("prompt", "ids") if k in obj]
    if len(has) != 1:
        raise UsageError("give exactly one of 'prompt' (text) and 'ids' (a list of token ids)"
                         + (", not both" if has else ""))
    prompt = obj.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise UsageError(f"prompt: a string, not {json_kind(prompt)}")
    ids = obj.get("ids")
    if "ids" in obj:
        ids = _id_list(ids, "ids")
    line_id = obj.get("id")
    if (not (line_id is None or isinstance(line_id, (str, int, float)))
            or isinstance(line_id, bool)
            or (isinstance(line_id, float) and not math.isfinite(line_id))):
        raise UsageError(f"id: a string or a number, not {json_kind(line_id)}")
    line_bos = obj.get("bos", bos)
    if not isinstance(line_bos, bool):
        raise UsageError(f"bos: true or false, not {json_kind(line_bos)}")
    fields = {k: v for k, v in obj.items() if k not in PROMPT_FIELDS}
    if isinstance(fields.get("stop"), str):
        fields["stop"] = [fields["stop"]]
    return BatchLine(index=index, line=n, id=line_id, prompt=prompt,
                     ids=None if ids is None else tuple(ids), bos=line_bos,
                     params=_params({**given, **fields}))


def _params(data: dict[str, Any]) -> GenerationParams:
    """Strictly typed (a JSON ``"8"`` or ``true`` is no integer), then range-checked."""
    try:
        return GenerationParams.model_validate(data, strict=True)
    except ValidationError as exc:
        err = exc.errors(include_input=False, include_url=False)[0]
        where = ".".join(str(x) for x in err["loc"]) or "the line"
        raise UsageError(f"{where}: {err['msg']}") from None


def _id_list(value: object, name: str) -> list[int]:
    if not isinstance(value, list):
        raise UsageError(f"{name}: a list of token ids, not {json_kind(value)}")
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise UsageError(f"{name}: token ids are non-negative integers, got "
                             f"{json.dumps(v)[:40]}")
    return list(value)


def _ids(b: BatchLine, tok: Tokenizer | None, vocab: int, bos_id: int | None) -> list[int]:
    limit = MAX_PROMPT - 1 if b.bos else MAX_PROMPT
    if b.prompt is not None:
        if tok is None:
            raise UsageError("a text prompt needs a tokenizer: pass --tok DIR (none was found "
                             "in MODEL_DIR), or give the line 'ids'")
        try:
            data = b.prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise UsageError("prompt: the text holds a lone surrogate (\\ud800-\\udfff), which "
                             "is no character") from None
        try:
            ids = tok.encode_bytes(data, limit=limit)
        except TokenLimitExceeded as exc:
            raise UsageError(f"prompt: it holds more than {limit:,} ids, the limit "
                             f"({exc.how})") from None
    else:
        assert b.ids is not None
        ids = list(b.ids)
        if len(ids) > limit:
            raise UsageError(f"ids: {len(ids)} ids; the limit is {limit:,}")
    if b.bos:
        if bos_id is None:
            raise UsageError("bos: neither the tokenizer nor config.json names a BOS token")
        ids = [bos_id, *ids]
    if not ids:
        raise UsageError("the prompt is empty: nothing to feed the model")
    for name, some in (("ids" if b.ids is not None else "prompt", ids),
                       ("stop_ids", b.params.stop_ids)):
        bad = [i for i in some if i >= vocab]
        if bad:
            raise UsageError(f"{name}: id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
    b.params.budget(len(ids))  # a prompt that fills its context leaves no room to generate
    return ids
