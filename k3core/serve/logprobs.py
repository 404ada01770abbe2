"""Log probabilities of the tokens a generation chose (and of its prompt), in OpenAI's shapes.

Every figure comes from the exact float32 logits of the step, before any penalty, bias,
temperature, top-k or top-p (the model's own distribution, as vLLM's default reports it):
the log-softmax is computed in float64 with the kernel contract's own functions, so the
figures are the same bits on every machine::

    lp[j] = (z[j] - z_max) - log(S),   S = lane_sum(exp_d(z - z_max))

(``exp_d`` and ``lane_sum`` as the sampler uses them, ``k3core.model.sampling``; ``log``
is Python's ``math.log`` of the one sum). The top ids of a step are those with the
largest logits, ties to the lowest id. A token whose bytes are not UTF-8 on their own (a
piece of a character) is named ``bytes:\\xNN...`` as OpenAI names it; ``bytes`` holds them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from k3core.model.sampling import exp_d, lane_sum
from k3core.tokenizer.encoding import Tokenizer

#: the most alternatives a token may list (OpenAI's chat limit)
MAX_TOP = 20


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """The float64 log-probabilities of one step's logits (module docstring)."""
    z = np.asarray(logits, dtype=np.float32).astype(np.float64)
    shifted = z - z.max()
    return shifted - math.log(lane_sum(exp_d(shifted)))


def top_ids(lp: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` ids with the largest values, largest first, ties to the lowest id."""
    if k <= 0:
        return np.empty(0, dtype=np.int64)
    k = min(k, lp.size)
    kth = np.partition(lp, lp.size - k)[lp.size - k]
    cand = np.flatnonzero(lp >= kth)  # increasing ids
    order = np.argsort(-lp[cand], kind="stable")
    return cand[order[:k]]


@dataclass
class TokenLogprob:
    """One token's log-probability and the ``top`` most likely ids of its step."""

    id: int
    logprob: float
    top: list[tuple[int, float]]


def record(logits: np.ndarray, token: int, k: int) -> TokenLogprob:
    lp = log_softmax(logits)
    return TokenLogprob(int(token), float(lp[token]), [(int(i), float(lp[i])) for i in top_ids(lp, k)])


@dataclass
class Recorder:
    """The log-probabilities of one generation's tokens, as they are chosen."""

    top: int = 0
    records: list[TokenLogprob] = field(default_factory=list)

    def wrap(self, pick: Callable[[np.ndarray], int]) -> Callable[[np.ndarray], int]:
        """``pick``, recording each token it chooses against the logits it was handed."""

        def recorded(logits: np.ndarray) -> int:
            tok = pick(logits)
            self.records.append(record(logits, tok, self.top))
            return tok

        return recorded


@dataclass
class PromptRecorder:
    """The prompt's log-probabilities: the first id has none, id ``j`` is scored by the
    logits of position ``j - 1`` (``Session.prefill``'s rows)."""

    ids: Sequence[int]
    top: int = 0
    records: list[TokenLogprob | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.records = [None]

    def on_rows(self, pos: int, rows: np.ndarray) -> None:
        for j, row in enumerate(rows):
            nxt = pos + j + 1
            if nxt < len(self.ids):
                self.records.append(record(row, self.ids[nxt], self.top))


# ---- OpenAI's shapes ------------------------------------------------------------------------
def token_name(tok: Tokenizer, token: int) -> tuple[str, list[int]]:
    """A token as OpenAI names it, and its bytes."""
    raw = tok.id_to_token_bytes(token)
    try:
        return raw.decode("utf-8"), list(raw)
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)


def chat_entries(tok: Tokenizer, recs: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """``logprobs.content`` entries of a chat reply (``top_logprobs`` the ``top`` asked)."""
    out = []
    for r in recs:
        name, raw = token_name(tok, r.id)
        tops = []
        for i, lp in r.top:
            n, b = token_name(tok, i)
            tops.append({"token": n, "logprob": lp, "bytes": b})
        out.append({"token": name, "logprob": r.logprob, "bytes": raw, "top_logprobs": tops})
    return out


def chat_logprobs(tok: Tokenizer, recs: Sequence[TokenLogprob]) -> dict[str, Any]:
    return {"content": chat_entries(tok, recs), "refusal": None}


class CompletionLogprobs:
    """A completion's ``logprobs``, whole or in a stream's pieces: ``tokens``,
    ``token_logprobs`` (``None`` for a prompt's first id), ``top_logprobs`` (the ``top`` ids
    of the step and the chosen one, as OpenAI gives up to ``logprobs + 1``; ``None`` where
    ``token_logprobs`` is) and ``text_offset`` (the characters of whole text before each
    token, counted across the pieces)."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self._dec = tok.incremental_decoder()
        self.at = 0

    def shape(self, ids: Sequence[int], recs: Sequence[TokenLogprob | None]) -> dict[str, Any]:
        tok = self.tok
        tokens: list[str] = []
        lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for tid, r in zip(ids, recs, strict=True):
            tokens.append(token_name(tok, tid)[0])
            offsets.append(self.at)
            self.at += len(self._dec.push(tid))
            if r is None:
                lps.append(None)
                tops.append(None)
                continue
            lps.append(r.logprob)
            entry = {token_name(tok, i)[0]: lp for i, lp in r.top}
            entry.setdefault(tokens[-1], r.logprob)
            tops.append(entry)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}
