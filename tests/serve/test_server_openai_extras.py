"""The rest of the OpenAI surface through the official ``openai`` client against a real
``k3 serve``: logprobs and top_logprobs (equal to the log-softmax of the logits k3 computes
for the same ids), ``n`` (each row the single request with its derived seed), ``echo``,
presence and frequency penalties and logit bias (the same ids as a reference loop over the
Python API's logits), harmless fields, refusals in words, a reply cut while thinking."""

from __future__ import annotations

import json

import httpx
import numpy as np
import openai
import pytest
from conftest import k3_inprocess

from k3core.model.penalties import Penalties
from k3core.serve.chat_format import Message, chat_format_for
from k3core.serve.logprobs import log_softmax

MODEL = "tiny"
PROMPT_IDS = [5, 17, 300, 42, 9, 61]
MESSAGES = [{"role": "user", "content": "Hello there"}]


def k3_ext(resp) -> dict:
    return resp.model_extra["k3"]


def numpy_log_softmax(row: np.ndarray) -> np.ndarray:
    """An independent float64 log-softmax (NumPy's exp and log)."""
    z = row.astype(np.float64)
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


def top_by_logit(row: np.ndarray, k: int) -> list[int]:
    return [int(i) for i in np.argsort(-row.astype(np.float64), kind="stable")[:k]]


def test_chat_logprobs_are_the_log_softmax_of_the_logits(client, engine):
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6,
                                          logprobs=True, top_logprobs=3, reasoning_effort="none")
    ext = k3_ext(resp)
    prompt, made = ext["prompt_ids"], ext["completion_ids"]
    rows = engine.logits(prompt + made, all_positions=True)
    content = resp.choices[0].logprobs.content
    assert len(content) == len(made) == resp.usage.completion_tokens
    for j, (entry, tok) in enumerate(zip(content, made, strict=True)):
        row = rows[len(prompt) + j - 1]
        assert entry.logprob == float(log_softmax(row)[tok])  # the same bits
        assert abs(entry.logprob - numpy_log_softmax(row)[tok]) < 1e-9
        assert bytes(entry.bytes) == engine.tokenizer.id_to_token_bytes(tok)
        want = top_by_logit(row, 3)
        assert [bytes(t.bytes) for t in entry.top_logprobs] == [engine.tokenizer.id_to_token_bytes(i) for i in want]
        assert [t.logprob for t in entry.top_logprobs] == [float(log_softmax(row)[i]) for i in want]
    # streamed: the same entries, spread over the chunks
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6,
                                                 logprobs=True, top_logprobs=3,
                                                 reasoning_effort="none", stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    # without logprobs the same ids (recording changes nothing)
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6,
                                           reasoning_effort="none")
    assert k3_ext(plain)["completion_ids"] == made and plain.choices[0].logprobs is None


def test_completion_logprobs_with_echo_score_the_prompt_too(client, engine, tiny_model, tmp_path):
    resp = client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=4, echo=True,
                                     logprobs=2)
    made = k3_ext(resp)["completion_ids"]
    ids = PROMPT_IDS + made
    rows = engine.logits(ids, all_positions=True)
    lp = resp.choices[0].logprobs
    assert resp.choices[0].text == engine.tokenizer.decode(ids)
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for j in range(1, len(ids)):
        want = float(log_softmax(rows[j - 1])[ids[j]])
        assert lp.token_logprobs[j] == want
        tops = lp.top_logprobs[j]
        assert lp.tokens[j] in tops and tops[lp.tokens[j]] == want
        assert len(tops) in (2, 3)  # the top 2, and the chosen one when it is not among them
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # the first generated token against the logits `k3 run --dump-logits` writes
    dump = tmp_path / "logits.f32"
    res = k3_inprocess("run", tiny_model, "--ids", ",".join(map(str, PROMPT_IDS)), "--gen", "1",
                       "--dump-logits", dump)
    assert res.exit_code == 0, res.output
    first = np.fromfile(dump, dtype="<f4")
    assert lp.token_logprobs[len(PROMPT_IDS)] == float(log_softmax(first)[made[0]])
    # streamed: the echo first, then the tokens; the same figures
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=4,
                                            echo=True, logprobs=2, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == resp.choices[0].text
    joined: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in chunks:
        for k in joined:
            joined[k] += getattr(c.choices[0].logprobs, k) if c.choices[0].logprobs else []
    assert joined == {k: getattr(lp, k) for k in joined}


def test_echo_with_max_tokens_0_scores_the_prompt(client, engine):
    resp = client.completions.create(model=MODEL, prompt="def f(x):\n    return", max_tokens=0,
                                     echo=True, logprobs=0)
    assert resp.choices[0].text == "def f(x):\n    return"
    assert resp.usage.completion_tokens == 0
    ids = k3_ext(resp)["prompt_ids"]
    rows = engine.logits(ids, all_positions=True)
    want = [None] + [float(log_softmax(rows[j - 1])[ids[j]]) for j in range(1, len(ids))]
    assert resp.choices[0].logprobs.token_logprobs == want
    plain = client.completions.create(model=MODEL, prompt="abc", max_tokens=2, echo=True)
    assert plain.choices[0].text.startswith("abc") and plain.choices[0].logprobs is None


def test_n_rows_each_equal_the_single_request_with_its_seed(client, engine):
    kw = {"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 6, "temperature": 0.9, "seed": 77}
    resp = client.completions.create(n=3, **kw)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    rows = k3_ext(resp)["rows"]
    assert [r["seed"] for r in rows] == [77, 78, 79]
    for i, choice in enumerate(resp.choices):
        single = client.completions.create(**{**kw, "seed": 77 + i})
        assert k3_ext(single)["completion_ids"] == rows[i]["completion_ids"]
        assert single.choices[0].text == choice.text
        ref = engine.generate(PROMPT_IDS, max_tokens=6, temperature=0.9, seed=77 + i)
        assert ref.ids == rows[i]["completion_ids"]
    assert resp.usage.completion_tokens == sum(len(r["completion_ids"]) for r in rows)
    assert len({tuple(r["completion_ids"]) for r in rows}) > 1  # the seeds differ, so do the rows
    # a chat of 2 rows, streamed, gives each row's text under its index
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "temperature": 1.0, "seed": 5,
            "n": 2, "reasoning_effort": "none"}
    whole = client.chat.completions.create(**chat)
    texts = {0: "", 1: ""}
    finishes = {}
    for c in client.chat.completions.create(stream=True, **chat):
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert finishes == {c.index: c.finish_reason for c in whole.choices}
    # greedy rows are all the greedy reply; a one-id prompt has no prefix to share
    greedy = client.completions.create(model=MODEL, prompt=[7], max_tokens=4, n=2)
    ref = engine.generate([7], max_tokens=4).ids
    assert [r["completion_ids"] for r in k3_ext(greedy)["rows"]] == [ref, ref]


def _penalised_reference(engine, prompt, n, pen: Penalties) -> list[int]:
    """Greedy decoding with the penalties, one full pass per step over the Python API."""
    ids, counts, out = list(prompt), {}, []
    for _ in range(n):
        z = pen.apply(engine.logits(ids), counts)
        tok = int(np.argmax(z))
        counts[tok] = counts.get(tok, 0) + 1
        ids.append(tok)
        out.append(tok)
    return out


def test_penalties_and_logit_bias_change_the_choice_as_documented(client, engine):
    prompt = [3, 3, 3, 3]
    kw = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "extra_body": {"ignore_eos": True}}
    plain = k3_ext(client.completions.create(**kw))["completion_ids"]
    zero = client.completions.create(presence_penalty=0, frequency_penalty=0, logit_bias={}, **kw)
    assert k3_ext(zero)["completion_ids"] == plain
    cases = [{"frequency_penalty": 2.0}, {"presence_penalty": 2.0},
             {"presence_penalty": -1.5, "frequency_penalty": 0.5},
             {"logit_bias": {str(plain[0]): -100}}, {"logit_bias": {"11": 100}},
             {"frequency_penalty": 1.0, "logit_bias": {str(plain[1]): -3.25, "12": 2.5}}]
    for case in cases:
        resp = client.completions.create(**case, **kw)
        bias = {int(k): v for k, v in case.get("logit_bias", {}).items()}
        pen = Penalties(case.get("presence_penalty", 0.0), case.get("frequency_penalty", 0.0), bias)
        assert k3_ext(resp)["completion_ids"] == _penalised_reference(engine, prompt, 8, pen), case
    assert k3_ext(client.completions.create(logit_bias={"11": 100}, **kw))["completion_ids"] == [11] * 8
    # logprobs stay those of the exact logits, whatever the penalties
    resp = client.completions.create(frequency_penalty=2.0, logprobs=1, **kw)
    made = k3_ext(resp)["completion_ids"]
    rows = engine.logits(prompt + made, all_positions=True)
    assert resp.choices[0].logprobs.token_logprobs == [
        float(log_softmax(rows[len(prompt) + j - 1])[t]) for j, t in enumerate(made)]


def test_harmless_fields_are_accepted_and_ignored(client, engine):
    base = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    resp = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, store=False, metadata={"who": "test"},
        user="u1", service_tier="auto", parallel_tool_calls=True, modalities=["text"],
        prediction={"type": "content", "content": "Hello"}, prompt_cache_key="k",
        safety_identifier="s", stream_options=None)
    assert k3_ext(resp)["completion_ids"] == k3_ext(base)["completion_ids"]
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False}))
    assert chunks[-1].usage.completion_tokens == 4


REFUSALS = [
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
     "messages.0.content", "k3 does not take image input"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     "messages.0.content", "k3 does not take audio input"),
    ({"modalities": ["text", "audio"]}, "modalities", "text only"),
    ({"top_logprobs": 2}, "top_logprobs", "needs logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "20"),
    ({"presence_penalty": 2.5}, "presence_penalty", "2"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "-100..100"),
    ({"logit_bias": {"99999": 1}}, None, "outside the vocabulary"),
    ({"n": 0}, "n", "n"),
]


@pytest.mark.parametrize("extra,param,words", REFUSALS, ids=[r[2][:20] for r in REFUSALS])
def test_refusals_say_what_k3_cannot_do(server, extra, param, words):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **extra}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert words in err["message"] and "Input should be None" not in err["message"], err
    if param is not None:
        assert err["param"] == param


@pytest.mark.parametrize("extra,words", [
    ({"suffix": "}"}, "fill in the middle"),
    ({"best_of": 3}, "best_of must equal n"),
    ({"logprobs": 21}, "20"),
])
def test_completion_refusals_say_what_k3_cannot_do(server, extra, words):
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "a", **extra}, timeout=30)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_max_tokens_spent_thinking_says_so(client, engine, server):
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3,
                                          reasoning_effort="max")
    fmt = chat_format_for(engine.tokenizer, thinking=True)
    ids = fmt.render([Message("user", MESSAGES[0]["content"])])
    assert k3_ext(resp)["prompt_ids"] == ids
    choice = resp.choices[0]
    reply = fmt.parse_reply(k3_ext(resp)["completion_ids"])
    assert choice.finish_reason == "length" and choice.message.content == "" == reply.content
    note = choice.message.model_extra["k3_note"]
    assert "max_tokens ran out while the model was thinking" in note and "reasoning_effort" in note
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3,
                                                 reasoning_effort="max", stream=True))
    last = chunks[-1].choices[0]
    assert last.finish_reason == "length" and last.delta.model_extra["k3_note"] == note
    # a reply that gets to answer carries no note
    done = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3,
                                          reasoning_effort="none")
    assert "k3_note" not in done.choices[0].message.model_extra
    raw = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": MESSAGES, "max_tokens": 3, "reasoning_effort": "none"}).json()
    assert "k3_note" not in json.dumps(raw)


def test_openai_client_errors_are_typed(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, n=17)
    assert e.value.code == "invalid_value"


def test_n_rows_continue_a_reused_prefix_exactly(client, engine):
    first = client.completions.create(model=MODEL, prompt=[21, 22, 23, 24, 25], max_tokens=3)
    longer = [21, 22, 23, 24, 25] + k3_ext(first)["completion_ids"] + [26, 27]
    resp = client.completions.create(model=MODEL, prompt=longer, max_tokens=4, n=2,
                                     temperature=0.7, seed=9)
    assert k3_ext(resp)["reused_tokens"] > 0
    for i, row in enumerate(k3_ext(resp)["rows"]):
        assert row["completion_ids"] == engine.generate(longer, max_tokens=4, temperature=0.7,
                                                        seed=9 + i).ids


def test_penalties_count_the_ids_a_grammar_forces(client, engine):
    """A constrained reply with penalties picks every id (none fast-forwarded), so the
    counts hold the forced ids too: the ids of a plain loop that picks each one."""
    from k3core.constrain.grammar import GrammarConstraint, lark_grammar
    from k3core.run.request import GenerationParams
    from k3core.serve.reply_grammar import json_reply

    # a negative penalty favours the ids already written: the forced '"' closes the string
    schema = {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"],
              "additionalProperties": False}
    resp = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=24, reasoning_effort="none", frequency_penalty=-2.0,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    ext = k3_ext(resp)
    fmt = chat_format_for(engine.tokenizer, thinking=False)
    constraint = GrammarConstraint(lark_grammar(json_reply(fmt, schema), engine.tokenizer), engine.tokenizer)
    constraint.fast_forward = False
    pen = Penalties(0.0, -2.0)
    session = engine.session()
    params = GenerationParams(max_tokens=24, stop_ids=list(fmt.stop_ids))
    ref = [s.token for s, _ in session.steps(ext["prompt_ids"], params, pen.wrap, constraint) if s is not None]
    assert ext["completion_ids"] == ref
    assert resp.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(resp.choices[0].message.content)["word"], str)
