"""Tool calls in the Kimi K3 format: the transcript the official encoder writes, the model's
tools channel read back (whole and streamed), and the grammar that forces a call."""

from __future__ import annotations

import pytest

from k3core.api.errors import UsageError
from k3core.constrain.grammar import GrammarConstraint, lark_grammar
from k3core.constrain.schema import check_schema
from k3core.serve.chat_format import Message, ToolCall, chat_format_for
from k3core.serve.reply_grammar import forced_calls, json_reply
from k3core.serve.tool_calls import (
    Pending,
    ToolStream,
    bind_answers,
    choice_note,
    format_note,
    parse_tools,
    render_request,
)
from k3core.tokenizer.encoding import Tokenizer

WEATHER = {"name": "get_weather", "description": "Weather & more",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string"}, "days": {"type": "integer"},
               "unit": {"enum": ["c", "f"]},
               "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
               "tags": {"type": "array", "items": {"type": "string"}},
               "note": {"type": "string", "maxLength": 5}},
               "required": ["city", "days", "unit"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def tok(tiny_model) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model)


def test_the_transcript_is_the_official_encoders(tok):
    """Declaration first, calls in the tools channel with typed arguments, the answer bound
    by its id, the notes after the conversation (the strings the official encoder writes)."""
    fmt = chat_format_for(tok, thinking=False)
    calls = (ToolCall("get_weather", {"city": 'Rome "old"', "days": 2}, "c1"),
             ToolCall("a&b", '{"x":1', "c2"))
    msgs = bind_answers([
        Pending("user", "Weather?"),
        Pending("assistant", "ok", calls=calls),
        Pending("tool", "broken", call_id="c2", where="messages.3"),
        Pending("tool", "sunny", call_id="c1", where="messages.4"),
    ])
    ids = render_request(fmt, msgs, tools=[{"type": "function", "function": {"name": "f", "b": 1}}],
                         notes=[choice_note("required"), format_note("json_object")])
    assert tok.decode(ids) == (
        '<|open|>message role="system" type="tool-declare"<|sep|># Tools\nHere are the available '
        'tools, described in JSONSchema.\n\n```json\n[{"function":{"b":1,"name":"f"},"type":"function"}]'
        '\n```<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="user"<|sep|>Weather?<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>ok<|close|>response<|sep|>'
        '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
        '<|open|>argument key="city" type="string"<|sep|>Rome "old"<|close|>argument<|sep|>'
        '<|open|>argument key="days" type="number"<|sep|>2<|close|>argument<|sep|><|close|>call<|sep|>'
        '<|open|>call tool="a&amp;b" index="2"<|sep|><|open|>json type="object"<|sep|>{"x":1'
        '<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="tool" tool="get_weather" index="1"<|sep|>sunny<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="tool" tool="a&amp;b" index="2"<|sep|>broken<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="system" type="tool-choice"<|sep|>The system is invoked with '
        '`tool_choice=required`.\nYou MUST call tools in the next message.<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="system" type="response-format"<|sep|>The system is invoked with '
        '`response_format=json_object`.\nYour response must be raw JSON data without markdown code '
        'blocks (```json) or any additional formatting.<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>')


def test_a_tool_call_id_that_matches_no_call_is_refused():
    with pytest.raises(UsageError, match=r"messages.2: tool_call_id 'nope' matches no tool call"):
        bind_answers([Pending("assistant", "", calls=(ToolCall("f", {}, "c1"),)),
                      Pending("user", "x"), Pending("tool", "r", call_id="nope", where="messages.2")])


def _reply(fmt, calls, thinking_text="hmm"):
    lead = fmt.text(thinking_text) + fmt.think_to_response if fmt.thinking else []
    return (lead + fmt.text("Checking.") + fmt._close("response") + fmt.tools_channel(calls)
            + fmt._close("message") + [fmt.eom_id])


@pytest.mark.parametrize("thinking", [False, True])
def test_the_tools_channel_reads_back_whole_and_streamed(tok, thinking):
    fmt = chat_format_for(tok, thinking=thinking)
    calls = [ToolCall("get_weather", {"city": "Paris <b>", "days": 3, "unit": "f", "tags": ["a"]}),
             ToolCall("noargs", {})]
    ids = _reply(fmt, calls)
    r = fmt.parse_reply(ids)
    assert r.well_formed and r.content == "Checking." and (r.reasoning == "hmm") == thinking
    got = parse_tools(fmt, r.tools, {"get_weather", "noargs"})
    assert [(c.name, c.arguments) for c in got.calls] == [(c.name, c.arguments) for c in calls]
    assert got.text == "" and got.warnings == []
    # streamed: the reader hands the tools channel over a token at a time, each call whole
    reader, stream, seen = fmt.stream(), ToolStream(fmt, {"get_weather", "noargs"}), []
    for t in ids:
        for name, part, _ in reader.push(t):
            if name == "tools":
                seen += [c.arguments for c in stream.push(part).calls]
    assert seen == [c.arguments for c in calls] and stream.finish(cut=False).calls == []


def test_a_malformed_call_comes_back_as_text_with_a_warning(tok):
    fmt = chat_format_for(tok, thinking=False)
    good = fmt.tools_channel([ToolCall("f", {"a": 1})])[len(fmt._open("tools")):-len(fmt._close("tools"))]
    bad = (fmt.open_tag("call", [("tool", "f")]) + fmt.open_tag("argument", [("key", "n"), ("type", "number")])
           + fmt.text("twelve") + fmt._close("argument") + fmt._close("call"))
    got = parse_tools(fmt, good + bad + fmt.text("junk"), {"f"})
    assert [c.arguments for c in got.calls] == [{"a": 1}]
    assert "twelve" in got.text and "junk" in got.text and len(got.warnings) == 2
    unknown = parse_tools(fmt, good, {"g"})
    assert unknown.calls == [] and "does not declare" in unknown.warnings[0]


def test_a_reply_cut_inside_its_tools_channel_is_closed_well_formed(tok):
    fmt = chat_format_for(tok, thinking=True)
    ids = _reply(fmt, [ToolCall("get_weather", {"city": "Oslo", "days": 1})])
    for cut in range(1, len(ids)):
        head = ids[:cut]
        closed = head + fmt.close_reply(head)
        assert fmt.parse_reply(closed).well_formed, tok.decode(head)


@pytest.mark.parametrize("thinking", [False, True])
def test_the_forced_grammar_takes_what_the_encoder_writes(tok, thinking):
    fmt = chat_format_for(tok, thinking=thinking)
    grammar = lark_grammar(forced_calls(fmt, [WEATHER, {"name": "noargs"}]), tok)
    calls = [ToolCall("get_weather", {"city": "Paris", "days": 3, "unit": "f", "zip": "75001",
                                      "tags": ["a", "b"], "note": "hi"}), ToolCall("noargs", {})]
    lead = fmt.text("hmm") + fmt.think_to_response if thinking else []
    reply = lead + fmt._close("response") + fmt.tools_channel(calls) + fmt._close("message") + [fmt.eom_id]
    c = GrammarConstraint(grammar, tok)
    for t in reply:
        assert t in c.allowed(), tok.decode([t])
        c.accept(t)
    assert c.done
    # a missing required argument, a wrong enum value, an undeclared key: refused
    for args in ({"city": "x", "days": 1}, {"city": "x", "days": 1, "unit": "k"},
                 {"city": "x", "days": 1, "unit": "c", "extra": 1}):
        c = GrammarConstraint(grammar, tok)
        bad = lead + fmt._close("response") + fmt.tools_channel([ToolCall("get_weather", args)])
        ok = True
        for t in bad:
            if t not in c.allowed():
                ok = False
                break
            c.accept(t)
        assert not ok, args


def test_json_reply_grammar_and_refusals(tok):
    fmt = chat_format_for(tok, thinking=False)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    c = GrammarConstraint(lark_grammar(json_reply(fmt, schema), tok), tok)
    for t in fmt.text('{"a":12}') + fmt.response_end + [fmt.eom_id]:
        assert t in c.allowed()
        c.accept(t)
    assert c.done
    with pytest.raises(UsageError, match=r"at /properties/a: 'oneOf' is outside the supported subset"):
        check_schema({"type": "object", "properties": {"a": {"oneOf": [{"type": "string"}]}}})
    with pytest.raises(UsageError, match="pattern"):
        check_schema({"type": "string", "pattern": "a("})
    with pytest.raises(UsageError, match="names no schema"):
        check_schema({"$ref": "#/$defs/x"})
    with pytest.raises(UsageError, match="one type"):
        forced_calls(fmt, [{"name": "f", "parameters": {"type": "object", "properties": {
            "a": {"anyOf": [{"type": "string"}, {"type": "integer"}]}}}}])
    with pytest.raises(UsageError, match="does not compile"):
        lark_grammar("start: /a(/", tok)
    with pytest.raises(UsageError, match="XTML"):
        forced_calls(chat_format_for(tok, "plain"), [WEATHER])
    assert Message("system", "x", kind="tool-declare").kind == "tool-declare"


def test_k3_chat_prints_the_calls_a_reply_makes(tok):
    """The chat's printer shows each call on a ``tool>`` line, after the answer's text."""
    import io

    from k3core.cli.chat import Printer
    from k3core.model.steps import Step
    from k3core.serve.service import TextSink

    fmt = chat_format_for(tok, thinking=False)
    sink = TextSink(tok, [], fmt, tools=ToolStream(fmt, None))
    out = io.StringIO()
    sink.on_piece = Printer(out)
    reply = (fmt.text("Checking.") + fmt._close("response")
             + fmt.tools_channel([ToolCall("get_weather", {"city": "Oslo"}), ToolCall("now", {})])
             + fmt._close("message") + [fmt.eom_id])
    for i, t in enumerate(reply):
        sink.on_step(Step(i, t, 0.0), "")
    sink.finish()
    assert out.getvalue() == 'k3> Checking.\ntool> get_weather {"city": "Oslo"}\ntool> now {}'
    assert [c.name for c in sink.calls] == ["get_weather", "now"] and sink.warnings == []
