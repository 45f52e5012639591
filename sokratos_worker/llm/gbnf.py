"""A small JSON-Schema → GBNF translator for llama.cpp's ``grammar`` field.

It covers what pydantic models produce for replies (objects, arrays, strings, numbers,
booleans, enums, nullable fields, ``$ref``); anything else falls back to "any JSON value",
which is safe because every reply is validated afterwards anyway.
"""

from __future__ import annotations

import json
import re
from typing import Any

_BASE_RULES = r"""
ws ::= [ \t\n]{0,20}
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" ["\\/bfnrt] | "\\u" [0-9a-fA-F]{4} )* "\"" ws
integer ::= "-"? ([0-9] | [1-9] [0-9]{0,15}) ws
number ::= "-"? ([0-9] | [1-9] [0-9]{0,15}) ("." [0-9]{1,16})? ([eE] [-+]? [0-9]{1,3})? ws
boolean ::= ("true" | "false") ws
null ::= "null" ws
value ::= object | array | string | number | boolean | null
object ::= "{" ws ( string ":" ws value ( "," ws string ":" ws value )* )? "}" ws
array ::= "[" ws ( value ( "," ws value )* )? "]" ws
""".strip()

_PRIMITIVES = {"string", "integer", "number", "boolean", "null"}
_RESERVED = {"root", "ws", "value", "object", "array", *_PRIMITIVES}  # the rules above


class _Builder:
    def __init__(self, schema: dict[str, Any]) -> None:
        self.defs: dict[str, Any] = schema.get("$defs", {})
        self.rules: dict[str, str] = {}
        self.ref_rules: dict[str, str] = {}  # $defs name -> its rule

    def rule_for(self, schema: dict[str, Any], name: str) -> str:
        """The name of a rule matching ``schema``, defining it (and its parts) if needed."""
        if "$ref" in schema:
            ref = schema["$ref"].rsplit("/", 1)[-1]
            if ref not in self.ref_rules:
                # Reserved first: recursive models refer to themselves.
                rule = self.ref_rules[ref] = self._new_rule("def-" + ref)
                self.rules[rule] = self.body_for(self.defs.get(ref, {}), rule)
            return self.ref_rules[ref]
        body = self.body_for(schema, name)
        if body in _PRIMITIVES or body == "value":
            return body
        rule = self._new_rule(name)
        self.rules[rule] = body
        return rule

    def _new_rule(self, name: str) -> str:
        """A rule name for ``name`` that no other rule has (``a_b`` and ``a__b`` both read
        ``a-b``: one rule would have replaced the other), reserved."""
        base = rule = _rule_name(name)
        n = 2
        while rule in self.rules or rule in _RESERVED:
            rule, n = f"{base}-{n}", n + 1
        self.rules[rule] = ""
        return rule

    def body_for(self, schema: dict[str, Any], name: str) -> str:
        if "$ref" in schema:
            return self.rule_for(schema, name)
        if "const" in schema:
            return _literal(schema["const"])
        if "enum" in schema:
            return " | ".join(_literal(v) for v in schema["enum"])
        for key in ("anyOf", "oneOf"):
            if key in schema:
                options = [self.rule_for(s, f"{name}-{i}") for i, s in enumerate(schema[key])]
                return " | ".join(options)
        kind = schema.get("type")
        if isinstance(kind, list):
            return " | ".join(self.rule_for({**schema, "type": k}, f"{name}-{k}") for k in kind)
        if kind == "object" and "properties" in schema:
            return self._object(schema, name)
        if kind == "array":
            item = self.rule_for(schema.get("items", {}), f"{name}-item")
            return f'"[" ws ( {item} ( "," ws {item} )* )? "]" ws'
        if kind in _PRIMITIVES:
            return str(kind)
        return "value"

    def _object(self, schema: dict[str, Any], name: str) -> str:
        # Every property is emitted, in schema order: simple, and a superset of what validates.
        parts = []
        for key, sub in schema["properties"].items():
            value_rule = self.rule_for(sub, f"{name}-{key}")
            parts.append(f'{_literal(key)} ":" ws {value_rule}')
        if not parts:
            return '"{" ws "}" ws'
        return '"{" ws ' + ' "," ws '.join(parts) + ' "}" ws'


def _literal(value: Any) -> str:
    """A GBNF string literal matching ``value``'s JSON text, followed by whitespace."""
    text = json.dumps(value)
    return json.dumps(text) + " ws"


def _rule_name(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9-]+", "-", name).strip("-").lower() or "r"


def schema_to_gbnf(schema: dict[str, Any]) -> str:
    """A GBNF grammar whose ``root`` matches JSON documents of ``schema``."""
    builder = _Builder(schema)
    root = builder.body_for(schema, "root")
    lines = [f"root ::= {root}"]
    lines += [f"{name} ::= {body}" for name, body in builder.rules.items()]
    return "\n".join(lines) + "\n" + _BASE_RULES + "\n"


__all__ = ["schema_to_gbnf"]
