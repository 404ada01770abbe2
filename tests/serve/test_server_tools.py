"""Tool calls and JSON replies against a real ``k3 serve`` with the official ``openai`` client:
forced calls and ``json_schema`` replies validate against their schemas on a random-weight
model and on the demo model, streamed calls arrive as ``delta.tool_calls``, tool history
renders, bad input is a 400 that names the problem."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest
from conftest import Served

from k3core.serve.chat_format import Message, ToolCall, chat_format_for
from k3core.serve.tool_calls import declaration, render_request
from k3core.tokenizer.encoding import Tokenizer

DEMO = Path(__file__).resolve().parents[2] / "demo-model"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "days", "unit"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "filters": {"type": "array", "maxItems": 2, "items": {"type": "object", "properties": {
            "k": {"type": "string", "enum": ["a", "b"]}, "v": {"type": "number"}},
            "required": ["k", "v"], "additionalProperties": False}},
        "exact": {"type": "boolean"}},
        "required": ["query"], "additionalProperties": False}}}
NOARGS = {"type": "function", "function": {"name": "now"}}

SCHEMAS = [
    {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 10},
                                      "score": {"type": "number"}},
     "required": ["answer", "score"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
        "type": "string", "enum": ["x", "y", "z"]}}}, "required": ["items"],
     "additionalProperties": False},
    {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                      "ok": {"type": "boolean"}, "n": {"type": ["integer", "null"]}},
     "required": ["zip", "ok", "n"], "additionalProperties": False},
    {"type": "object", "properties": {"p": {"$ref": "#/$defs/point"}}, "required": ["p"],
     "additionalProperties": False, "$defs": {"point": {"type": "object", "properties": {
         "x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"],
         "additionalProperties": False}}},
    {"type": "object", "properties": {"kind": {"anyOf": [{"type": "string", "maxLength": 4},
                                                         {"type": "integer"}]}},
     "required": ["kind"], "additionalProperties": False},
]

#: every value bounded (lengths, an integer range, enums): a reply must finish within 200 tokens
BOUNDED = {"type": "object", "properties": {
    "answer": {"type": "string", "maxLength": 10}, "ok": {"type": "boolean"},
    "n": {"type": "integer", "minimum": 0, "maximum": 99}, "tag": {"enum": ["a", "b"]}},
    "required": ["answer", "ok", "n", "tag"], "additionalProperties": False}

USER = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]


def _tool_schema(name: str) -> dict:
    return {t["function"]["name"]: t["function"].get("parameters", {"type": "object"})
            for t in (WEATHER, SEARCH, NOARGS)}[name]


def _check_calls(choice) -> list:
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), _tool_schema(c.function.name))
        assert c.id.startswith("call_") and c.type == "function"
    return calls


def _forced(client, model, **kw):
    return client.chat.completions.create(model=model, messages=USER, max_tokens=200,
                                          reasoning_effort="none", **kw)


def test_forced_calls_validate_on_a_random_model(client):
    for tools, choice in [([WEATHER, SEARCH, NOARGS], "required"),
                          ([WEATHER, SEARCH], {"type": "function", "function": {"name": "search"}}),
                          ([NOARGS, WEATHER], {"type": "function", "function": {"name": "get_weather"}})]:
        r = _forced(client, "tiny", tools=tools, tool_choice=choice)
        calls = _check_calls(r.choices[0])
        if isinstance(choice, dict):
            assert {c.function.name for c in calls} == {choice["function"]["name"]}
    # sampled rows too, one call only without parallel calls
    r = _forced(client, "tiny", tools=[WEATHER, SEARCH], tool_choice="required", temperature=1.0,
                seed=7, n=3, parallel_tool_calls=False)
    for choice in r.choices:
        assert len(_check_calls(choice)) == 1


def test_a_streamed_forced_call_is_the_same_call(client):
    kw = {"tools": [WEATHER, SEARCH], "tool_choice": "required"}
    whole = _forced(client, "tiny", **kw).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    for chunk in _forced(client, "tiny", stream=True, **kw):
        choice = chunk.choices[0] if chunk.choices else None
        if choice is None:
            continue
        for d in choice.delta.tool_calls or []:
            c = calls.setdefault(d.index, {"name": "", "arguments": ""})
            if d.function.name:
                c["name"] = d.function.name
            c["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole]


def test_json_schema_replies_validate_on_a_random_model(client):
    stopped = 0
    for i, schema in enumerate(SCHEMAS):
        for kw in ({"reasoning_effort": "none"},
                   {"reasoning_effort": "none", "temperature": 1.0, "seed": i},
                   {"max_tokens": 40} if i == 0 else None):  # thinking on: it may think to the end
            if kw is None:
                continue
            r = client.chat.completions.create(
                model="tiny", messages=USER, **{"max_tokens": 200, **kw},
                response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                                        "strict": True}})
            c = r.choices[0]
            if c.finish_reason == "stop":
                jsonschema.validate(json.loads(c.message.content), schema)
                stopped += 1
            else:  # only a reply cut by max_tokens may be unfinished
                assert c.finish_reason == "length"
    assert stopped >= len(SCHEMAS) * 3 // 2
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=200, temperature=1.0,
                                       seed=3, reasoning_effort="none",
                                       response_format={"type": "json_object"})
    c = r.choices[0]
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict)
    else:
        assert c.message.content.startswith("{")


def test_tool_history_renders_as_the_encoder_writes_it(client, tiny_model):
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_a", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}},
            {"id": "call_b", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_b", "content": "noon"},
        {"role": "tool", "tool_call_id": "call_a", "content": "sunny"}]
    r = client.chat.completions.create(model="tiny", messages=history, max_tokens=4,
                                       tools=[WEATHER, NOARGS], reasoning_effort="none")
    tok = Tokenizer.from_dir(tiny_model)
    fmt = chat_format_for(tok, thinking=False)
    want = render_request(fmt, [
        Message("user", USER[0]["content"]),
        Message("assistant", "", tool_calls=(ToolCall("get_weather", {"city": "Paris", "days": 3}),
                                             ToolCall("now", {}))),
        Message("tool", "sunny", tool="get_weather", index=1),
        Message("tool", "noon", tool="now", index=2)], tools=[WEATHER, NOARGS])
    assert r.model_extra["k3"]["prompt_ids"] == want
    assert declaration([WEATHER]).kind == "tool-declare"


@pytest.mark.parametrize("body, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"oneOf": [{"type": "string"}]}}}}}},
     "'oneOf' is outside the supported subset"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": "(unclosed"}}}}, "does not compile"),
    ({"tools": [{"type": "function", "function": {"description": "nameless"}}]},
     "missing required field 'tools.0.function.name'"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "a tool needs a name"),
    ({"messages": USER + [{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                                 "function": {"name": "now"}}]},
                          {"role": "tool", "tool_call_id": "c9", "content": "x"}],
      "tools": [NOARGS]}, "tool_call_id 'c9' matches no tool call"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "names the function 'nope'"),
    ({"tool_choice": "required"}, "declares no tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "two different replies"),
])
def test_bad_input_is_a_400_naming_the_problem(client, body, words):
    req = {"model": "tiny", "messages": USER, "max_tokens": 4, **body}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**req)
    assert words in e.value.body["message"], e.value.body


def test_forced_calls_and_json_replies_validate_on_the_demo_model():
    s = Served(DEMO, "--context", "2048", "--threads", "1")
    try:
        c = openai.OpenAI(base_url=f"http://{s.base}", api_key="unused", max_retries=0, timeout=120)
        # every argument bounded (lengths, an integer range, an enum): the call must finish
        for tools, choice in [([WEATHER, NOARGS], "required"),
                              ([SEARCH, WEATHER], {"type": "function", "function": {"name": "get_weather"}})]:
            r = _forced(c, "demo-model", tools=tools, tool_choice=choice, parallel_tool_calls=False)
            assert len(_check_calls(r.choices[0])) == 1
        for i, schema in enumerate([*SCHEMAS, BOUNDED]):
            r = c.chat.completions.create(
                model="demo-model", messages=USER, max_tokens=200, reasoning_effort="none",
                response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}})
            if r.choices[0].finish_reason == "stop" or schema in (SCHEMAS[1], BOUNDED):
                assert r.choices[0].finish_reason == "stop"  # bounded schemas must finish
                jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    finally:
        rc, err = s.stop()
    assert rc == 0 and "Traceback" not in err, err
