"""Write a real tokenizer (``tiktoken.model`` + ``tokenizer_config.json``) for a model vocabulary.

Used by ``k3 synth`` so a synthetic model has a tokenizer whose ids line up with its
embedding rows, and by the tests as a stand-in for the released files.

Layout for a model ``vocab_size`` V (refused below 256):

* ranks ``0..255`` are the single bytes ``0x00..0xff`` in order, so any bytes encode;
* a special block of ``S = min(256, V - 256)`` ids ends the vocabulary, so
  ``n_ranks = V - S`` and ranks ``256..n_ranks-1`` are byte-pair merges learned from the
  corpus (:func:`k3core.tokenizer.bpe_train.train_bpe`), topped up by seeded fill tokens
  (:func:`k3core.tokenizer.bpe_train.fill_tokens`) when the corpus runs out, so the file always has
  exactly ``n_ranks`` ranks;
* the block is laid out like the released one (docs/model.md §7), scaled: a named token
  at offset ``o`` of the real 256-id block goes to ``block_start + o`` when ``o < S - 2``;
  ``[UNK]`` and ``[PAD]`` (offsets 254 and 255, the last two ids) stay the last two ids
  when the block has room for them. With ``V >= 512`` the block is the full 256 ids and every
  named token keeps its real offset: ``V = 163,840`` reproduces the released ids exactly
  (``[BOS]`` 163584 ... ``[PAD]`` 163839). ``V = 256`` (the tiny oracle model) is a pure
  byte-level tokenizer with no named tokens; ``256 < V < 512`` has no merges and a reduced
  block (e.g. V = 300: S = 44, ``[BOS]`` 256 ... ``<|media_pad|>`` 277, ``[UNK]`` 298,
  ``[PAD]`` 299). Every other id of the block is an unnamed reserved id.

Both files are written in full under temporary names in the target directory and flushed,
then renamed into place, so neither ever exists half-written (a failure before the renames
leaves the directory as it was).
"""

from __future__ import annotations

import base64
import json
import os
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from k3core.api.errors import OutputError, UsageError
from k3core.api.filemode import give_new_file_mode
from k3core.tokenizer.bpe_train import fill_tokens, train_bpe
from k3core.tokenizer.encoding import CONFIG_FILE, MODEL_FILE
from k3core.tokenizer.files import MAX_RANKS

#: Named ids of the released 256-id special block, by offset from its start (163584).
REAL_BLOCK_OFFSETS: dict[int, str] = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|end_of_msg|>",
    3: "<|open|>",
    4: "<|close|>",
    5: "<|sep|>",
    6: "[start_header_id]",
    7: "[end_header_id]",
    9: "[EOT]",
    18: "<|media_begin|>",
    19: "<|media_content|>",
    20: "<|media_end|>",
    21: "<|media_pad|>",
    65: "<osagent_mode>",
    254: "[UNK]",
    255: "[PAD]",
}
BLOCK = 256
_TAIL = 2  # [UNK], [PAD] are anchored to the end of the block


@dataclass(frozen=True)
class TokenizerLayout:
    """What :func:`write_tokenizer` wrote."""

    vocab_size: int
    n_ranks: int
    special_block: int  # ids n_ranks .. vocab_size-1
    specials: dict[int, str]  # named ids -> content
    corpus_merges: int  # ranks learned from the corpus (after the 256 bytes)
    filled: int  # ranks added by the seeded fill


def special_block_size(vocab_size: int) -> int:
    """Ids at the end of the vocabulary kept for added tokens."""
    _check_vocab(vocab_size)
    return min(BLOCK, vocab_size - 256)


def special_layout(vocab_size: int) -> dict[int, str]:
    """Named id -> content for a model vocabulary of ``vocab_size``."""
    s = special_block_size(vocab_size)
    start = vocab_size - s
    out: dict[int, str] = {}
    for off, name in REAL_BLOCK_OFFSETS.items():
        if off >= BLOCK - _TAIL:
            from_end = BLOCK - off
            if s >= from_end:
                out[vocab_size - from_end] = name
        elif off < s - _TAIL:
            out[start + off] = name
    return dict(sorted(out.items()))


def default_corpus() -> bytes:
    """The multilingual training text shipped with k3 (``k3core/tokenizer/data/corpus.txt``)."""
    return (resources.files("k3core.tokenizer") / "data" / "corpus.txt").read_bytes()


def fit_ranks(
    vocab_size: int, corpus: bytes | None = None, seed: int = 0
) -> tuple[list[bytes], int]:
    """Token bytes in rank order for ``vocab_size``, and how many came from the corpus."""
    n_ranks = vocab_size - special_block_size(vocab_size)
    data = default_corpus() if corpus is None else corpus
    if not isinstance(data, (bytes, bytearray)):
        raise UsageError(f"corpus must be bytes, not {type(data).__name__}")
    tokens = [bytes([b]) for b in range(256)]
    learned = train_bpe(bytes(data), n_ranks - 256) if n_ranks > 256 else []
    tokens += learned
    tokens += fill_tokens(tokens, n_ranks - len(tokens), seed)
    return tokens, len(learned)


def write_tokenizer(
    out_dir: str | Path, vocab_size: int, corpus: bytes | None = None, seed: int = 0
) -> TokenizerLayout:
    """Write ``tiktoken.model`` and ``tokenizer_config.json`` for ``vocab_size`` into ``out_dir``."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise UsageError(f"seed must be an integer, not {seed!r}")
    tokens, merges = fit_ranks(vocab_size, corpus, seed)
    specials = special_layout(vocab_size)
    model_text = "".join(
        f"{base64.b64encode(t).decode('ascii')} {rank}\n" for rank, t in enumerate(tokens)
    )
    config = _config(specials)
    d = Path(out_dir)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(
            f"{d}: cannot create the tokenizer directory: {e.strerror or e}"
        ) from None
    _write_atomic(
        {
            d / MODEL_FILE: model_text.encode("ascii"),
            d / CONFIG_FILE: (json.dumps(config, indent=2) + "\n").encode("utf-8"),
        }
    )
    return TokenizerLayout(
        vocab_size=vocab_size,
        n_ranks=len(tokens),
        special_block=vocab_size - len(tokens),
        specials=specials,
        corpus_merges=merges,
        filled=len(tokens) - 256 - merges,
    )


def _config(specials: dict[int, str]) -> dict[str, object]:
    entry = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    cfg: dict[str, object] = {
        "added_tokens_decoder": {
            str(i): {"content": name, **entry, "special": True} for i, name in specials.items()
        },
        "tokenizer_class": "TikTokenTokenizer",
    }
    names = set(specials.values())
    for key, name in (
        ("bos_token", "[BOS]"),
        ("eos_token", "[EOS]"),
        ("unk_token", "[UNK]"),
        ("pad_token", "[PAD]"),
    ):
        if name in names:
            cfg[key] = name
    return cfg


def _check_vocab(vocab_size: object) -> None:
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise UsageError(f"vocab_size must be an integer, not {vocab_size!r}")
    if vocab_size < 256:
        raise UsageError(
            f"vocab_size {vocab_size} is below 256; a byte-level tokenizer needs 256 ranks"
        )
    if vocab_size > MAX_RANKS + BLOCK:
        raise UsageError(
            f"vocab_size {vocab_size} is over {MAX_RANKS + BLOCK}, the most a tokenizer "
            "file may hold"
        )


def _write_atomic(files: dict[Path, bytes]) -> None:
    """Write every file under a temporary name first, then rename them all into place."""
    temps: dict[Path, str] = {}
    current: Path | None = None
    try:
        for path, data in files.items():
            current = path
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            temps[path] = tmp
            with os.fdopen(fd, "wb") as f:
                give_new_file_mode(f.fileno())
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        for path, tmp in list(temps.items()):
            current = path
            os.replace(tmp, path)
            del temps[path]
    except OSError as e:
        raise OutputError(f"{current}: cannot write: {e.strerror or e}") from None
    finally:
        for tmp in temps.values():
            try:
                os.unlink(tmp)
            except OSError:
                pass
