"""``POST /v1/messages`` through the official ``anthropic`` client against a real ``k3 serve``:
the same ids as the OpenAI chat route for the same conversation, system prompts, streaming
events in Anthropic's order, stop sequences, stop reasons, usage, thinking blocks, the key
(``x-api-key`` or Bearer), error bodies in Anthropic's shape, count_tokens; tools: forced
``tool_use`` blocks equal to the chat route's calls, streamed, ``tool_result`` history."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest
from conftest import Served

from k3core.serve.anthropic import MessagesRequest, stop_reason
from k3core.serve.chat_format import Message, chat_format_for
from k3core.serve.service import TextSink

MODEL = "tiny"
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def k3_of(msg) -> dict:
    return msg.model_extra["k3"]


def blocks(msg, kind: str) -> list:
    return [b for b in msg.content if b.type == kind]


def test_a_message_is_the_chat_route_s_reply(claude, client):
    msg = claude.messages.create(model=MODEL, max_tokens=7, system="Be brief.", messages=HELLO)
    chat = client.chat.completions.create(model=MODEL, max_tokens=7, messages=[
        {"role": "system", "content": "Be brief."}, *HELLO])
    ext = chat.model_extra["k3"]
    assert k3_of(msg)["prompt_ids"] == ext["prompt_ids"]
    assert k3_of(msg)["completion_ids"] == ext["completion_ids"]
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL
    assert msg.id.startswith("msg_")
    assert [b.text for b in blocks(msg, "text")] == [chat.choices[0].message.content]
    reasoning = chat.choices[0].message.model_extra.get("reasoning_content")
    assert [b.thinking for b in blocks(msg, "thinking")] == ([reasoning] if reasoning else [])
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None
    u = msg.usage
    assert u.output_tokens == 7
    assert u.input_tokens + u.cache_read_input_tokens == len(ext["prompt_ids"])
    assert u.cache_creation_input_tokens == 0


def test_system_blocks_and_a_conversation_render_as_the_chat_route_does(claude, client):
    system = [{"type": "text", "text": "You are terse."},
              {"type": "text", "text": "Answer in one word.", "cache_control": {"type": "ephemeral"}}]
    turns = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
             {"role": "assistant", "content": [{"type": "thinking", "thinking": "a greeting", "signature": ""},
                                               {"type": "text", "text": "Hello."}]},
             {"role": "user", "content": "Again"}]
    msg = claude.messages.create(model=MODEL, max_tokens=3, system=system, messages=turns,
                                 metadata={"user_id": "u1"}, extra_headers={"anthropic-beta": "x"})
    chat = client.chat.completions.create(model=MODEL, max_tokens=3, messages=[
        {"role": "system", "content": "You are terse.\n\nAnswer in one word."},
        {"role": "user", "content": "Hi\n\nthere"},
        {"role": "assistant", "content": "Hello.", "reasoning_content": "a greeting"},
        {"role": "user", "content": "Again"}])
    assert k3_of(msg)["prompt_ids"] == chat.model_extra["k3"]["prompt_ids"]
    assert k3_of(msg)["completion_ids"] == chat.model_extra["k3"]["completion_ids"]


def test_streaming_sends_anthropic_s_events_in_order(claude, server):
    kw = {"model": MODEL, "max_tokens": 8, "messages": HELLO, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    whole = claude.messages.create(**kw)
    with claude.messages.stream(**kw) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert final.stop_reason == whole.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 8
    # the raw events: their names, data types and order
    with httpx.stream("POST", f"{server.url}/v1/messages", json={**kw, "stream": True}, timeout=60,
                      headers={"anthropic-version": "2023-06-01"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    names, datas = [], []
    for ev in raw.strip().split("\n\n"):
        head, data = ev.split("\n", 1)
        assert head.startswith("event: ") and data.startswith("data: ")
        names.append(head.removeprefix("event: "))
        datas.append(json.loads(data.removeprefix("data: ")))
    assert [d["type"] for d in datas] == names
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    body = names[2:-2]
    assert body[0] == "content_block_start" and body[-1] == "content_block_stop"
    opened = [d for d in datas if d["type"] == "content_block_start"]
    assert [d["index"] for d in opened] == list(range(len(opened)))
    assert names.count("content_block_stop") == len(opened)
    assert datas[0]["message"]["usage"]["input_tokens"] > 0
    assert datas[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert datas[-2]["usage"]["output_tokens"] == 8
    assert "message_start" in events and "message_stop" in events


def test_stop_sequences_end_the_text_before_them(claude):
    kw = {"model": MODEL, "max_tokens": 10, "messages": HELLO, "thinking": {"type": "disabled"}}
    text = blocks(claude.messages.create(**kw), "text")[0].text
    assert len(text) >= 4, text
    stop = text[len(text) // 2:][:2]
    msg = claude.messages.create(stop_sequences=[stop], **kw)
    assert blocks(msg, "text")[0].text == text[: text.index(stop)]
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    with claude.messages.stream(stop_sequences=[stop], **kw) as s:
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    assert blocks(final, "text")[0].text == text[: text.index(stop)]


def test_thinking_disabled_or_enabled(claude, engine):
    off = claude.messages.create(model=MODEL, max_tokens=4, messages=HELLO, thinking={"type": "disabled"})
    fmt = chat_format_for(engine.tokenizer, thinking=False)
    assert k3_of(off)["prompt_ids"] == fmt.render([Message("user", "Hello")])
    assert not blocks(off, "thinking")
    on = claude.messages.create(model=MODEL, max_tokens=3, messages=HELLO,
                                thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in on.content] == ["thinking", "text"] and on.content[0].signature == ""
    assert on.content[1].text == "" and on.stop_reason == "max_tokens"
    assert "ran out while the model was thinking" in on.model_extra["k3_note"]


def test_count_tokens_counts_the_prompt(claude):
    kw = {"model": MODEL, "system": "Be brief.", "messages": HELLO}
    counted = claude.messages.count_tokens(**kw)
    msg = claude.messages.create(max_tokens=1, **kw)
    assert counted.input_tokens == len(k3_of(msg)["prompt_ids"])


def _error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error"
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind
    assert "Traceback" not in r.text
    return body["error"]["message"]


@pytest.mark.parametrize("body,status,kind,words", [
    ({"model": MODEL, "messages": HELLO}, 400, "invalid_request_error", "max_tokens"),
    ({"model": MODEL, "max_tokens": 4, "messages": []}, 400, "invalid_request_error", "messages"),
    ({"model": "claude-x", "max_tokens": 4, "messages": HELLO}, 404, "not_found_error", "claude-x"),
    ({"model": MODEL, "max_tokens": 4, "messages": HELLO, "bogus": 1}, 400, "invalid_request_error", "bogus"),
    ({"model": MODEL, "max_tokens": "4", "messages": HELLO}, 400, "invalid_request_error", "got a string"),
    ({"model": MODEL, "max_tokens": 4, "temperature": 1.5, "messages": HELLO}, 400, "invalid_request_error",
     "temperature"),
    ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
     400, "invalid_request_error", "k3 does not take image input"),
    ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}]},
     400, "invalid_request_error", "k3 does not take document"),
    ({"model": MODEL, "max_tokens": 4, "messages": [*HELLO, {"role": "assistant", "content": "{"}]},
     400, "invalid_request_error", "does not continue a reply given in advance"),
    ({"model": MODEL, "max_tokens": 4, "messages": HELLO, "stop_sequences": ["a"] * 5}, 400,
     "invalid_request_error", "stop sequences"),
    ({"model": MODEL, "max_tokens": 5000, "messages": HELLO}, 400, "invalid_request_error", "4096"),
    ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "word " * 2000}]},
     400, "invalid_request_error", "context"),
])
def test_refusals_are_anthropic_error_bodies(server, body, status, kind, words):
    r = httpx.post(f"{server.url}/v1/messages", json=body, timeout=30)
    assert words in _error(r, status, kind)


def test_the_client_sees_typed_errors(claude):
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="nope", max_tokens=2, messages=HELLO)
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.org/a.png"}}]}])
    assert "image" in str(e.value)


def test_stop_reasons_of_each_ending(engine):
    def sink(stops: list[str], ids: list[int]) -> TextSink:
        s = TextSink(engine.tokenizer, stops, chat_format_for(engine.tokenizer, thinking=False))
        for t in ids:
            s.on_step(None, "")
            s._channels(s.reply.push(t))
        return s

    fmt = chat_format_for(engine.tokenizer, thinking=False)
    text = fmt.text("abc def")
    assert stop_reason(sink([], text), "length") == ("max_tokens", None)
    assert stop_reason(sink([], text + list(fmt.response_end) + [fmt.stop_ids[0]]), "stop") == ("end_turn", None)
    assert stop_reason(sink(["c d"], text), "stop") == ("stop_sequence", "c d")
    assert MessagesRequest.model_validate({"model": "m", "max_tokens": 1, "messages": HELLO}).stream is False


def test_the_key_is_taken_from_x_api_key_or_bearer(tiny_model):
    s = Served(tiny_model, "--api-key", "sekret", "--threads", "1", "--context", "512")
    try:
        body = {"model": MODEL, "max_tokens": 2, "messages": HELLO}
        url = f"{s.url}/v1/messages"
        for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}):
            msg = _error(httpx.post(url, json=body, headers=headers, timeout=30), 401, "authentication_error")
            assert "x-api-key" in msg
        for headers in ({"x-api-key": "sekret"}, {"Authorization": "Bearer sekret"}):
            assert httpx.post(url, json=body, headers=headers, timeout=30).status_code == 200
        c = anthropic.Anthropic(base_url=s.url, api_key="sekret", max_retries=0, timeout=60)
        assert c.messages.create(**body).usage.output_tokens == 2
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=s.url, api_key="nope", max_retries=0).messages.create(**body)
    finally:
        rc, err = s.stop()
    assert rc == 0 and "Traceback" not in err


WEATHER = {"name": "get_weather", "description": "The weather in a city.", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}
NOW = {"name": "now", "input_schema": {"type": "object", "properties": {}, "additionalProperties": False}}
ASK = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]


def _as_openai(tool: dict) -> dict:
    fn = {"name": tool["name"], "parameters": tool["input_schema"]}
    if "description" in tool:
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def test_a_forced_tool_use_is_the_chat_route_s_call(claude, client):
    import jsonschema

    kw = {"model": MODEL, "max_tokens": 200, "thinking": {"type": "disabled"}}
    for choice, openai_choice in [({"type": "tool", "name": "get_weather"},
                                   {"type": "function", "function": {"name": "get_weather"}}),
                                  ({"type": "any"}, "required")]:
        msg = claude.messages.create(messages=ASK, tools=[WEATHER, NOW], tool_choice=choice, **kw)
        chat = client.chat.completions.create(model=MODEL, max_tokens=200, reasoning_effort="none",
                                              messages=ASK, tools=[_as_openai(t) for t in (WEATHER, NOW)],
                                              tool_choice=openai_choice)
        assert k3_of(msg)["prompt_ids"] == chat.model_extra["k3"]["prompt_ids"]
        assert k3_of(msg)["completion_ids"] == chat.model_extra["k3"]["completion_ids"]
        assert msg.stop_reason == "tool_use"
        uses = blocks(msg, "tool_use")
        assert [(u.name, u.input) for u in uses] == [
            (c.function.name, json.loads(c.function.arguments)) for c in chat.choices[0].message.tool_calls]
        for u in uses:
            jsonschema.validate(u.input, {"get_weather": WEATHER, "now": NOW}[u.name]["input_schema"])
            assert u.id
        if choice["type"] == "tool":
            assert {u.name for u in uses} == {"get_weather"}
    # streamed: the same calls, as tool_use blocks filled by input_json_delta
    whole = claude.messages.create(messages=ASK, tools=[WEATHER], tool_choice={"type": "any"}, **kw)
    with claude.messages.stream(messages=ASK, tools=[WEATHER], tool_choice={"type": "any"}, **kw) as s:
        kinds = [e.delta.type for e in s if e.type == "content_block_delta"]
        final = s.get_final_message()
    assert "input_json_delta" in kinds and final.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in final.content] == \
        [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in whole.content]


def test_tool_results_render_as_the_chat_route_s_tool_answers(claude, client):
    turns = [*ASK,
             {"role": "assistant", "content": [
                 {"type": "text", "text": "Let me look."},
                 {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "days": 3}},
                 {"type": "tool_use", "id": "toolu_2", "name": "now", "input": {}}]},
             {"role": "user", "content": [
                 {"type": "tool_result", "tool_use_id": "toolu_2", "content": "09:00"},
                 {"type": "tool_result", "tool_use_id": "toolu_1",
                  "content": [{"type": "text", "text": "sunny, 21 C"}], "is_error": False},
                 {"type": "text", "text": "Thanks."}]}]
    msg = claude.messages.create(model=MODEL, max_tokens=4, messages=turns, tools=[WEATHER, NOW])
    chat = client.chat.completions.create(model=MODEL, max_tokens=4, tools=[_as_openai(WEATHER), _as_openai(NOW)],
                                          messages=[*ASK,
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": json.dumps({"city": "Paris", "days": 3})}},
            {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_2", "content": "09:00"},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        {"role": "user", "content": "Thanks."}])
    assert k3_of(msg)["prompt_ids"] == chat.model_extra["k3"]["prompt_ids"]
    counted = claude.messages.count_tokens(model=MODEL, messages=turns, tools=[WEATHER, NOW])
    assert counted.input_tokens == len(k3_of(msg)["prompt_ids"])


@pytest.mark.parametrize("extra,words", [
    ({"messages": [*ASK, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "now", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}],
      "tools": [NOW]}, "matches no tool_use"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]},
     "matches no tool_use"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "k3 runs no server tools"),
    ({"tools": [{"name": "bad name", "input_schema": {"type": "object"}}]}, "a tool's name"),
    ({"tools": [NOW], "tool_choice": {"type": "tool", "name": "missing"}}, "missing"),
    ({"tool_choice": {"type": "any"}}, "declares no tools"),
    ({"tools": [NOW], "tool_choice": {"type": "tool"}}, "a name goes with type 'tool'"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://example.org/a.png"}}]}]}]},
     "k3 does not take image input"),
])
def test_bad_tool_input_is_a_400_naming_the_problem(server, extra, words):
    body = {"model": MODEL, "max_tokens": 4, "messages": ASK, **extra}
    r = httpx.post(f"{server.url}/v1/messages", json=body, timeout=30)
    assert words in _error(r, 400, "invalid_request_error")
