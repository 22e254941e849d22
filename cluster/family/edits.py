"""Edit pairs for the family's instruction phase: "here is a function, make this small change" -> the changed
function, made mechanically from the standard library's own functions.

A served edit request (OpenAI's predicted outputs: the client sends the file it wants changed as the
``prediction``) is answered well only by a model that *copies* the code it is shown and changes what it is
asked to; a model trained on source text and docstring requests alone writes some other function, and a
prediction of the original then helps for a few tokens at most.  Each pair here is one user message (the
request, a blank line, the function) and the assistant's answer (the function with the change made), rendered
and packed like :mod:`cluster.family.instruct`'s pairs (loss on the answer).  The changes are exact source
transformations located with :mod:`ast` positions, each checked to parse and to change the text:

* ``rename``: a parameter or local variable renamed everywhere it is a name (keyword arguments and
  attributes, which name something else, are left alone);
* ``constant``: an integer literal that occurs once changed to another value;
* ``docstring``: the function's own docstring (first paragraph, on one line) put back after its ``def``;
* ``argument``: a keyword argument with default ``None`` added after the last parameter;
* ``function``: the function renamed (its recursive calls too).

The functions are :func:`cluster.family.instruct`'s answers (decorators and docstring dropped, dedented)
short enough that a pair (request with the function, then the answer) fits one training row of the full
preset (``MAX_CHARS``).  Held-out files give no training pair; :func:`heldout_edits` draws the edit
benchmark's cases (``specserve bench --suite edit``) from them.
"""
from __future__ import annotations

import ast
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from cluster.family.instruct import function_sources, split_sources

#: the longest function (characters) an edit pair is made from: the full preset's rows are 256 tokens and
#: a pair holds the function twice (about 3.3 characters a token on the standard library)
MAX_CHARS = 320
NEW_NAMES = ("value", "item", "result", "data", "count", "total", "current", "entry", "target", "options")
KINDS = ("rename", "constant", "docstring", "argument", "function")


@dataclass(frozen=True)
class EditPair:
    """A function (``original``), the change asked for (``change``, one sentence) and the function with it
    made (``answer``); ``request`` is the user's message."""

    change: str
    original: str
    answer: str
    source: str
    kind: str

    @property
    def request(self) -> str:
        return f"{self.change}\n\n{self.original}"


def _replace(code: str, spans: list[tuple[int, int, int, str]]) -> str:
    """``code`` with each ``(line, start col, end col, text)`` span (1-based line, byte columns) replaced."""
    lines = code.splitlines(keepends=True)
    for line, a, b, text in sorted(spans, reverse=True):
        raw = lines[line - 1].encode()
        lines[line - 1] = (raw[:a] + text.encode() + raw[b:]).decode()
    return "".join(lines)


def _fresh(code: str, rng: random.Random, suffix: str = "") -> str:
    names = [n + suffix for n in NEW_NAMES if not re.search(rf"\b{n}{suffix}\b", code)]
    return rng.choice(names) if names else ""


def _rename(fn: ast.FunctionDef, code: str, rng: random.Random):
    params = [a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs if a.arg not in ("self", "cls")]
    stored = [n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]
    names = list(dict.fromkeys(params + stored))
    if not names or any(isinstance(n, (ast.Global, ast.Nonlocal)) for n in ast.walk(fn)):
        return None
    old, new = rng.choice(names), _fresh(code, rng)
    if not new or len(old) < 2:
        return None
    spans = [(n.lineno, n.col_offset, n.end_col_offset, new) for n in ast.walk(fn)
             if isinstance(n, ast.Name) and n.id == old]
    spans += [(a.lineno, a.col_offset, a.col_offset + len(old.encode()), new) for a in ast.walk(fn)
              if isinstance(a, ast.arg) and a.arg == old]
    return f"Rename the variable {old} to {new}.", _replace(code, spans)


def _constant(fn: ast.FunctionDef, code: str, rng: random.Random):
    lines = code.splitlines(keepends=True)
    ints = [n for n in ast.walk(fn) if isinstance(n, ast.Constant) and type(n.value) is int and n.lineno == n.end_lineno
            and lines[n.lineno - 1].encode()[n.col_offset:n.end_col_offset].decode() == str(n.value)]
    once = [n for n in ints if sum(m.value == n.value for m in ints) == 1 and len(re.findall(rf"\b{n.value}\b", code)) == 1]
    if not once:
        return None
    node = rng.choice(once)
    new = node.value + rng.choice((1, 2, 10)) if node.value < 4 else node.value * 2
    return f"Change the number {node.value} to {new}.", _replace(code, [(node.lineno, node.col_offset,
                                                                          node.end_col_offset, str(new))])


def _docstring(fn: ast.FunctionDef, code: str, doc: str):
    first = fn.body[0]
    if not doc or '"' in doc or "\\" in doc or first.lineno == fn.lineno:
        return None
    lines = code.splitlines(keepends=True)
    indent = lines[first.lineno - 1][:first.col_offset]
    lines.insert(first.lineno - 1, f'{indent}"""{doc}"""\n')
    return f"Add the docstring: {doc}", "".join(lines)


def _argument(fn: ast.FunctionDef, code: str, rng: random.Random):
    a = fn.args
    if a.vararg or a.kwarg or a.kwonlyargs or not a.args:
        return None
    last = a.defaults[-1] if a.defaults else a.args[-1]
    new = _fresh(code, rng)
    if not new:
        return None
    return (f"Add an argument {new} with the default None.",
            _replace(code, [(last.end_lineno, last.end_col_offset, last.end_col_offset, f", {new}=None")]))


def _function(fn: ast.FunctionDef, code: str, rng: random.Random):
    new = _fresh(code, rng, "_" + fn.name.strip("_")) if not fn.name.startswith("__") else ""
    if not new:
        return None
    head = code.splitlines()[fn.lineno - 1]
    col = len(head[:head.index("def ") + 4].encode()) if "def " in head else -1
    if col < 0:
        return None
    spans = [(fn.lineno, col, col + len(fn.name.encode()), new)]
    spans += [(n.lineno, n.col_offset, n.end_col_offset, new) for n in ast.walk(fn)
              if isinstance(n, ast.Name) and n.id == fn.name]
    return f"Rename the function {fn.name} to {new}.", _replace(code, spans)


def make_edit(code: str, doc: str, kind: str, rng: random.Random) -> tuple[str, str] | None:
    """``(change, changed code)`` of one ``kind`` (:data:`KINDS`) applied to the function ``code`` (whose
    docstring's first paragraph is ``doc``, or ''), or None where that change does not apply."""
    fn = ast.parse(code).body[0]
    makers: dict[str, Callable] = {"rename": _rename, "constant": _constant, "argument": _argument,
                                   "function": _function, "docstring": lambda f, c, r: _docstring(f, c, doc)}
    made = makers[kind](fn, code, rng)
    if made is None or made[1] == code:
        return None
    try:
        ast.parse(made[1])
    except SyntaxError:                                      # e.g. a trailing comma after the last parameter
        return None
    return made


def edits_from_source(text: str, source: str, rng: random.Random) -> list[EditPair]:
    """One edit pair per short function of Python source ``text`` (its kind drawn with ``rng`` among those that
    apply), in source order."""
    out = []
    for code, doc, line in function_sources(text):
        if len(code) > MAX_CHARS:
            continue
        for kind in rng.sample(KINDS, len(KINDS)):
            made = make_edit(code, doc, kind, rng)
            if made is not None:
                out.append(EditPair(made[0], code, made[1], f"{source}:{line}", kind))
                break
    return out


def _edits(files: Iterable[Path], root: Path | None, held: bool, seed: int, max_chars: int | None) -> list[EditPair]:
    rng = random.Random(seed)
    return [p for text, key in split_sources(files, root, held, max_chars) for p in edits_from_source(text, key, rng)]


def train_edits(files: Iterable[Path], root: Path | None = None, seed: int = 0,
                max_chars: int | None = None) -> list[EditPair]:
    """Edit pairs of the training files among ``files``: a held-out file gives none, even when listed."""
    return _edits(files, root, False, seed, max_chars)


def heldout_edits(files: Iterable[Path], n: int, seed: int = 33, root: Path | None = None) -> list[EditPair]:
    """``n`` edit pairs (or all there are) drawn with ``random.Random(seed)`` from the held-out files of
    ``files``: the edit benchmark's cases."""
    pairs = _edits(files, root, True, seed, None)
    return random.Random(seed).sample(pairs, min(n, len(pairs)))
