"""Tool-call formats (cluster/models/tool_calls.py): parsing whole and streamed outputs as vLLM's parsers
read them, and, for each format, the grammar that forces a call: every output it admits parses back into
calls whose arguments validate against the tool's schema (random walks over the byte vocabulary)."""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch

from cluster.models.grammar import JSON_OPTIONS, lark_grammar, special_token_term
from cluster.models.tool_calls import FORMATS, ToolStream
from cluster.models.tokenizer import ByteTokenizer

HERMES, LLAMA, MISTRAL = FORMATS["hermes"], FORMATS["llama3_json"], FORMATS["mistral"]


@pytest.mark.parametrize("fmt,text,content,calls", [
    (HERMES, 'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
             '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>', "Let me check.",
     [("f", '{"a": 1}'), ("g", "{}")]),
    (HERMES, '<tool_call>\n{"name": "f", "arguments": {"a": "é"}}', None, [("f", '{"a": "é"}')]),   # unclosed
    (HERMES, '<tool_call>\n{"name": "f", "argu', '<tool_call>\n{"name": "f", "argu', []),           # not JSON
    (HERMES, "just text", "just text", []),
    (LLAMA, '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "arguments": {"b": [2]}}', None,
     [("f", '{"a": 1}'), ("g", '{"b": [2]}')]),
    (LLAMA, 'The answer is {"name": "f"}', 'The answer is {"name": "f"}', []),                       # not at start
    (MISTRAL, '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]', None, [("f", '{"a": 1}')]),
    (MISTRAL, ' [{"name": "f", "arguments": {}}]', None, [("f", "{}")]),     # the special token detokenised away
])
def test_parse(fmt, text, content, calls):
    assert fmt.parse(text) == (content, calls)


@pytest.mark.parametrize("fmt,text,streamed", [
    (HERMES, 'Sure. <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', "Sure. "),
    (HERMES, "a < b and <tool", "a < b and <tool"),              # held back while it may open a call; released
    (LLAMA, '  {"name": "f", "parameters": {"x": 1}}', ""),
    (LLAMA, "no call here", "no call here"),
    (MISTRAL, '[TOOL_CALLS][{"name": "f", "arguments": {}}]', ""),
])
def test_stream_holds_back_calls_and_streams_content(fmt, text, streamed):
    stream, sent = ToolStream(fmt), ""
    for ch in text:                                            # one character per chunk
        sent += stream.feed(ch)
    rest, calls = stream.finish()
    content, want = fmt.parse(text)
    assert calls == want
    assert sent + rest == (streamed if calls else text)
    if calls:
        assert sent == streamed and rest == ""


SCHEMAS = {"weather": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                        "days": {"type": "integer", "minimum": 1, "maximum": 9}},
                       "required": ["city", "days"], "additionalProperties": False},
           "time": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
                    "additionalProperties": False}}


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("parallel", [False, True])
def test_forcing_grammar_admits_only_parseable_valid_calls(name, parallel):
    fmt, tok = FORMATS[name], ByteTokenizer()
    lark = fmt.lark(list(SCHEMAS.items()), parallel, special_token_term(tok, fmt.marker), JSON_OPTIONS)
    grammar = lark_grammar(lark, tok, "tools")
    rng = np.random.default_rng(0)
    for walk in range(12):
        c, seq = grammar.start(0), []
        while len(seq) < 5000:
            allowed = torch.nonzero(c.allowed(seq)).flatten().tolist()
            # prefer ending where allowed half of the time, else any allowed token
            tok_id = tok.eos_token_id if tok.eos_token_id in allowed and rng.random() < 0.5 else int(rng.choice(allowed))
            if tok_id == tok.eos_token_id:
                break
            seq.append(tok_id)
        text = tok.decode(seq)
        content, calls = fmt.parse(text)
        assert calls and content is None, text
        assert parallel or len(calls) == 1
        for fn, args in calls:
            jsonschema.validate(json.loads(args), SCHEMAS[fn])
