"""``k3 serve`` takes JSON types as they are (a wrong type is a 400 naming the field), and
refuses a prompt too long for the context before the work it would cost: by its bytes alone
before tokenizing, else by tokenizing only up to the limit. The server stays responsive."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from test_server_refusals import error_of, post

MODEL = "tiny"
CHAT = [{"role": "user", "content": "a"}]

WRONG_TYPES = [
    # (path, fields, the field the message must name)
    ("/v1/completions", {"max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"max_tokens": 5.0}, "max_tokens"),
    ("/v1/completions", {"stream": "yes"}, "stream"),
    ("/v1/completions", {"stream": 1}, "stream"),
    ("/v1/completions", {"seed": "12"}, "seed"),
    ("/v1/completions", {"prompt": [True, False]}, "prompt"),
    ("/v1/completions", {"prompt": [["1"]]}, "prompt"),
    ("/v1/completions", {"prompt": 7}, "prompt"),
    ("/v1/completions", {"temperature": "0.5"}, "temperature"),
    ("/v1/completions", {"temperature": True}, "temperature"),
    ("/v1/completions", {"top_k": "3"}, "top_k"),
    ("/v1/completions", {"n": True}, "n"),
    ("/v1/completions", {"echo": 0}, "echo"),
    ("/v1/completions", {"presence_penalty": False}, "presence_penalty"),
    ("/v1/completions", {"ignore_eos": "true"}, "ignore_eos"),
    ("/v1/completions", {"stop": 5}, "stop"),
    ("/v1/completions", {"stop_token_ids": [True]}, "stop_token_ids"),
    ("/v1/completions", {"stream_options": {"include_usage": "yes"}}, "include_usage"),
    ("/v1/completions", {"model": 1}, "model"),
    ("/v1/chat/completions", {"max_completion_tokens": "3"}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
     "text"),
    ("/v1/chat/completions", {"logprobs": 0}, "logprobs"),
]


@pytest.mark.parametrize("path,fields,name", WRONG_TYPES, ids=[f"{i}-{c[2]}" for i, c in enumerate(WRONG_TYPES)])
def test_a_wrong_json_type_is_a_400_naming_the_field(server, path, fields, name):
    base = {"model": MODEL, "prompt": "a", "max_tokens": 1} if path == "/v1/completions" else \
        {"model": MODEL, "messages": CHAT, "max_tokens": 1}
    err = error_of(post(server, path, {**base, **fields}), 400)
    assert err["code"] == "invalid_value", err
    assert name in err["message"] and name in (err["param"] or ""), err
    assert "got " in err["message"], err  # and says what it got


def test_the_right_types_still_pass(server):
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": [4, 5], "max_tokens": 1, "n": 1,
                                        "temperature": 1, "presence_penalty": 0.0, "echo": False,
                                        "stream": False, "seed": 3})
    assert r.status_code == 200, r.text


def fifteen_mb() -> str:
    return "hello world " * 1_250_000


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_15_mb_prompt_is_refused_before_tokenizing(server, path):
    text = fifteen_mb()
    body = {"model": MODEL, "prompt": text} if path == "/v1/completions" else \
        {"model": MODEL, "messages": [{"role": "user", "content": text}]}
    r = post(server, path, body)
    err = error_of(r, 400)
    assert err["code"] == "context_length_exceeded"
    assert "refused before tokenizing" in err["message"]  # the length alone decided it
    assert "15,000,000 bytes" in err["message"]


def test_counting_stops_at_the_context(server):
    # within the length bound (the tiny tokenizer's tokens are at most 17 bytes), over the context
    text = "hello world\n" * 1400
    err = error_of(post(server, "/v1/completions", {"model": MODEL, "prompt": text}), 400)
    assert err["code"] == "context_length_exceeded" and "tokenizing stopped at" in err["message"]
    stopped = int(err["message"].split("after ")[1].split(" characters")[0].replace(",", ""))
    assert stopped < len(text)  # the rest was never tokenized
    msgs = [{"role": "user", "content": "hello world\n" * 700}] * 2
    err = error_of(post(server, "/v1/chat/completions", {"model": MODEL, "messages": msgs}), 400)
    assert err["code"] == "context_length_exceeded" and "tokenizing stopped at" in err["message"]


def test_eight_huge_prompts_leave_the_server_responsive(server):
    text = fifteen_mb()
    codes: list[int] = []

    def send() -> None:
        codes.append(post(server, "/v1/completions", {"model": MODEL, "prompt": text}).status_code)

    threads = [threading.Thread(target=send) for _ in range(8)]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": [4, 5], "max_tokens": 1},
                   timeout=60)
    took = time.monotonic() - t0
    for t in threads:
        t.join(60)
    assert r.status_code == 200, r.text
    assert codes == [400] * 8
    assert took < 30, took  # generous: a one-token request is not stuck behind them
    assert server.get("/health")["status"] == "ok"
