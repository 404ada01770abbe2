"""The JSON Schema subset k3 constrains to, checked before anything is compiled.

OpenAI's strict structured outputs, and a little more: ``type`` (``object``, ``array``,
``string``, ``number``, ``integer``, ``boolean``, ``null``, or a list of them),
``properties``, ``required``, ``additionalProperties`` (``false``, or ``true``/absent for
any other keys), ``items``, ``prefixItems``, ``minItems``/``maxItems``, ``enum``,
``const``, ``anyOf``, strings' ``minLength``/``maxLength``/``pattern``/``format``
(:data:`FORMATS`), numbers' ``minimum``/``maximum``/``exclusiveMinimum``/
``exclusiveMaximum``, local ``$ref`` into ``$defs``/``definitions``, and the annotations
that change nothing (``title``, ``description``, ``default``, ``examples``, ``$schema``,
``$id``, ``$comment``, ``strict``). Anything else (``oneOf``, ``allOf``, ``not``,
``if``/``then``, ``patternProperties``, ``uniqueItems``, a remote ``$ref``...) is refused
with a :class:`~k3core.api.errors.UsageError` that names the keyword and where it is, so a
reply is never constrained to something other than what was asked.
"""

from __future__ import annotations

import math
import re
from typing import Any

from k3core.api.errors import UsageError
from k3core.api.safejson import json_kind

TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
FORMATS = ("date-time", "date", "time", "email", "uuid", "uri", "duration", "ipv4", "ipv6",
           "hostname")
ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment",
               "strict", "deprecated", "readOnly", "writeOnly"}
KEYWORDS = ANNOTATIONS | {
    "type", "properties", "required", "additionalProperties", "items", "prefixItems",
    "minItems", "maxItems", "enum", "const", "anyOf", "minLength", "maxLength", "pattern",
    "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "$ref", "$defs",
    "definitions",
}
#: schemas nested deeper than this are refused (a bound on the work a request can cause)
MAX_DEPTH = 32
#: the most subschemas one schema may hold
MAX_NODES = 2000


def check_schema(schema: Any, what: str = "the schema") -> None:
    """Refuse ``schema`` unless it is inside the supported subset (see the module)."""
    if not isinstance(schema, dict):
        raise UsageError(f"{what} must be a JSON object (a JSON Schema), got {json_kind(schema)}")
    _Checker(schema, what).node(schema, "", 0)


class _Checker:
    def __init__(self, root: dict[str, Any], what: str):
        self.root = root
        self.what = what
        self.nodes = 0

    def fail(self, path: str, msg: str) -> UsageError:
        where = f" at {path}" if path else ""
        return UsageError(f"{self.what}{where}: {msg}")

    def node(self, s: Any, path: str, depth: int) -> None:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise self.fail("", f"more than {MAX_NODES} subschemas")
        if depth > MAX_DEPTH:
            raise self.fail(path, f"nested deeper than {MAX_DEPTH} levels")
        if isinstance(s, bool):
            if s:
                return
            raise self.fail(path, "the schema false allows nothing")
        if not isinstance(s, dict):
            raise self.fail(path, f"a schema must be an object, got {json_kind(s)}")
        for key in s:
            if key not in KEYWORDS:
                raise self.fail(path, f"{key!r} is outside the supported subset (supported: "
                                      "type, properties, required, additionalProperties, items, "
                                      "enum, const, anyOf, string and number bounds, pattern, "
                                      "format, $ref into $defs)")
        self.types(s, path)
        props = s.get("properties")
        if props is not None:
            if not isinstance(props, dict):
                raise self.fail(path, "'properties' must be an object")
            for name, sub in props.items():
                self.node(sub, f"{path}/properties/{name}", depth + 1)
        req = s.get("required")
        if req is not None:
            if not isinstance(req, list) or not all(isinstance(r, str) for r in req):
                raise self.fail(path, "'required' must be a list of property names")
            missing = [r for r in req if r not in (props or {})]
            if missing and s.get("additionalProperties") is False:
                raise self.fail(path, f"required property {missing[0]!r} is not among the "
                                      "properties, and additionalProperties is false")
        extra = s.get("additionalProperties")
        if extra is not None and not isinstance(extra, bool):
            if not isinstance(extra, dict):
                raise self.fail(path, "'additionalProperties' must be a boolean or a schema")
            self.node(extra, f"{path}/additionalProperties", depth + 1)
        if "items" in s:
            self.node(s["items"], f"{path}/items", depth + 1)
        if "prefixItems" in s:
            if not isinstance(s["prefixItems"], list):
                raise self.fail(path, "'prefixItems' must be a list of schemas")
            for i, sub in enumerate(s["prefixItems"]):
                self.node(sub, f"{path}/prefixItems/{i}", depth + 1)
        if "anyOf" in s:
            if not isinstance(s["anyOf"], list) or not s["anyOf"]:
                raise self.fail(path, "'anyOf' must be a non-empty list of schemas")
            for i, sub in enumerate(s["anyOf"]):
                self.node(sub, f"{path}/anyOf/{i}", depth + 1)
        for defs in ("$defs", "definitions"):
            if defs in s:
                if not isinstance(s[defs], dict):
                    raise self.fail(path, f"{defs!r} must be an object of schemas")
                for name, sub in s[defs].items():
                    self.node(sub, f"{path}/{defs}/{name}", depth + 1)
        if "$ref" in s:
            self.ref(s["$ref"], path)
        if "enum" in s and (not isinstance(s["enum"], list) or not s["enum"]):
            raise self.fail(path, "'enum' must be a non-empty list")
        for key in ("minLength", "maxLength", "minItems", "maxItems"):
            if key in s and (not isinstance(s[key], int) or isinstance(s[key], bool) or s[key] < 0):
                raise self.fail(path, f"{key!r} must be a non-negative integer")
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            v = s.get(key)
            if key in s and (isinstance(v, bool) or not isinstance(v, (int, float))
                             or not math.isfinite(v)):
                raise self.fail(path, f"{key!r} must be a number")
        if "pattern" in s:
            if not isinstance(s["pattern"], str):
                raise self.fail(path, "'pattern' must be a string")
            try:
                re.compile(s["pattern"])
            except re.error as e:
                raise self.fail(path, f"the pattern {s['pattern']!r} does not compile: {e}") from None
        if "format" in s and s["format"] not in FORMATS:
            raise self.fail(path, f"format {s['format']!r} is not supported (supported: "
                                  f"{', '.join(FORMATS)})")

    def types(self, s: dict[str, Any], path: str) -> None:
        t = s.get("type")
        if t is None:
            return
        names = t if isinstance(t, list) else [t]
        if not names or not all(isinstance(n, str) for n in names):
            raise self.fail(path, "'type' must be a type name or a list of them")
        bad = [n for n in names if n not in TYPES]
        if bad:
            raise self.fail(path, f"unknown type {bad[0]!r} (types: {', '.join(TYPES)})")

    def ref(self, ref: Any, path: str) -> None:
        if not isinstance(ref, str) or not re.fullmatch(r"#(/(\$defs|definitions)/[^/]+)?", ref):
            raise self.fail(path, f"$ref {ref!r} is not supported: only local references "
                                  "'#/$defs/NAME', '#/definitions/NAME' or '#'")
        if ref == "#":
            return
        _, defs, name = ref.split("/", 2)
        target = self.root.get(defs)
        if not isinstance(target, dict) or name not in target:
            raise self.fail(path, f"$ref {ref!r} names no schema")
