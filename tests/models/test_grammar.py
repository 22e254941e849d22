"""The llguidance grammar engine behind cluster/core/constraint.py (cluster/models/grammar.py): a request's
state moves to any sequence (advance, roll back, forbidden tokens end the text), survives pickling (the draft
actor rebuilds it), grammars are compiled once and the cache is bounded, and bad schemas name their field."""
from __future__ import annotations

import pickle

import pytest
import torch

from cluster.errors import ParamError
from cluster.models import grammar as g
from cluster.models.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


def _ids(text: str) -> list[int]:
    return list(text.encode())


def _allowed(c, seq) -> list[int]:
    return torch.nonzero(c.allowed(seq)).flatten().tolist()


def test_state_advances_rolls_back_and_ends_on_a_forbidden_token():
    prompt = [7, 7, 7]
    grammar = g.json_grammar(SCHEMA, TOK)
    c, fresh = grammar.start(3), lambda seq: _allowed(grammar.start(3), seq)
    assert _allowed(c, prompt) == [ord("{")]
    head = prompt + _ids('{"ok": ')
    assert _allowed(c, head) == [ord("f"), ord("t")]
    assert _allowed(c, head + _ids("tr")) == [ord("u")]
    assert _allowed(c, head + _ids("fa")) == fresh(head + _ids("fa")) == [ord("l")]     # rolled back
    assert _allowed(c, head + _ids("true}")) == [TOK.eos_token_id]                          # complete: end only
    assert _allowed(c, head + _ids("x")) == [TOK.eos_token_id]                              # forbidden: end only
    assert _allowed(c, prompt) == [ord("{")]                                                # all the way back
    clone = pickle.loads(pickle.dumps(c))
    assert clone._m is None and _allowed(clone, head + _ids("tr")) == [ord("u")]


def test_grammars_compile_once_and_the_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(g, "MAX_CACHED", 4)
    made = []
    real = g.llguidance.LLMatcher
    monkeypatch.setattr(g.llguidance, "LLMatcher", type("Counting", (), {
        "__new__": lambda cls, *a, **k: made.append(a[1]) or real(*a, **k),
        "validate_grammar": staticmethod(real.validate_grammar),
        "grammar_from_json_schema": staticmethod(real.grammar_from_json_schema)}))
    first = g.json_grammar({"type": "object", "properties": {"n0": {"type": "integer"}}}, TOK)
    g.json_grammar({"type": "object", "properties": {"n0": {"type": "integer"}}}, TOK)
    first.start(0).allowed([])
    assert len(made) == 1                              # one compile for the schema, however many requests
    for i in range(1, 8):
        g.json_grammar({"type": "object", "properties": {f"n{i}": {"type": "integer"}}}, TOK)
    assert len(g._compiled) <= 4 and len(made) == 8


@pytest.mark.parametrize("schema", [{"type": "bogus"}, {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}])
def test_invalid_schemas_name_their_field(schema):
    with pytest.raises(ParamError) as e:
        g.json_grammar(schema, TOK, field="response_format")
    assert e.value.name == "response_format"
