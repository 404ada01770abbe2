"""Readers for the two tokenizer files, written for untrusted input.

``tiktoken.model`` holds one ``"<base64 of the token's raw bytes> <rank>"`` per line;
``tokenizer_config.json`` names the added tokens in ``added_tokens_decoder`` (keys are id
strings, values carry ``content`` and ``special``). Both readers take the file's bytes and
the name to print, and either return a checked table or raise
:class:`~k3core.api.errors.TokenizerError` with a one-line message naming the file and the line
(or, for JSON semantics, the key). Nothing else escapes them.

What is refused, in ``tiktoken.model``: a file over :data:`MAX_TIKTOKEN_MODEL_BYTES` or with
more than :data:`MAX_RANKS` lines; a line that is not two fields ``<base64> <rank>`` (a
missing rank, extra fields, a tab); base64 that is not strict (characters outside the
alphabet, bad padding) or decodes to nothing; a rank that is not plain ASCII digits or is
over :data:`MAX_TOKEN_ID`; a rank or a token's bytes seen twice; ranks that are not exactly
``0..N-1``. Blank lines and a trailing ``\\r`` are skipped, as tiktoken's own loader does.

In ``tokenizer_config.json``: a file over :data:`MAX_TOKENIZER_CONFIG_BYTES`; bytes that are
not UTF-8; invalid JSON (including ``NaN``/``Infinity``, duplicate keys, absurd nesting); a
top level that is not an object; a missing or non-object ``added_tokens_decoder``; a key
that is not a decimal id (no sign, no leading zero, at most :data:`MAX_TOKEN_ID`); an entry
that is not an object, whose ``content`` is not a non-empty string of valid Unicode, or
whose ``special`` (when present) is not a boolean; two ids with the same content.
"""

from __future__ import annotations

import binascii
import re
from dataclasses import dataclass
from pathlib import Path

from k3core.api import files
from k3core.api.errors import TokenizerError
from k3core.api.safejson import JSONRejected, parse_json

MAX_TIKTOKEN_MODEL_BYTES = 16_000_000  # the released file is about 2.3 MB
MAX_TOKENIZER_CONFIG_BYTES = 4_000_000  # the released file is a few KB
MAX_RANKS = 1 << 20  # the released file has 163,584
MAX_TOKEN_ID = (1 << 31) - 1  # ids travel as int32 elsewhere in the engine

_LINE = re.compile(rb"([^ ]*) ([^ ]*)")
_DIGITS = re.compile(rb"[0-9]{1,10}")
_ID_KEY = re.compile(r"(?:0|[1-9][0-9]{0,9})")


@dataclass(frozen=True)
class AddedToken:
    """One entry of ``added_tokens_decoder``: the id it is bound to, its text, its flag."""

    id: int
    content: str
    special: bool


def read_capped(path: Path, cap: int) -> bytes:
    """The bytes of a regular file no bigger than ``cap``; refuse anything else."""
    try:
        return files.read_capped(path, cap)
    except files.FileRejected as exc:
        raise TokenizerError(f"{path}: {exc}") from None


def parse_tiktoken_model(data: bytes, source: str) -> dict[bytes, int]:
    """Token bytes -> rank, from the bytes of a ``tiktoken.model`` file."""
    if len(data) > MAX_TIKTOKEN_MODEL_BYTES:
        raise TokenizerError(
            f"{source}: {len(data)} bytes is over the {MAX_TIKTOKEN_MODEL_BYTES}-byte limit"
        )
    if data.count(b"\n") > MAX_RANKS:
        raise TokenizerError(f"{source}: more than {MAX_RANKS} lines; not a tokenizer vocabulary")
    ranks: dict[bytes, int] = {}
    line_of_rank: dict[int, int] = {}
    for lineno, raw in enumerate(data.split(b"\n"), 1):
        line = raw[:-1] if raw.endswith(b"\r") else raw
        if not line:
            continue
        where = f"{source} line {lineno}"
        m = _LINE.fullmatch(line)
        if m is None:
            if b" " not in line:
                raise TokenizerError(f"{where}: no rank (expected '<base64> <rank>')")
            raise TokenizerError(
                f"{where}: expected two fields '<base64> <rank>', found {len(line.split(b' '))}"
            )
        b64, rank_text = m.group(1), m.group(2)
        if not _DIGITS.fullmatch(rank_text) or int(rank_text) > MAX_TOKEN_ID:
            raise TokenizerError(
                f"{where}: rank {_show(rank_text)} is not an integer in 0..{MAX_TOKEN_ID}"
            )
        rank = int(rank_text)
        try:
            token = _b64(b64)
        except (binascii.Error, ValueError):
            raise TokenizerError(f"{where}: {_show(b64)} is not valid base64") from None
        if not token:
            raise TokenizerError(f"{where}: empty token")
        if rank in line_of_rank:
            raise TokenizerError(f"{where}: rank {rank} already given on line {line_of_rank[rank]}")
        if token in ranks:
            first = line_of_rank[ranks[token]]
            raise TokenizerError(f"{where}: token {token!r} already given on line {first}")
        ranks[token] = rank
        line_of_rank[rank] = lineno
    n = len(ranks)
    if n == 0:
        raise TokenizerError(f"{source}: no ranks")
    for rank, lineno in sorted(line_of_rank.items(), key=lambda kv: kv[1]):
        if rank >= n:
            missing = next(r for r in range(n) if r not in line_of_rank)
            raise TokenizerError(
                f"{source} line {lineno}: rank {rank} is out of range; the {n} ranks must be "
                f"exactly 0..{n - 1} (rank {missing} is missing)"
            )
    return ranks


def parse_tokenizer_config(data: bytes, source: str) -> dict[int, AddedToken]:
    """Id -> added token, from the bytes of a ``tokenizer_config.json`` file."""
    if len(data) > MAX_TOKENIZER_CONFIG_BYTES:
        raise TokenizerError(
            f"{source}: {len(data)} bytes is over the {MAX_TOKENIZER_CONFIG_BYTES}-byte limit"
        )
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise TokenizerError(
            f"{source} line {line}: not UTF-8 (byte {data[e.start]:#04x} at offset {e.start})"
        ) from None
    try:
        doc = parse_json(data)
    except JSONRejected as e:
        raise TokenizerError(f"{source}: {e}") from None
    if not isinstance(doc, dict):
        raise TokenizerError(f"{source}: top level is {_kind(doc)}, expected an object")
    if "added_tokens_decoder" not in doc:
        raise TokenizerError(f"{source}: no 'added_tokens_decoder'")
    table = doc["added_tokens_decoder"]
    if not isinstance(table, dict):
        raise TokenizerError(
            f"{source}: 'added_tokens_decoder' is {_kind(table)}, expected an object"
        )
    added: dict[int, AddedToken] = {}
    id_of_content: dict[str, int] = {}
    for key, entry in table.items():
        where = f"{source}: added_tokens_decoder[{key!r}]"
        if not _ID_KEY.fullmatch(key) or int(key) > MAX_TOKEN_ID:
            raise TokenizerError(f"{where}: key is not a token id (a decimal integer string)")
        tid = int(key)
        if not isinstance(entry, dict):
            raise TokenizerError(f"{where}: is {_kind(entry)}, expected an object")
        content = entry.get("content")
        if not isinstance(content, str):
            raise TokenizerError(f"{where}.content: is {_kind(content)}, expected a string")
        if not content:
            raise TokenizerError(f"{where}.content: empty")
        try:
            content.encode("utf-8")
        except UnicodeEncodeError:
            raise TokenizerError(f"{where}.content: not valid Unicode (lone surrogate)") from None
        special = entry.get("special", True)
        if not isinstance(special, bool):
            raise TokenizerError(f"{where}.special: is {_kind(special)}, expected true or false")
        if content in id_of_content:
            raise TokenizerError(
                f"{where}: content {content!r} already bound to id {id_of_content[content]}"
            )
        id_of_content[content] = tid
        added[tid] = AddedToken(tid, content, special)
    return added


def _kind(value: object) -> str:
    if value is None:
        return "missing or null"
    return {
        bool: "a boolean",
        int: "a number",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "an object",
    }.get(type(value), type(value).__name__)


def _show(raw: bytes, limit: int = 40) -> str:
    text = repr(raw[:limit])[2:-1]
    return f"'{text}{'...' if len(raw) > limit else ''}'"


_B64 = re.compile(rb"(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?")


def _b64(text: bytes) -> bytes:
    """Strict base64: the standard alphabet, whole quads, padding only at the end."""
    if not _B64.fullmatch(text):
        raise ValueError("not strict base64")
    return binascii.a2b_base64(text)
