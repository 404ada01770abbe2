"""``k3 serve`` through the official ``openai`` client: the same ids and text as the Python API
and ``k3 run``, streamed or not; stop, max_tokens and usage; prefix reuse; a load test."""

from __future__ import annotations

import json
import statistics
import threading
import time

import pytest
from conftest import k3_inprocess

from k3core.serve.chat_format import Message, chat_format_for

PROMPT = "The capital of France is"
MODEL = "tiny"


def k3_ext(resp) -> dict:
    return resp.model_extra["k3"]


def test_models_and_health(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    h = server.get("/health")
    assert h["status"] == "ok" and h["model"] == MODEL and h["context"] == 1024


def test_completion_matches_the_python_api_and_k3_run(client, engine, tiny_model, tmp_path):
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8)
    ref = engine.generate(PROMPT, max_tokens=8)
    ext = k3_ext(resp)
    assert ext["completion_ids"] == ref.ids
    assert resp.choices[0].text == ref.text
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens == len(ref.prompt_ids) == len(ext["prompt_ids"])
    assert resp.usage.completion_tokens == 8 and resp.usage.total_tokens == len(ref.prompt_ids) + 8
    out = tmp_path / "run.json"
    res = k3_inprocess("run", tiny_model, "--prompt", PROMPT, "--gen", "8", "--out", out)
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["generated_ids"] == ext["completion_ids"]
    assert res.stdout.strip() == resp.choices[0].text.strip()  # k3 run prints the text


def test_streamed_completion_gives_the_same_text_and_usage(client):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == plain.choices[0].text
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens


def test_token_id_prompt_and_sampling_match_the_python_api(client, engine):
    ids = [5, 17, 300, 42, 9]
    resp = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0.8,
                                     top_p=0.9, seed=1234)
    ref = engine.generate(ids, max_tokens=6, temperature=0.8, top_p=0.9, seed=1234)
    assert k3_ext(resp)["completion_ids"] == ref.ids
    assert k3_ext(resp)["seed"] == 1234
    again = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0.8,
                                      top_p=0.9, seed=1234)
    assert k3_ext(again)["completion_ids"] == ref.ids


def test_speculative_decoding_gives_the_same_completion(client, engine):
    ids = [5, 17, 300, 42, 9, 5, 17, 300]
    plain = client.completions.create(model=MODEL, prompt=ids, max_tokens=8)
    for mode in ("ngram", "auto"):
        resp = client.completions.create(model=MODEL, prompt=ids, max_tokens=8,
                                         extra_body={"spec": mode})
        assert k3_ext(resp)["completion_ids"] == k3_ext(plain)["completion_ids"]
    import openai

    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=ids, max_tokens=2,
                                  extra_body={"spec": "always"})


def test_stop_string_and_max_tokens_are_honoured(client, engine):
    ref = engine.generate(PROMPT, max_tokens=8)
    assert ref.text is not None
    stop = ref.text[len(ref.text) // 2:][:3]  # a piece in the middle of the greedy text
    cut = ref.text.index(stop)
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, stop=[stop])
    assert resp.choices[0].text == ref.text[:cut]
    assert resp.choices[0].finish_reason == "stop"
    same = engine.generate(PROMPT, max_tokens=8, stop=[stop])
    assert k3_ext(resp)["completion_ids"] == same.ids and resp.usage.completion_tokens == len(same.ids)
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == ref.text[:cut]
    short = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"
    assert k3_ext(short)["completion_ids"] == ref.ids[:3]


def _chat_ref(engine, messages, n, thinking=True):
    fmt = chat_format_for(engine.tokenizer, thinking=thinking)
    ids = fmt.render([Message(m["role"], m["content"]) for m in messages])
    gen = engine.generate(ids, max_tokens=n, stop_ids=list(fmt.stop_ids))
    return fmt, ids, gen


def test_chat_matches_the_python_api_streamed_or_not(client, engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    for effort, thinking in ((None, True), ("none", False)):
        extra = {} if effort is None else {"reasoning_effort": effort}
        resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=7, **extra)
        fmt, ids, ref = _chat_ref(engine, messages, 7, thinking)
        ext = k3_ext(resp)
        assert ext["prompt_ids"] == ids and ext["completion_ids"] == ref.ids
        reply = fmt.parse_reply(ref.ids)
        msg = resp.choices[0].message
        assert msg.content == reply.content
        assert msg.model_extra.get("reasoning_content") == (reply.reasoning or None)
        assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == 7
        chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=7,
                                                     stream=True, **extra))
        assert chunks[0].choices[0].delta.role == "assistant"
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                            for c in chunks)
        assert content == msg.content and reasoning == (reply.reasoning or "")
        assert chunks[-1].choices[0].finish_reason == "length"


def test_prefix_reuse_is_identical_to_a_fresh_run(client, engine, server):
    first = client.completions.create(model=MODEL, prompt=[11, 22, 33, 44], max_tokens=5)
    gen = k3_ext(first)["completion_ids"]
    longer = [11, 22, 33, 44] + gen + [7, 8]
    cont = client.completions.create(model=MODEL, prompt=longer, max_tokens=6)
    assert k3_ext(cont)["reused_tokens"] == 4 + len(gen) - 1  # the last id was still pending
    assert cont.usage.prompt_tokens_details.cached_tokens == 4 + len(gen) - 1
    fresh = engine.generate(longer, max_tokens=6)
    assert k3_ext(cont)["completion_ids"] == fresh.ids
    # a prompt that continues with another id than the pending one still reuses the rest
    other = [11, 22, 33, 44] + gen[:-1] + [(gen[-1] + 1) % 1000, 3]
    alt = client.completions.create(model=MODEL, prompt=other, max_tokens=4)
    assert k3_ext(alt)["completion_ids"] == engine.generate(other, max_tokens=4).ids
    # an unrelated prompt starts afresh
    new = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2)
    assert k3_ext(new)["reused_tokens"] == 0
    assert k3_ext(new)["completion_ids"] == engine.generate([1, 2, 3], max_tokens=2).ids


def test_a_chat_conversation_continues_its_state(client, engine):
    messages = [{"role": "user", "content": "Hi"}]
    r1 = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                        reasoning_effort="none", stop=None)
    ids1 = k3_ext(r1)["prompt_ids"] + k3_ext(r1)["completion_ids"]
    # the next request's prompt extends the first (a client replaying the exact ids)
    nxt = ids1 + [5, 6, 7]
    r2 = client.completions.create(model=MODEL, prompt=nxt, max_tokens=3)
    assert k3_ext(r2)["reused_tokens"] == len(ids1) - 1
    assert k3_ext(r2)["completion_ids"] == engine.generate(nxt, max_tokens=3).ids


def test_load_64_requests_from_8_clients(client, engine, server):
    distinct = [[(7 * i + j) % 700 + 1 for j in range(2 + i % 3)] for i in range(16)]
    prompts = [distinct[i % 16] for i in range(64)]  # eight requests in flight hold eight prompts
    expected = [engine.generate(p, max_tokens=4).ids for p in distinct]
    want = [expected[i % 16] for i in range(64)]
    got: dict[int, list[int]] = {}
    lat: list[float] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker(w: int) -> None:
        try:
            for i in range(w, 64, 8):
                t0 = time.perf_counter()
                if i % 2:
                    r = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=4)
                    ids = k3_ext(r)["completion_ids"]
                else:
                    chunks = list(client.completions.create(
                        model=MODEL, prompt=prompts[i], max_tokens=4, stream=True,
                        stream_options={"include_usage": True}))
                    ids = chunks[-1].model_extra["k3"]["completion_ids"]
                with lock:
                    got[i] = ids
                    lat.append(time.perf_counter() - t0)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    wall = time.perf_counter() - t0
    assert not errors, errors
    assert sorted(got) == list(range(64))
    assert [got[i] for i in range(64)] == want
    assert server.get("/health")["status"] == "ok"
    lat.sort()
    p50, p95 = statistics.median(lat), lat[int(0.95 * (len(lat) - 1))]
    print(f"\nload: 64 requests, 8 clients, {wall:.2f} s; latency p50 {p50 * 1000:.0f} ms, "
          f"p95 {p95 * 1000:.0f} ms")


def test_disconnect_mid_stream_frees_the_engine(server, engine):
    import httpx

    before = server.get("/health")["cancelled"]
    body = {"model": MODEL, "prompt": [4, 5, 6], "max_tokens": 1000, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # one piece arrived; now hang up
    h = server.wait_health(lambda h: h["cancelled"] > before)
    assert h["last"]["finish"] == "cancelled" and h["last"]["completion_tokens"] < 1000
    import openai

    c = openai.OpenAI(base_url=f"http://{server.base}", api_key="x", max_retries=0, timeout=30)
    r = c.completions.create(model=MODEL, prompt=[9, 8, 7], max_tokens=3)
    assert k3_ext(r)["completion_ids"] == engine.generate([9, 8, 7], max_tokens=3).ids


def test_disconnect_while_waiting_for_a_plain_answer_cancels_it(server):
    import httpx

    before = server.get("/health")["cancelled"]
    body = {"model": MODEL, "prompt": [4, 5, 6, 7], "max_tokens": 1000, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.5)
    h = server.wait_health(lambda h: h["cancelled"] > before)
    assert h["last"]["completion_tokens"] < 1000
