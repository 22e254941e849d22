"""Grammars for constrained decoding on llguidance (the Rust grammar engine of Guidance, vLLM's ``guidance``
structured-output backend), behind the core's :class:`cluster.core.constraint.Grammar` / ``Constraint``.

Chosen over xgrammar and outlines-core (measured per step and per schema by ``specserve bench
--suite grammar``): no dependencies (xgrammar pulls triton; outlines-core cannot express recursive schemas), a new
schema costs about a millisecond (its token masks are computed lazily, where xgrammar compiles ~1 s per
schema at an 85k vocabulary: every agent request brings its own tool schemas), a mask costs tens of
microseconds per step, and rollback and Lark grammars with embedded JSON schemas (``%json``: a tool call's
wrapper text around its arguments) are built in.

* :func:`compile_grammar` checks a grammar once (a :class:`ParamError` naming the request field for an
  invalid one) and returns an :class:`LLGrammar`: the grammar's text and the tokenizer's key, picklable, so
  it travels to the draft actor inside the request's :class:`SamplingParams` (:mod:`cluster.core.sampling`)
  and every process rebuilds its own state from it.  Compiled matchers are cached per process, per
  (tokenizer, grammar), at most ``MAX_CACHED`` of them (least recently used dropped); each request starts
  from a ``deep_copy`` of its grammar's.
* :class:`LLConstraint` is one request's state: asked about a token sequence, it rolls back to the common
  prefix of what it has consumed and consumes the rest (a rejected draft rolls back; accepted tokens
  advance), keeping the packed masks of the last ``WINDOW`` positions.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
import torch

from cluster.errors import ParamError
from cluster.models.tokenizer import ByteTokenizer

MAX_CACHED = 64          # compiled grammars kept per process
WINDOW = 256             # positions whose masks a request keeps (drafts are verified near the frontier)
# JSON as json.dumps writes it (what models read most), and no free whitespace: a grammar that allowed any
# whitespace would let a model pad forever
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_lock = threading.Lock()
_tokenizers: dict[tuple, Any] = {}
_compiled: OrderedDict[tuple, Any] = OrderedDict()


class _ByteVocab:
    """The byte tokenizer as llguidance's TokenizerWrapper reads one: 256 byte tokens and end of text."""

    eos_token_id, bos_token_id = ByteTokenizer.eos_token_id, None
    tokens = [bytes([i]) for i in range(256)] + [b"<|endoftext|>"]
    special_token_ids = [ByteTokenizer.eos_token_id]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def tokenizer_key(tokenizer) -> tuple:
    """How another process finds the same tokenizer: the byte tokenizer, or a checkpoint directory."""
    if isinstance(tokenizer, ByteTokenizer):
        return ("bytes", ByteTokenizer.vocab_size)
    key = ("hf", str(tokenizer.path))
    with _lock:
        if key not in _tokenizers:                       # already loaded here: no second load
            _tokenizers[key] = llguidance.hf.from_tokenizer(tokenizer.tok)
    return key


def _lltokenizer(key: tuple):
    with _lock:
        if key not in _tokenizers:
            if key[0] == "bytes":
                _tokenizers[key] = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocab()))
            else:
                from transformers import AutoTokenizer
                _tokenizers[key] = llguidance.hf.from_tokenizer(
                    AutoTokenizer.from_pretrained(key[1], local_files_only=True))
        return _tokenizers[key]


def _matcher(key: tuple, source: str):
    """A fresh matcher of ``source`` (from the per-process cache of compiled grammars)."""
    with _lock:
        template = _compiled.get((key, source))
        if template is not None:
            _compiled.move_to_end((key, source))
            return template.deep_copy()
    template = llguidance.LLMatcher(_lltokenizer(key), source, log_level=0)
    with _lock:
        _compiled[(key, source)] = template
        while len(_compiled) > MAX_CACHED:
            _compiled.popitem(last=False)
    return template.deep_copy()


class LLGrammar:
    """A checked grammar (:class:`cluster.core.constraint.Grammar`); pickles as its text and tokenizer key."""

    def __init__(self, source: str, key: tuple, field: str, eos: int | None):
        self.source, self.key, self.field, self.eos = source, key, field, eos

    def start(self, prompt_length: int) -> "LLConstraint":
        return LLConstraint(self, prompt_length)


class LLConstraint:
    """One request's grammar state (:class:`cluster.core.constraint.Constraint`); see the module docstring.
    Pickled, it carries only its grammar and start: each process moves its own matcher."""

    def __init__(self, grammar: LLGrammar, start: int):
        self.grammar, self.start = grammar, start
        self._m = None
        self._path: list[int] = []                 # generated tokens consumed, all allowed
        self._masks: dict[int, bytes] = {}         # position -> packed mask after path[:position]

    def __reduce__(self):
        return LLConstraint, (self.grammar, self.start)

    def allowed(self, tokens) -> torch.Tensor:
        if self._m is None:
            self._m = _matcher(self.grammar.key, self.grammar.source)
        gen = list(tokens[self.start:])
        self._move(gen)
        if len(self._path) < len(gen):                      # a forbidden token (or one after end of text)
            return self._end_only()
        return self._unpack(self._packed(len(gen)))

    def _move(self, gen: list[int]) -> None:
        path, c = self._path, 0
        n = min(len(path), len(gen))
        if gen[:n] == path[:n]:                             # the usual case, compared at C speed
            c = n
        while c < n and path[c] == gen[c]:
            c += 1
        if c < len(path):
            self._m.rollback(len(path) - c)
            del path[c:]
            for pos in [p for p in self._masks if p > c]:
                del self._masks[pos]
        for tok in gen[c:]:
            packed = self._packed(len(path))
            if tok == self.grammar.eos or not (0 <= tok < 8 * len(packed) and packed[tok >> 3] >> (tok & 7) & 1):
                return
            self._m.consume_token(tok)
            path.append(tok)
        for pos in [p for p in self._masks if p < len(path) - WINDOW]:
            del self._masks[pos]

    def _packed(self, pos: int) -> bytes:
        if pos not in self._masks:
            self._masks[pos] = self._m.compute_bitmask()
        return self._masks[pos]

    def _unpack(self, packed: bytes) -> torch.Tensor:
        bits = np.unpackbits(np.frombuffer(packed, dtype=np.uint8), bitorder="little").astype(bool)
        if self.grammar.eos is not None and not bits.any():        # a matcher in error: end the text
            return self._end_only()
        return torch.from_numpy(bits)

    def _end_only(self) -> torch.Tensor:
        if self.grammar.eos is None:                               # nothing ends the text: leave it free
            return torch.ones(8 * len(self._packed(0)), dtype=torch.bool)
        out = torch.zeros(8 * len(self._packed(0)), dtype=torch.bool)
        out[self.grammar.eos] = True
        return out


def compile_grammar(source: str, tokenizer, field: str) -> LLGrammar:
    """Check ``source`` (llguidance's grammar text) against ``tokenizer`` once; refusals name ``field``."""
    key = tokenizer_key(tokenizer)
    error = llguidance.LLMatcher.validate_grammar(source, _lltokenizer(key))
    if error and not error.startswith("WARNING"):
        raise ParamError(field, "a schema / grammar the grammar engine accepts", error.strip()[:300])
    _matcher(key, source)                                  # compiled and cached here
    return LLGrammar(source, key, field, tokenizer.eos_token_id)


def json_grammar(schema: dict | None, tokenizer, field: str = "response_format") -> LLGrammar:
    """JSON text matching ``schema`` (None: any JSON object, OpenAI's ``json_object``)."""
    schema = {"type": "object"} if schema is None else schema
    try:
        source = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_OPTIONS)
    except ValueError as e:
        raise ParamError(field, "a JSON schema object", str(e)[:300]) from None
    return compile_grammar(source, tokenizer, field)


def lark_grammar(lark: str, tokenizer, field: str) -> LLGrammar:
    """A Lark grammar (llguidance's dialect: ``%json {schema}`` embeds a JSON schema)."""
    return compile_grammar(llguidance.LLMatcher.grammar_from_lark(lark), tokenizer, field)


def special_token_term(tokenizer, text: str) -> str:
    """The Lark term for ``text``: the special token it is in ``tokenizer`` (``<[id]>``; e.g. Mistral's
    ``[TOOL_CALLS]``), else the literal text."""
    hf = getattr(tokenizer, "tok", None)
    if hf is not None:
        ids = hf.convert_tokens_to_ids([text])
        if ids and ids[0] is not None and ids[0] != hf.unk_token_id and ids[0] in set(hf.all_special_ids):
            return f"<[{ids[0]}]>"
    return json.dumps(text)
