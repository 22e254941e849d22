"""OpenAI's ``tools``, ``tool_choice``, ``parallel_tool_calls`` and ``response_format`` on chat completions:
checked into one :class:`Structured` per request, compiled to the grammar that constrains the output, and the
model's tool calls turned into OpenAI's ``tool_calls`` objects.

* ``tools``: a list of ``{"type": "function", "function": {"name", "description"?, "parameters"?,
  "strict"?}}``, handed to the chat template; ``tool_choice``: ``none`` (the default without tools: the
  output is content), ``auto`` (the default with tools: the output is read for calls in the configured
  format, :mod:`cluster.models.tool_calls`), ``required`` or ``{"type": "function", "function": {"name"}}``
  (the output is constrained to a call to one of the tools / that one, its arguments to the tool's
  ``parameters`` schema); ``parallel_tool_calls: false`` allows one call only.
* ``response_format``: ``text``, ``json_object`` (any JSON object) or ``json_schema`` (``{"name", "schema",
  "strict"}``: the output is JSON text matching the schema; strict: every keyword must be enforced).

Every bad value is a :class:`ParamError` naming its field (an unknown type, a schema the grammar engine
refuses, a ``tool_choice`` naming no tool).  The grammars are llguidance's (:mod:`cluster.models.grammar`),
compiled once per (tokenizer, grammar) and cached.
"""
from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any

from cluster.errors import ParamError
from cluster.models.grammar import JSON_OPTIONS, json_grammar, lark_grammar, special_token_term
from cluster.models.tool_calls import FORMATS, ToolFormat

MAX_TOOLS = 128
NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")        # OpenAI: letters, digits, underscores and dashes, <= 64
TOOLS = ('a list of at most %d {"type": "function", "function": {"name": 1-64 letters, digits, _ . : -, '
         '"description": a string, "parameters": a JSON schema object, "strict": a boolean}}' % MAX_TOOLS)
CHOICE = 'none, auto, required or {"type": "function", "function": {"name": a tool\'s name}}'
FORMAT = ('{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name": a '
          'string, "schema": a JSON schema object, "strict": a boolean}}')


@dataclass
class Structured:
    tools: list[dict] | None = None
    choice: str = "none"                 # none | auto | required | function
    function: str | None = None          # the named function of tool_choice
    parallel: bool = True
    response: tuple | None = None        # ("json_object", None, False) | ("json_schema", schema, strict)
    fmt: ToolFormat | None = None        # the configured tool-call format (set by compile)

    @property
    def reads_calls(self) -> bool:
        """Whether the output is read for tool calls."""
        return bool(self.tools) and self.choice != "none"

    def compile(self, tokenizer, parser: str):
        """The grammar the output is held to (None: free), for ``tokenizer``; ``parser``: the config's
        ``chat.tool_parser``."""
        self.fmt = FORMATS[parser]
        if self.choice in ("required", "function"):
            tools = [(t["function"]["name"], t["function"].get("parameters") or {"type": "object"})
                     for t in self.tools if self.choice == "required" or t["function"]["name"] == self.function]
            parallel = self.parallel and self.choice == "required"          # a named function: one call
            lark = self.fmt.lark(tools, parallel, special_token_term(tokenizer, self.fmt.marker),
                                 {**JSON_OPTIONS, "lenient": not all(t["function"].get("strict") for t in self.tools)})
            return lark_grammar(lark, tokenizer, "tools")
        if self.response is not None:
            kind, schema, strict = self.response
            if schema is not None:
                schema = {**schema, "x-guidance": {**schema.get("x-guidance", {}), "lenient": not strict}}
            return json_grammar(schema, tokenizer)
        return None


def structured(tools: Any, tool_choice: Any, parallel: Any, response_format: Any) -> Structured | None:
    """The checked fields (None: none of them asks for anything)."""
    tools = check_tools(tools)
    choice, function = check_tool_choice(tool_choice, tools)
    if parallel is not None and not isinstance(parallel, bool):
        raise ParamError("parallel_tool_calls", "true or false", parallel)
    response = check_response_format(response_format)
    if response is not None and choice in ("required", "function"):
        raise ParamError("response_format", "text or unset when tool_choice forces a tool call", response_format)
    if not tools and response is None:
        return None
    return Structured(tools, choice, function, parallel is not False, response)


def check_tools(tools: Any) -> list[dict] | None:
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ParamError("tools", TOOLS, tools)
    names = set()
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) else None
        if not (isinstance(fn, dict) and t.get("type") == "function" and set(t) <= {"type", "function"} and
                isinstance(fn.get("name"), str) and NAME.fullmatch(fn["name"]) and fn["name"] not in names and
                set(fn) <= {"name", "description", "parameters", "strict"} and
                isinstance(fn.get("description", ""), str) and isinstance(fn.get("parameters", {}), dict) and
                isinstance(fn.get("strict", False), bool)):
            raise ParamError("tools", TOOLS + " (names unique)", t)
        names.add(fn["name"])
    return tools


def check_tool_choice(choice: Any, tools: list[dict] | None) -> tuple[str, str | None]:
    if choice is None:
        return ("auto" if tools else "none"), None
    if choice in ("none", "auto", "required"):
        if choice == "required" and not tools:
            raise ParamError("tool_choice", "none or auto without tools", choice)
        return choice, None
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    known = [t["function"]["name"] for t in tools or []]
    if name not in known:
        raise ParamError("tool_choice", CHOICE + (" (tools: " + ", ".join(known) + ")" if known else
                                                  " (no tools given)"), choice)
    return "function", name


def check_response_format(value: Any) -> tuple | None:
    if value is None or value == {"type": "text"}:
        return None
    if value == {"type": "json_object"}:
        return ("json_object", None, False)
    spec = value.get("json_schema") if isinstance(value, dict) and value.get("type") == "json_schema" else None
    if not (isinstance(spec, dict) and set(value) == {"type", "json_schema"} and isinstance(spec.get("name"), str)
            and set(spec) <= {"name", "description", "schema", "strict"} and
            isinstance(spec.get("schema", {}), dict) and isinstance(spec.get("strict", False), (bool, type(None)))):
        raise ParamError("response_format", FORMAT, value)
    return ("json_schema", spec.get("schema", {}), bool(spec.get("strict")))


def tool_call_objects(calls: list[tuple[str, str]], streamed: bool = False) -> list[dict]:
    """OpenAI's ``tool_calls`` of ``calls`` = [(name, arguments JSON)]; a stream's delta adds ``index``."""
    return [{**({"index": i} if streamed else {}), "id": "call_" + uuid.uuid4().hex[:24], "type": "function",
             "function": {"name": name, "arguments": args}} for i, (name, args) in enumerate(calls)]
