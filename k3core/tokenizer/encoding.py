"""The Kimi K3 tokenizer: tiktoken ranks, the Kimi split pattern, added tokens read by id.

Built the way docs/model.md §8 item 8 decides: a :class:`tiktoken.Encoding` over the
ranks of ``tiktoken.model``, the Kimi ``pat_str`` (:data:`KIMI_PAT_STR`) and the added
tokens of ``tokenizer_config.json``'s ``added_tokens_decoder``, each bound to the id its key
names (never to a list position).

Ids. ``0 .. n_ranks-1`` are BPE ranks; the named added tokens sit above them; every other id
below the model's ``vocab_size`` is an unnamed reserved id and decodes as
``<|reserved_token_{id}|>`` (docs/model.md §8 item 7). ``vocab_size`` is the model's: pass the
config's value to :meth:`Tokenizer.from_dir`, or let it default to one past the highest
rank or named id (which is the model's vocabulary for the released files, where ``[PAD]``
is 163839). Decoding an id outside ``0 .. vocab_size-1`` is a :class:`UsageError`.

The ranks run without a gap from 0 up to the special-token block: the lowest named added
token's id (``[BOS]``, 163584 in the released files) must be exactly the number of ranks,
so a ``tiktoken.model`` cut short (at a line boundary, say) or one whose ranks reach into the
block is a :class:`TokenizerError` naming the file, the ranks found and expected and the
first missing rank. With no named token, at most :data:`SPECIAL_BLOCK` unnamed ids may lie
between the last rank and ``vocab_size``. (Gaps, repeats and ranks past the count are refused
by the file reader, ``k3core.tokenizer.files``.)

Encoding. With ``allow_special`` (the default, as the reference's tools encode), the text is
cut at occurrences of named added tokens, scanning left to right and taking the longest
token at a position (a definite rule; tiktoken's own special-token alternation has no
defined order for tokens that prefix each other); each occurrence becomes its id, and each
span between is encoded by tiktoken with no special handling. Without ``allow_special``
the whole text is ordinary text. No BOS or EOS is ever added here. Reserved names are not
recognised in text: they are what unnamed ids decode to, not tokens one can type.

Long text. Text longer than :data:`MAX_ENCODE_CHARS` code points, or holding a run of more
than :data:`MAX_RUN_CHARS` whitespace or non-whitespace characters, is first cut the way the
first-party wrapper is described to cut it (:func:`_chunks`; before the added-token scan,
as there). Below those limits, which covers every ordinary prompt, the result is exactly
tiktoken's; past them tiktoken alone fails (a run of a million spaces overflows its regex
engine's backtracking stack), so its answer is not defined there anyway.

Limits. ``encode`` and ``encode_bytes`` take a ``limit`` (an int, or a :class:`TokenBudget`
shared by several calls): text that holds more tokens raises :class:`TokenLimitExceeded`
without being tokenized in full. First by its length alone: the tokens of a text spell its
bytes exactly, and none is longer than :meth:`Tokenizer.max_token_bytes`, so ``n`` bytes hold
at least ``ceil(n / longest)`` tokens; past the limit nothing is tokenized. Then by counting:
the text is tokenized in pieces of about :data:`PIECE_CHARS` characters, cut only where the
split pattern always ends a match (:func:`_pieces`: after a newline that a letter or digit
follows, or between a lowercase ASCII letter and a space), so the pieces give exactly the
ids of the whole; counting stops at the first piece that passes the limit. Within the
limit the ids are exactly those of an unlimited call.

Bytes. :meth:`Tokenizer.encode_bytes` takes a prompt file's bytes verbatim. Valid UTF-8
is encoded exactly as :meth:`encode` encodes the decoded text. Bytes that are not valid
UTF-8 cannot go through tiktoken (it encodes ``str``, and lone surrogates would be replaced),
so the input is cut into maximal valid runs and invalid bytes: each valid run is encoded as
text, each invalid byte becomes the rank of its single byte. :meth:`decode_bytes` therefore
gives back the file byte for byte. ``decode`` replaces invalid UTF-8 with U+FFFD, and the
streaming :class:`IncrementalDecoder` never cuts a character in two: incomplete trailing
bytes wait for the next ids.
"""

from __future__ import annotations

import codecs
import math
import operator
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import tiktoken

from k3core.api.errors import TokenizerError, UsageError
from k3core.tokenizer.files import (
    MAX_TIKTOKEN_MODEL_BYTES,
    MAX_TOKEN_ID,
    MAX_TOKENIZER_CONFIG_BYTES,
    AddedToken,
    parse_tiktoken_model,
    parse_tokenizer_config,
    read_capped,
)

#: The Kimi split regex (docs/model.md §7): o200k's pattern with a leading Han-run rule,
#: Han taken out of the letter classes by ``&&`` intersection, and no ``/`` in rule 5's tail.
KIMI_PAT_STR = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)

#: The special-token block at the top of the vocabulary: 256 ids in the released layout
#: (docs/model.md §7). With no named token to say where it starts, at most this many ids may
#: lie between the last rank and the model's ``vocab_size``.
SPECIAL_BLOCK = 256

MODEL_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"

_ESCAPED = re.compile("[\udc80-\udcff]+")

#: The first-party wrapper's limits: text is encoded in chunks of at most this many code
#: points, and no chunk holds a run of whitespace or non-whitespace longer than the second.
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000
_RUN = re.compile(r"\s+|\S+")  # re's \s for str is exactly str.isspace

#: A limited encode tokenizes ordinary text in pieces of about this many characters.
PIECE_CHARS = 8192
#: Where the split pattern always ends a match, in any text: after a newline followed by an
#: ASCII letter or digit (every rule that takes a newline ends at the last one of its run),
#: and after a lowercase ASCII letter followed by a space (the letter rules end at the last
#: letter, and a space is no letter, mark or contraction). A cut there leaves every match.
_SAFE_CUT = re.compile(r"\n(?=[A-Za-z0-9])|[a-z](?= )")


class TokenLimitExceeded(UsageError):
    """Text that holds more tokens than a limit, found without tokenizing all of it.

    ``at_least`` tokens are certain; ``how`` says how that was known (by the length alone,
    or where counting stopped). Callers word the refusal for their limit.
    """

    def __init__(self, limit: int, at_least: int, how: str):
        super().__init__(f"the text holds more than {limit:,} tokens ({how})")
        self.limit = limit
        self.at_least = at_least
        self.how = how


class TokenBudget:
    """A count of tokens against a limit, kept across several encode calls."""

    def __init__(self, limit: int):
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise UsageError(f"a token limit must be an integer, not {limit!r}")
        self.limit = limit
        self.used = 0
        self.chars = 0  # characters tokenized so far

    @property
    def left(self) -> int:
        return self.limit - self.used

    def check_length(self, n_bytes: int, longest: int) -> None:
        """Refuse before tokenizing when ``n_bytes`` of text cannot fit in what is left."""
        need = math.ceil(n_bytes / longest)
        if need > self.left:
            raise TokenLimitExceeded(
                self.limit, self.used + need,
                f"refused before tokenizing: {n_bytes:,} bytes need at least {need:,} tokens, "
                f"as no token is longer than {longest} bytes")

    def spend(self, n: int, chars: int) -> None:
        """Count ``n`` more tokens, the ids of ``chars`` more characters."""
        self.used += n
        self.chars += chars
        if self.used > self.limit:
            raise TokenLimitExceeded(self.limit, self.used,
                                     f"tokenizing stopped at {self.used:,} tokens, after "
                                     f"{self.chars:,} characters")


def reserved_name(token_id: int) -> str:
    """What an unnamed reserved id decodes to."""
    return f"<|reserved_token_{token_id}|>"


class Tokenizer:
    """Encode text or bytes to ids and back; see the module docstring for the rules."""

    def __init__(
        self,
        ranks: dict[bytes, int],
        added: Mapping[int, AddedToken],
        *,
        vocab_size: int | None = None,
        source: str = "tokenizer",
        config_source: str | None = None,
    ):
        n_ranks = len(ranks)
        rank_bytes: list[bytes] = [b""] * n_ranks
        for token, rank in ranks.items():
            if not 0 <= rank < n_ranks or rank_bytes[rank]:
                raise TokenizerError(f"{source}: ranks are not exactly 0..{n_ranks - 1}")
            rank_bytes[rank] = token
        missing = [b for b in range(256) if bytes([b]) not in ranks]
        if missing:
            raise TokenizerError(
                f"{source}: {len(missing)} of the 256 single bytes have no rank (first: "
                f"{missing[0]:#04x}); a byte-level BPE needs them all"
            )
        where = config_source or source
        for tid, tok in added.items():
            if tid < n_ranks:
                raise TokenizerError(
                    f"{where}: added token {tok.content!r} has id {tid}, which is a BPE rank "
                    f"(the {n_ranks} ranks of {source} are 0..{n_ranks - 1}; they must end "
                    "where the special-token block starts)"
                )
        if added and n_ranks < min(added):
            start = min(added)
            raise TokenizerError(
                f"{source}: {n_ranks} ranks where {start} are expected: the ranks run from 0 "
                f"up to the special-token block, which starts at id {start} (the added token "
                f"{added[start].content!r}{f' of {config_source}' if config_source else ''}); "
                f"rank {n_ranks} is the first missing, so the file is cut short or belongs to "
                "another vocabulary"
            )
        if len({tok.content for tok in added.values()}) != len(added):
            raise TokenizerError(f"{where}: two added tokens share one content")
        top = max([n_ranks - 1, *added])
        if vocab_size is None:
            vocab_size = top + 1
        elif not isinstance(vocab_size, int) or isinstance(vocab_size, bool):
            raise UsageError(f"vocab_size must be an integer, not {vocab_size!r}")
        elif vocab_size <= top:
            raise TokenizerError(
                f"{source}: the model's vocab_size {vocab_size} is too small for this tokenizer "
                f"(it uses ids up to {top})"
            )
        elif vocab_size > MAX_TOKEN_ID + 1:
            raise UsageError(f"vocab_size {vocab_size} is over {MAX_TOKEN_ID + 1}")
        elif not added and vocab_size - n_ranks > SPECIAL_BLOCK:
            raise TokenizerError(
                f"{source}: {n_ranks} ranks where at least {vocab_size - SPECIAL_BLOCK} are "
                f"expected: the model's vocab_size {vocab_size} leaves {vocab_size - n_ranks} "
                f"ids above them, more than the {SPECIAL_BLOCK}-id special-token block, and "
                f"no added token says where that starts; rank {n_ranks} is the first missing, "
                "so the file is cut short or belongs to another vocabulary"
            )
        self.vocab_size: int = vocab_size
        self.n_ranks: int = n_ranks
        self.source = source
        self._rank_bytes = rank_bytes
        self._byte_rank = [ranks[bytes([b])] for b in range(256)]
        self._added = dict(added)
        self._added_bytes = {tid: tok.content.encode("utf-8") for tid, tok in added.items()}
        self._longest_rank = max(len(b) for b in rank_bytes)
        self._longest_added = max((len(b) for b in self._added_bytes.values()), default=0)
        self._special_tokens = {tok.content: tid for tid, tok in added.items()}
        try:
            self._enc = tiktoken.Encoding(
                name="kimi-k3",
                pat_str=KIMI_PAT_STR,
                mergeable_ranks=ranks,
                special_tokens=self._special_tokens,
            )
        except (ValueError, RuntimeError) as e:
            raise TokenizerError(f"{source}: tiktoken refused the vocabulary: {e}") from None
        by_length = sorted(self._special_tokens, key=lambda s: (-len(s), s))
        self._special_re = re.compile("|".join(map(re.escape, by_length))) if by_length else None

    @classmethod
    def from_dir(cls, path: str | Path, *, vocab_size: int | None = None) -> Tokenizer:
        """Read ``tiktoken.model`` and ``tokenizer_config.json`` from a directory."""
        d = Path(path)
        if not d.is_dir():
            raise TokenizerError(f"{d}: not a directory holding {MODEL_FILE} and {CONFIG_FILE}")
        return cls.from_files(d / MODEL_FILE, d / CONFIG_FILE, vocab_size=vocab_size)

    @classmethod
    def from_files(
        cls, model_path: str | Path, config_path: str | Path, *, vocab_size: int | None = None
    ) -> Tokenizer:
        """Read the two files from explicit paths."""
        mp, cp = Path(model_path), Path(config_path)
        ranks = parse_tiktoken_model(read_capped(mp, MAX_TIKTOKEN_MODEL_BYTES), str(mp))
        added = parse_tokenizer_config(read_capped(cp, MAX_TOKENIZER_CONFIG_BYTES), str(cp))
        return cls(ranks, added, vocab_size=vocab_size, source=str(mp), config_source=str(cp))

    # ---- facts -------------------------------------------------------------------------

    @property
    def encoding(self) -> tiktoken.Encoding:
        """The underlying tiktoken encoding (ranks, pattern, named added tokens)."""
        return self._enc

    @property
    def special_tokens(self) -> dict[str, int]:
        """Named added tokens: content -> id."""
        return dict(self._special_tokens)

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of the named added tokens (those in ``added_tokens_decoder``)."""
        return frozenset(self._added)

    @property
    def added_tokens(self) -> dict[int, AddedToken]:
        """Id -> the ``added_tokens_decoder`` entry, with its ``special`` flag."""
        return dict(self._added)

    def is_reserved(self, token_id: int) -> bool:
        """True for an unnamed id between the ranks and ``vocab_size``."""
        return self.n_ranks <= token_id < self.vocab_size and token_id not in self._added

    def special_token_id(self, content: str) -> int:
        """The id of a named added token, e.g. ``"[EOS]"``."""
        try:
            return self._special_tokens[content]
        except KeyError:
            raise UsageError(f"{content!r} is not a named token of this tokenizer") from None

    def max_token_bytes(self, allow_special: bool = True) -> int:
        """The most bytes one token of an encoding spells (named added tokens only when allowed)."""
        return max(self._longest_rank, self._longest_added) if allow_special else self._longest_rank

    def id_to_token_bytes(self, token_id: int) -> bytes:
        """The bytes one id decodes to."""
        return self._bytes_of(self._check_id(token_id))

    # ---- encoding ----------------------------------------------------------------------

    def encode(self, text: str, allow_special: bool = True,
               limit: int | TokenBudget | None = None) -> list[int]:
        """Ids for ``text``; named added tokens in it become their ids when allowed.

        With ``limit``, text holding more tokens raises :class:`TokenLimitExceeded` without
        being tokenized in full (module docstring)."""
        if not isinstance(text, str):
            raise UsageError(f"encode takes text (str), not {type(text).__name__}")
        budget = _budget(limit)
        if budget is not None:
            # a lone surrogate becomes one byte here, never more than what tiktoken encodes
            n_bytes = len(text) if text.isascii() else len(text.encode("utf-8", "replace"))
            budget.check_length(n_bytes, self.max_token_bytes(allow_special))
        return self._encode(text, allow_special, budget)

    def _encode(self, text: str, allow_special: bool, budget: TokenBudget | None) -> list[int]:
        out: list[int] = []
        for chunk in _chunks(text):
            out += self._encode_chunk(chunk, allow_special, budget)
        return out

    def _encode_chunk(self, text: str, allow_special: bool, budget: TokenBudget | None = None) -> list[int]:
        ordinary = self._ordinary if budget is None else lambda t: self._ordinary_within(t, budget)
        if not allow_special or self._special_re is None:
            return ordinary(text)
        out: list[int] = []
        pos = 0
        for m in self._special_re.finditer(text):
            if m.start() > pos:
                out += ordinary(text[pos : m.start()])
            out.append(self._special_tokens[m.group()])
            if budget is not None:
                budget.spend(1, m.end() - m.start())
            pos = m.end()
        if pos < len(text):
            out += ordinary(text[pos:])
        return out

    def _ordinary_within(self, text: str, budget: TokenBudget) -> list[int]:
        out: list[int] = []
        for piece in _pieces(text):
            ids = self._ordinary(piece)
            out += ids
            budget.spend(len(ids), len(piece))
        return out

    def _ordinary(self, text: str) -> list[int]:
        try:
            return self._enc.encode_ordinary(text)
        except Exception:
            raise
        except BaseException as e:  # a Rust panic inside tiktoken arrives as BaseException
            if type(e).__name__ != "PanicException":
                raise
            raise UsageError(
                f"tiktoken could not encode a {len(text)}-character span: {e}"
            ) from None

    def encode_bytes(self, data: bytes, allow_special: bool = True,
                     limit: int | TokenBudget | None = None) -> list[int]:
        """Ids for raw bytes (a prompt file); any bytes at all round-trip exactly.

        ``limit`` as for :meth:`encode` (checked on the bytes as given)."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise UsageError(f"encode_bytes takes bytes, not {type(data).__name__}")
        budget = _budget(limit)
        if budget is not None:
            budget.check_length(len(data), self.max_token_bytes(allow_special))
        raw = bytes(data)
        try:
            return self._encode(raw.decode("utf-8"), allow_special, budget)
        except UnicodeDecodeError:
            pass
        text = raw.decode("utf-8", "surrogateescape")
        out: list[int] = []
        pos = 0
        for m in _ESCAPED.finditer(text):
            if m.start() > pos:
                out += self._encode(text[pos : m.start()], allow_special, budget)
            escaped = [self._byte_rank[b] for b in m.group().encode("utf-8", "surrogateescape")]
            out += escaped
            if budget is not None:
                budget.spend(len(escaped), len(escaped))
            pos = m.end()
        if pos < len(text):
            out += self._encode(text[pos:], allow_special, budget)
        return out

    # ---- decoding ----------------------------------------------------------------------

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The exact bytes of ``ids`` (every id checked before anything is returned)."""
        rank_bytes, n_ranks = self._rank_bytes, self.n_ranks
        parts: list[bytes] = []
        for raw_id in ids:
            tid = self._check_id(raw_id)
            parts.append(rank_bytes[tid] if tid < n_ranks else self._bytes_of(tid))
        return b"".join(parts)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; invalid UTF-8 becomes U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", "replace")

    def incremental_decoder(self) -> IncrementalDecoder:
        """A streaming decoder for ids that arrive one at a time."""
        return IncrementalDecoder(self)

    def _bytes_of(self, tid: int) -> bytes:
        if tid < self.n_ranks:
            return self._rank_bytes[tid]
        named = self._added_bytes.get(tid)
        return named if named is not None else reserved_name(tid).encode("ascii")

    def _check_id(self, raw_id: object) -> int:
        if isinstance(raw_id, bool):
            raise UsageError(f"token id {raw_id!r} is not an integer")
        try:
            tid = operator.index(raw_id)  # type: ignore[arg-type]
        except TypeError:
            raise UsageError(f"token id {raw_id!r} is not an integer") from None
        if not 0 <= tid < self.vocab_size:
            raise UsageError(
                f"token id {tid} is outside the model's vocabulary 0..{self.vocab_size - 1}"
            )
        return tid


class IncrementalDecoder:
    """Text out as ids come in, never splitting a UTF-8 character.

    ``push`` returns the text that is complete so far; bytes of a character whose remaining
    bytes have not arrived are held back. ``flush`` ends the stream (held bytes that never
    completed become U+FFFD). The pieces concatenate to ``Tokenizer.decode`` of all ids.
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: int | Iterable[int]) -> str:
        """Feed one id or several; return the text they complete."""
        batch = [ids] if not isinstance(ids, Iterable) else ids
        data = self._tok.decode_bytes(batch)
        return self._utf8.decode(data, final=False)

    def flush(self) -> str:
        """End of stream: whatever is held back, then a fresh start."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text

    @property
    def pending(self) -> bytes:
        """Bytes held back because they end in an incomplete character."""
        return bytes(self._utf8.getstate()[0])


def _budget(limit: int | TokenBudget | None) -> TokenBudget | None:
    return limit if limit is None or isinstance(limit, TokenBudget) else TokenBudget(limit)


def _pieces(text: str, size: int = PIECE_CHARS) -> Iterator[str]:
    """``text`` in consecutive pieces of about ``size`` characters whose ids, encoded one by
    one, are exactly the ids of the whole: each cut is a :data:`_SAFE_CUT` (the last one in
    the second half of the window, else the first one after it; a text without any is one
    piece)."""
    start, n = 0, len(text)
    while n - start > size:
        cut = None
        for m in _SAFE_CUT.finditer(text, start + size // 2, start + size):
            cut = m.end()
        if cut is None:
            after = _SAFE_CUT.search(text, start + size)
            if after is None:
                break
            cut = after.end()
        yield text[start:cut]
        start = cut
    if start < n:
        yield text[start:]


def _chunks(text: str) -> Iterator[str]:
    """Cut text the way the first-party wrapper does before calling tiktoken.

    Windows of :data:`MAX_ENCODE_CHARS` code points, each cut further so that no piece
    holds more than :data:`MAX_RUN_CHARS` consecutive whitespace or non-whitespace
    characters (``str.isspace``). Text within both limits is one chunk, so it is encoded
    exactly as tiktoken encodes it; past them tiktoken's regex engine gives up (a run of
    about a million spaces overflows its backtracking stack).
    """
    if len(text) <= MAX_ENCODE_CHARS and not _has_long_run(text):
        yield text
        return
    for w in range(0, len(text), MAX_ENCODE_CHARS):
        window = text[w : w + MAX_ENCODE_CHARS]
        if not _has_long_run(window):
            yield window
            continue
        start, run, in_space = 0, 0, window[0].isspace()
        for i, ch in enumerate(window):
            is_space = ch.isspace()
            if is_space != in_space:
                run, in_space = 1, is_space
            else:
                run += 1
                if run > MAX_RUN_CHARS:
                    yield window[start:i]
                    start, run = i, 1
        yield window[start:]


def _has_long_run(text: str) -> bool:
    if len(text) <= MAX_RUN_CHARS:
        return False
    return any(m.end() - m.start() > MAX_RUN_CHARS for m in _RUN.finditer(text))
