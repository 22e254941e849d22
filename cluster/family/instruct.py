"""Instruction pairs for the family's chat phase, taken from the standard library itself.

A function whose docstring (or, lacking one, the comment block right above its ``def``) says what it does
is a request and its answer: the docstring's first paragraph is the user's message, the function without
its docstring (decorators dropped, dedented) is the assistant's.  Each pair is rendered the way a served
chat request is (the family's template, :data:`cluster.models.chat_template.CODE_CHAT_TEMPLATE`, with the
assistant's turn opened), followed by the answer and ``<|endoftext|>``, so the model learns to answer a
served chat prompt with code and to stop.

Held-out files never give a training pair: :func:`train_pairs` drops every file of the held-out split
(:func:`cluster.family.corpus.is_heldout`), whatever list it is handed; the evaluation's requests come
from :func:`heldout_pairs`.
"""
from __future__ import annotations

import ast
import inspect
import random
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import torch

import cluster.family.corpus as corpus
from cluster.models.chat_template import CODE_CHAT_TEMPLATE

#: a request's length in characters (first paragraph of the docstring or comment), inclusive bounds
REQUEST_CHARS = (12, 200)
#: an answer's length: characters and lines (def line included), inclusive upper bounds
ANSWER_CHARS = 600
ANSWER_LINES = 16


@dataclass(frozen=True)
class Pair:
    """One instruction pair: the user's ``request``, the assistant's ``answer`` (code that parses) and where
    it comes from (``<stdlib-relative path>:<line>``)."""

    request: str
    answer: str
    source: str


def _first_paragraph(text: str) -> str:
    para = inspect.cleandoc(text).strip().split("\n\n")[0]
    return " ".join(line.strip() for line in para.splitlines()).strip()


def _leading_comment(lines: list[str], node: ast.AST) -> str:
    """The comment block directly above ``node``'s first decorator or ``def`` line (joined), or ''."""
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1   # 0-based index of that line
    out = []
    for line in reversed(lines[:first]):
        s = line.strip()
        if not s.startswith("#") or s.startswith("#!"):
            break
        out.append(s.lstrip("#").strip())
    return " ".join(reversed([s for s in out if s])).strip()


def _request(node: ast.AST, lines: list[str]) -> str:
    doc = ast.get_docstring(node, clean=False)
    text = _first_paragraph(doc) if doc else _leading_comment(lines, node)
    lo, hi = REQUEST_CHARS
    if not lo <= len(text) <= hi or len(text.split()) < 3 or ">>>" in text:
        return ""
    return text


def _answer(node: ast.AST, lines: list[str]) -> str:
    """The function's source without decorators and docstring, dedented; '' if it does not stand alone."""
    body = node.body
    keep = range(node.lineno - 1, node.end_lineno)
    if ast.get_docstring(node, clean=False) is not None:
        doc = body[0]
        if len(body) == 1 or doc.lineno == node.lineno or doc.end_lineno >= body[1].lineno:
            return ""                                       # nothing but a docstring, or one sharing a line
        keep = [i for i in keep if not doc.lineno - 1 <= i < doc.end_lineno]
    text = textwrap.dedent("".join(lines[i] for i in keep)).rstrip() + "\n"
    if len(text) > ANSWER_CHARS or text.count("\n") > ANSWER_LINES or text.count("\n") < 2:
        return ""
    try:
        ast.parse(text)
    except SyntaxError:                                     # e.g. a string literal's lines at column 0
        return ""
    return text


def function_sources(text: str) -> list[tuple[str, str, int]]:
    """``(code, request, line)`` of every function of Python source ``text`` whose code stands alone as an
    answer (:func:`_answer`), in source order; ``request`` is its docstring's or leading comment's first
    paragraph, or '' where there is none fit to be a request."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            answer = _answer(node, lines)
            if answer:
                out.append((answer, _request(node, lines), node.lineno))
    return sorted(out, key=lambda f: f[2])


def pairs_from_source(text: str, source: str = "") -> list[Pair]:
    """Every (request, answer) pair of the functions in Python source ``text``, in source order."""
    return [Pair(request, answer, f"{source}:{line}") for answer, request, line in function_sources(text) if request]


def split_sources(files: Iterable[Path], root: Path | None, held: bool,
                  max_chars: int | None = None) -> Iterator[tuple[str, str]]:
    """``(text, stdlib-relative path)`` of the files among ``files`` on one side of the split (held-out or
    training), read until ``max_chars`` characters if given."""
    chars = 0
    for f in files:
        if max_chars is not None and chars >= max_chars:
            break
        if corpus.is_heldout(f, root=root) == held:
            text = corpus.read_file(f)
            chars += len(text)
            yield text, corpus._rel_key(f, root)


def _pairs(files: Iterable[Path], root: Path | None, held: bool, max_chars: int | None = None) -> list[Pair]:
    return [p for text, key in split_sources(files, root, held, max_chars) for p in pairs_from_source(text, key)]


def train_pairs(files: Iterable[Path], root: Path | None = None, max_chars: int | None = None) -> list[Pair]:
    """Pairs of the training files among ``files`` (read until ``max_chars`` characters, if given): a
    held-out file gives none, even when listed."""
    return _pairs(files, root, held=False, max_chars=max_chars)


def heldout_pairs(files: Iterable[Path], n: int, seed: int = 0, root: Path | None = None) -> list[Pair]:
    """``n`` pairs (or all there are) drawn with ``random.Random(seed)`` from the held-out files of ``files``;
    the evaluation's requests."""
    pairs = _pairs(files, root, held=True)
    return random.Random(seed).sample(pairs, min(n, len(pairs)))


def chat_prompt(request: str) -> str:
    """``request`` as a served chat prompt: one user message in the family's template, assistant turn open."""
    from transformers.utils.chat_template_utils import render_jinja_template

    (text,), _ = render_jinja_template([[{"role": "user", "content": request}]],
                                       chat_template=CODE_CHAT_TEMPLATE, add_generation_prompt=True)
    return text


def chat_stream(tokenizer, pairs: Sequence[Pair], eot_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pairs packed for training: ``(ids, weights, starts)``.

    ``ids`` is ``prompt answer EOT prompt answer EOT ...`` (int32), ``weights[i]`` is 1 where token ``i`` is
    part of an answer or its EOT (the positions a loss is taken at) and 0 on the prompts, ``starts`` holds
    where each prompt begins (training rows start there, as a served prompt does: no token before it).
    """
    prompts = tokenizer.backend_tokenizer.encode_batch([chat_prompt(p.request) for p in pairs],
                                                       add_special_tokens=False)
    answers = tokenizer.backend_tokenizer.encode_batch([p.answer for p in pairs], add_special_tokens=False)
    ids, weights, starts = [], [], []
    for q, a in zip(prompts, answers):
        starts.append(len(ids))
        ids += q.ids + a.ids + [eot_id]
        weights += [0] * len(q.ids) + [1] * (len(a.ids) + 1)
    return (torch.tensor(ids, dtype=torch.int32), torch.tensor(weights, dtype=torch.float32),
            torch.tensor(starts, dtype=torch.long))
