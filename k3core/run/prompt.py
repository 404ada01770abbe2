"""Where a run's prompt comes from: exactly one of ``--prompt``, ``--prompt-file``, ``--ids``.

Text goes through the tokenizer (``--tok DIR``, ``$K3_TOK_FILES``, else the tokenizer files in
MODEL_DIR when they are there); a prompt file (``-`` = standard input) is read as raw bytes,
verbatim (the way to pass non-ASCII text safely past a shell). ``--prompt`` text is taken as
the bytes that were on the command line, valid UTF-8 or not (:func:`prompt_text_bytes`). BOS is
prepended only when asked (``--bos``), never by default.

A prompt longer than :data:`MAX_PROMPT` ids is refused before the work it would cost: a
prompt file larger than the limit times the tokenizer's longest token is refused before it
is read (no token spells more bytes, so it cannot fit), and tokenizing stops as soon as the
count passes the limit (``Tokenizer.encode_bytes``' ``limit``).
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from k3core.api.errors import UsageError
from k3core.api.files import FileRejected, read_capped
from k3core.api.units import human
from k3core.tokenizer.encoding import Tokenizer, TokenLimitExceeded

#: the longest prompt k3 accepts (the reference's ceiling), and the largest prompt file
MAX_PROMPT = 32_768
MAX_PROMPT_FILE = 64_000_000


@dataclass(kw_only=True)
class PromptSpec:
    """Where a run's prompt comes from (the request checked that exactly one is given)."""

    text: str | None = None
    file: Path | None = None
    ids: str | None = None
    bos: bool = False



#: the files that make a directory a tokenizer directory
TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json")


def find_tokenizer(model_dir: Path | None) -> Path | None:
    """MODEL_DIR when it holds the tokenizer files (the released layout ships them there)."""
    if model_dir is not None and all((Path(model_dir) / f).is_file() for f in TOKENIZER_FILES):
        return Path(model_dir)
    return None


def load_tokenizer(tok: Path | None, vocab: int, required: bool,
                   model_dir: Path | None = None) -> Tokenizer | None:
    """``--tok`` (or ``$K3_TOK_FILES``), else the tokenizer in ``model_dir``, else ``None``."""
    if tok is None:
        tok = find_tokenizer(model_dir)
    if tok is None:
        if required:
            raise UsageError("--prompt and --prompt-file need --tok DIR (the directory with "
                             "tiktoken.model), or the tokenizer files in MODEL_DIR")
        return None
    if not Path(tok).is_dir():
        raise UsageError(f"--tok {tok}: not a directory")
    return Tokenizer.from_dir(tok, vocab_size=vocab)


def prompt_ids(spec: PromptSpec, tok: Tokenizer | None, vocab: int, bos_id: int | None) -> tuple[list[int], str]:
    """The prompt's ids and a one-line description of where they came from."""
    limit = MAX_PROMPT - 1 if spec.bos else MAX_PROMPT
    if spec.ids is not None:
        ids = parse_ids(spec.ids)
        how = f"{len(ids)} ids from --ids"
    elif spec.text is not None:
        assert tok is not None
        data = prompt_text_bytes(spec.text)
        ids = _encode(tok, data, limit, "--prompt")
        how = f"tokenized: {len(data)} bytes -> {len(ids)} ids"
    else:
        assert tok is not None and spec.file is not None
        data = read_prompt_file(spec.file, fits=(limit, tok.max_token_bytes()))
        ids = _encode(tok, data, limit, f"--prompt-file {spec.file}")
        how = f"tokenized {spec.file}: {len(data)} bytes -> {len(ids)} ids"
    if spec.bos:
        if bos_id is None:
            raise UsageError("--bos: neither the tokenizer nor config.json names a BOS token")
        ids = [bos_id] + ids
    if not ids:
        raise UsageError("the prompt is empty: nothing to feed the model")
    if len(ids) > MAX_PROMPT:
        raise UsageError(f"the prompt has {len(ids)} ids; the limit is {MAX_PROMPT}")
    check_vocab(ids, vocab, "--ids" if spec.ids is not None else "prompt")
    return ids, how


def prompt_text_bytes(text: str) -> bytes:
    """The bytes of ``--prompt`` exactly as they were on the command line.

    Python decodes argv with the file-system encoding and ``surrogateescape``, so bytes that
    are not valid UTF-8 (``--prompt $'caf\\xe9'``) arrive as lone surrogates; ``os.fsencode``
    gives the original bytes back, and the tokenizer (a byte-level BPE) takes them as given.
    Lone surrogates that did not come from argv (a caller's own string) cannot be encoded:
    that is a ``UsageError`` (exit 2) pointing at ``--prompt-file``.
    """
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        pass
    try:
        return os.fsencode(text)
    except UnicodeEncodeError:
        raise UsageError("--prompt: the text is not valid UTF-8 and cannot be turned back into "
                         "bytes; put the prompt in a file and pass --prompt-file FILE (its "
                         "bytes are taken verbatim)") from None


def _encode(tok: Tokenizer, data: bytes, limit: int, what: str) -> list[int]:
    try:
        return tok.encode_bytes(data, limit=limit)
    except TokenLimitExceeded as exc:
        raise UsageError(f"{what}: the prompt holds more than {limit:,} ids, the limit "
                         f"({exc.how})") from None


def _too_long(what: str, size: str, fits: tuple[int, int]) -> UsageError:
    limit, longest = fits
    return UsageError(f"--prompt-file {what}: {size} bytes cannot fit in the prompt limit of "
                      f"{limit:,} ids (no token is longer than {longest} bytes, so at most "
                      f"{limit * longest:,} bytes can); refused before reading it")


def read_prompt_file(path: Path, fits: tuple[int, int] | None = None) -> bytes:
    """The file's bytes, verbatim. ``fits`` = (the id limit, the longest token's bytes): a
    file with more bytes than those ids could spell is refused before it is read."""
    most = MAX_PROMPT_FILE if fits is None else min(MAX_PROMPT_FILE, fits[0] * fits[1])
    if str(path) == "-":
        return _read_stdin(most, fits)
    if fits is not None and most < MAX_PROMPT_FILE:
        try:
            st = path.stat()
        except OSError:
            st = None  # read_capped says why
        if st is not None and stat.S_ISREG(st.st_mode) and st.st_size > most:
            raise _too_long(str(path), f"{st.st_size:,}", fits)
    try:
        data = read_capped(path, MAX_PROMPT_FILE)
    except FileRejected as exc:
        raise UsageError(f"--prompt-file {path}: cannot read it: {exc}") from None
    if fits is not None and len(data) > most:  # it grew since it was looked at
        raise _too_long(str(path), f"{len(data):,}", fits)
    return data


def _read_stdin(most: int = MAX_PROMPT_FILE, fits: tuple[int, int] | None = None) -> bytes:
    """``--prompt-file -``: standard input's bytes, verbatim, at most ``most`` of them (the
    rest is never read)."""
    import sys

    try:
        data = sys.stdin.buffer.read(most + 1)
    except (OSError, AttributeError, ValueError) as exc:
        raise UsageError(f"--prompt-file -: cannot read standard input ({exc})") from None
    if len(data) > most:
        if fits is not None and most < MAX_PROMPT_FILE:
            raise _too_long("- (standard input)", f"over {most:,}", fits)
        raise UsageError(f"--prompt-file -: standard input is over the {human(MAX_PROMPT_FILE)} "
                         "limit")
    return data


# ---- id lists ------------------------------------------------------------------------------
_SPLIT = re.compile(r"[,\s]+")


def parse_ids(text: str, flag: str = "--ids") -> list[int]:
    pieces = [p for p in _SPLIT.split(text.strip()) if p]
    if not pieces:
        raise UsageError(f"no prompt ids parsed from {flag} {text!r}")
    out = []
    for p in pieces:
        if not p.isdigit():
            raise UsageError(f"bad {flag} value {p!r}: ids are non-negative integers, e.g. 3,7,11")
        out.append(int(p))
    return out


def check_vocab(ids: list[int], vocab: int, flag: str = "--ids") -> None:
    bad = [i for i in ids if i >= vocab]
    if bad:
        raise UsageError(f"{flag}: id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
