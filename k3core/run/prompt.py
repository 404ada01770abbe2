"""Where a run's prompt comes from: exactly one of ``--prompt``, ``--prompt-file``, ``--ids``.

Text goes through the tokenizer (``--tok DIR``, ``$K3_TOK_FILES``, else the tokenizer files in
MODEL_DIR when they are there); a prompt file (``-`` = standard input) is read as raw bytes,
verbatim (the way to pass non-ASCII text safely past a shell). BOS is
prepended only when asked (``--bos``), never by default.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from k3core.api.errors import UsageError
from k3core.run.idparse import check_vocab, parse_ids
from k3core.tokenizer.encoding import Tokenizer

#: the longest prompt k3 accepts (the reference's ceiling), and the largest prompt file
MAX_PROMPT = 32_768
MAX_PROMPT_FILE = 64 << 20


@dataclass
class PromptSpec:
    text: str | None = None
    file: Path | None = None
    ids: str | None = None
    bos: bool = False

    def check_sources(self) -> None:
        given = [n for n, v in (("--prompt", self.text), ("--prompt-file", self.file), ("--ids", self.ids)) if v is not None]
        if not given:
            raise UsageError("one of --prompt, --prompt-file or --ids is required")
        if len(given) > 1:
            raise UsageError(f"{' and '.join(given)} are mutually exclusive: give exactly one prompt source")

    @property
    def needs_tokenizer(self) -> bool:
        return self.ids is None


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
    if spec.ids is not None:
        ids = parse_ids(spec.ids)
        how = f"{len(ids)} ids from --ids"
    elif spec.text is not None:
        assert tok is not None
        ids = tok.encode(spec.text)
        how = f"tokenized: {len(spec.text.encode())} bytes -> {len(ids)} ids"
    else:
        assert tok is not None and spec.file is not None
        data = read_prompt_file(spec.file)
        ids = tok.encode_bytes(data)
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


def read_prompt_file(path: Path) -> bytes:
    if str(path) == "-":
        return _read_stdin()
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise UsageError(f"--prompt-file {path}: not a regular file")
        if size > MAX_PROMPT_FILE:
            raise UsageError(f"--prompt-file {path}: {size} bytes is over the {MAX_PROMPT_FILE >> 20} MiB limit")
        return path.read_bytes()
    except OSError as exc:
        raise UsageError(f"--prompt-file {path}: cannot read it ({exc.strerror or exc})") from None


def _read_stdin() -> bytes:
    """``--prompt-file -``: standard input's bytes, verbatim, within the same size limit."""
    import sys

    try:
        data = sys.stdin.buffer.read(MAX_PROMPT_FILE + 1)
    except (OSError, AttributeError, ValueError) as exc:
        raise UsageError(f"--prompt-file -: cannot read standard input ({exc})") from None
    if len(data) > MAX_PROMPT_FILE:
        raise UsageError(f"--prompt-file -: standard input is over the {MAX_PROMPT_FILE >> 20} "
                         "MiB limit")
    return data
