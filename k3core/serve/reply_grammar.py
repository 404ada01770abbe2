"""The grammars a chat reply is constrained to: JSON in the response channel, or a forced call.

Each is a Lark grammar (llguidance's dialect, :mod:`k3core.constrain.grammar`) over the
whole reply after the generation prompt. With XTML the control tokens are named by id, so
the grammar is the transcript's own structure:

* thinking on, the think channel is free text (no control token) up to
  ``<|close|>think<|sep|>``, then the response channel opens; thinking off, the generation
  prompt has opened the response channel already;
* ``response_format`` ``json_object``/``json_schema``: the response channel holds one JSON
  value of the schema, then ``<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>``;
* a forced tool call (``tool_choice`` ``required`` or a named function): the response
  channel is empty, then a tools channel of one call (up to :data:`MAX_CALLS`, numbered,
  with ``parallel_tool_calls``) of a declared tool (the named one), each argument a
  property of the tool's parameters in the schema's order, every required one present,
  nothing undeclared; a string argument is raw text (its ``enum``, ``pattern`` or length
  bounds kept), any other a JSON value of its schema; then the message closes and ends.

With the plain format a JSON reply is just the JSON value (the session stops when it is
complete). A tool parameter schema the grammar cannot force (an argument with no single
type, a ``format`` or a ``pattern`` with length bounds on a string argument) is refused with
a :class:`~k3core.api.errors.UsageError` naming the tool and the property.
"""

from __future__ import annotations

from typing import Any

from k3core.api.errors import UsageError
from k3core.constrain.grammar import SPACED_JSON, json_value, literal, special
from k3core.constrain.schema import check_schema
from k3core.serve.chat_format import ChatFormat, XtmlFormat

#: the most calls a forced reply may make (with ``parallel_tool_calls``)
MAX_CALLS = 8
_JSON_TYPES = {"number": "number", "integer": "number", "boolean": "boolean", "null": "null",
               "object": "object", "array": "array"}


def json_reply(fmt: ChatFormat, schema: dict[str, Any]) -> str:
    """The Lark grammar of a reply that is one JSON value of ``schema``."""
    value = json_value(schema)
    if not isinstance(fmt, XtmlFormat):
        return f"start: {value}\n"
    c, s, e = special(fmt.close_id), special(fmt.sep_id), special(fmt.eom_id)
    return (f"start: {_lead(fmt)} body {c} \"response\" {s} {c} \"message\" {s} {e}\n"
            f"body: {value}\n" + _think_rules(fmt))


def forced_calls(fmt: ChatFormat, tools: list[dict[str, Any]], name: str | None = None,
                 parallel: bool = True) -> str:
    """The Lark grammar of a reply that is tool calls only: ``name``'s, or any declared tool's."""
    if not isinstance(fmt, XtmlFormat):
        raise UsageError("tool calls need the XTML chat format (this server uses plain)")
    o, c, s, e = (special(fmt.open_id), special(fmt.close_id), special(fmt.sep_id),
                  special(fmt.eom_id))
    chosen = [t for t in tools if name is None or t["name"] == name]
    rules: list[str] = []
    for n in range(1, (MAX_CALLS if parallel else 1) + 1):
        alts = " | ".join(f"t{k}_{n}" for k in range(len(chosen)))
        rules.append(f"call{n}: {alts}")
        for k, tool in enumerate(chosen):
            opener = f'call tool="{_attr(tool["name"])}" index="{n}"'
            rules.append(f"t{k}_{n}: {o} {literal(opener)} {s} args{k} {c} \"call\" {s}")
    for k, tool in enumerate(chosen):
        rules += _args(k, tool, fmt)
    head = (f"start: {_lead(fmt)} {c} \"response\" {s} {o} \"tools\" {s} calls1 "
            f"{c} \"tools\" {s} {c} \"message\" {s} {e}\n")
    return head + "\n".join(rules) + "\n" + _chain_rules(MAX_CALLS if parallel else 1) + _think_rules(fmt)


def _chain_rules(n: int) -> str:
    """``calls1: call1 calls2?`` ... ``callsN: callN``: calls numbered 1, 2, ... in order."""
    out = []
    for k in range(1, n + 1):
        out.append(f"calls{k}: call{k}" + (f" calls{k + 1}?" if k < n else ""))
    return "\n".join(out) + "\n"


def _lead(fmt: XtmlFormat) -> str:
    """What comes before the response channel's text: the think channel with thinking on."""
    return "think" if fmt.thinking else ""


def _think_rules(fmt: ChatFormat) -> str:
    if not isinstance(fmt, XtmlFormat) or not fmt.thinking:
        return ""
    c, s, o = special(fmt.close_id), special(fmt.sep_id), special(fmt.open_id)
    return (f"think: THINK? {c} \"think\" {s} {o} \"response\" {s}\n"
            "THINK: /(?s:.)+/\n")


def _attr(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


def _args(k: int, tool: dict[str, Any], fmt: XtmlFormat) -> list[str]:
    """``argsK``: tool K's arguments, one element per property in the schema's order."""
    o, c, s = special(fmt.open_id), special(fmt.close_id), special(fmt.sep_id)
    params = tool.get("parameters") or {"type": "object", "properties": {}}
    where = f"tool {tool['name']!r}"
    check_schema(params, f"the parameters of {where}")
    if params.get("type") != "object":
        raise UsageError(f"the parameters of {where} must be a schema of type object to force a call")
    props: dict[str, Any] = params.get("properties") or {}
    required = set(params.get("required") or [])
    defs = {key: params[key] for key in ("$defs", "definitions") if key in params}
    parts: list[str] = []
    rules: list[str] = []
    for j, (key, sub) in enumerate(props.items()):
        kind, value = _value(sub, defs, f"{where}, property {key!r}", f"v{k}_{j}", rules)
        head = f'argument key="{_attr(key)}" type="{kind}"'
        rules.append(f"a{k}_{j}: {o} {literal(head)} {s} {value} {c} \"argument\" {s}")
        parts.append(f"a{k}_{j}" + ("" if key in required else "?"))
    return [f"args{k}: " + (" ".join(parts) if parts else '""'), *rules]


def _value(sub: Any, defs: dict[str, Any], where: str, rule: str, rules: list[str]) -> tuple[str, str]:
    """(the ``type`` attribute, the value's rule body) of one argument."""
    if not isinstance(sub, dict):
        raise UsageError(f"{where}: its schema must be an object to force a call")
    if "$ref" in sub:
        ref = sub["$ref"]
        target = defs.get(ref.split("/")[1], {}).get(ref.split("/")[-1]) if ref.count("/") == 2 else None
        if not isinstance(target, dict):
            raise UsageError(f"{where}: $ref {ref!r} names no schema")
        sub = target
    t = sub.get("type")
    enum = sub.get("enum", [sub["const"]] if "const" in sub else None)
    if t is None and enum is not None and all(isinstance(v, str) for v in enum):
        t = "string"
    if not isinstance(t, str):
        raise UsageError(f"{where}: an argument needs one type to be forced (got {t!r})")
    if t == "string":
        if "format" in sub:
            raise UsageError(f"{where}: a string argument's format cannot be forced "
                             "(a tool argument is raw text); use a pattern")
        if enum is not None:
            return "string", "(" + " | ".join(literal(str(v)) for v in enum) + ")"
        lo, hi = sub.get("minLength", 0), sub.get("maxLength")
        if "pattern" in sub:
            if "minLength" in sub or "maxLength" in sub:
                raise UsageError(f"{where}: a string argument with both a pattern and length "
                                 "bounds cannot be forced; give one of them")
            pattern = sub["pattern"]
            body = pattern[1:] if pattern.startswith("^") else "(?s:.)*" + pattern
            body = body[:-1] if body.endswith("$") and not body.endswith("\\$") else body + "(?s:.)*"
            regex = body
        else:
            if hi == 0:
                return "string", '""'
            regex = f"(?s:.){{{max(lo, 1)},{'' if hi is None else hi}}}"
        name = rule.upper()
        rules.append(f"{name}: /{regex.replace('/', chr(92) + '/')}/")
        return "string", f"{name}?" if lo == 0 and "pattern" not in sub else name
    if t not in _JSON_TYPES:
        raise UsageError(f"{where}: unknown type {t!r}")
    return _JSON_TYPES[t], json_value({**sub, **defs}, SPACED_JSON)

