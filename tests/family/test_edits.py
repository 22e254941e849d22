"""The family's edit pairs: each mechanical change made exactly (and only where it applies), the request
shaped as a served edit request, held-out files kept out of training, the benchmark's cases drawn from them."""
from __future__ import annotations

import ast
import random
import textwrap

import cluster.family.corpus as corpus
from cluster.family.edits import KINDS, MAX_CHARS, edits_from_source, heldout_edits, make_edit, train_edits

CODE = textwrap.dedent('''\
    def scale(xs, factor=2):
        out = []
        for x in xs:
            out.append(x * factor + 7)
        print(out, sep=factor)
        return scale(out.copy(), factor=factor)
    ''')
DOC = "Scale every item."


class _Fixed(random.Random):
    """A Random whose choice() takes the first candidate (so the tests name the exact edit)."""

    def choice(self, seq):
        return seq[0]


def test_rename_changes_the_name_everywhere_it_is_a_name():
    change, code = make_edit(CODE, DOC, "rename", _Fixed())
    assert change == "Rename the variable xs to value."
    assert code == CODE.replace("(xs,", "(value,").replace("in xs:", "in value:")


def test_rename_keeps_keyword_argument_names_and_attributes():
    code = "def g(factor):\n    return h(factor=factor, n=obj.factor)\n"
    assert make_edit(code, "", "rename", _Fixed()) == (
        "Rename the variable factor to value.", "def g(value):\n    return h(factor=value, n=obj.factor)\n")


def test_constant_argument_docstring_and_function_edits():
    change, code = make_edit(CODE, DOC, "constant", _Fixed())
    assert (change, code) == ("Change the number 2 to 3.", CODE.replace("factor=2", "factor=3"))
    assert make_edit(CODE.replace("+ 7", "+ 2"), DOC, "constant", _Fixed()) is None   # 2 twice: ambiguous
    change, code = make_edit(CODE, DOC, "docstring", _Fixed())
    assert change == f"Add the docstring: {DOC}"
    assert code == CODE.replace("):\n", f'):\n    """{DOC}"""\n', 1)
    change, code = make_edit(CODE, DOC, "argument", _Fixed())
    assert (change, code) == ("Add an argument value with the default None.",
                              CODE.replace("factor=2)", "factor=2, value=None)"))
    change, code = make_edit(CODE, DOC, "function", _Fixed())
    assert change == "Rename the function scale to value_scale."
    assert code == CODE.replace("def scale", "def value_scale").replace("return scale(", "return value_scale(")


def test_an_edit_that_does_not_apply_is_none():
    plain = "def f(*args):\n    return args\n"
    assert make_edit(plain, "", "argument", _Fixed()) is None        # *args: no place for a keyword argument
    assert make_edit(plain, "", "docstring", _Fixed()) is None       # no docstring to put back
    assert make_edit(plain, "", "constant", _Fixed()) is None        # no number


def test_pairs_from_source_are_served_requests_of_short_functions():
    src = CODE + "\n\n" + "def long():\n" + "    x = 1\n" * (MAX_CHARS // 9) + "    return x\n"
    pairs = edits_from_source(src, "m.py", random.Random(0))
    assert len(pairs) == 1 and pairs[0].source == "m.py:1" and pairs[0].kind in KINDS
    p = pairs[0]
    assert p.original == CODE and p.answer != CODE and ast.parse(p.answer)
    assert p.request == f"{p.change}\n\n{CODE}"


def test_held_out_files_give_no_training_edit_and_give_the_bench_cases(tmp_path):
    names = [f"mod{i}.py" for i in range(400)]
    held = tmp_path / next(n for n in names if corpus.is_heldout(tmp_path / n, root=tmp_path))
    train = tmp_path / next(n for n in names if not corpus.is_heldout(tmp_path / n, root=tmp_path))
    train.write_text(CODE)
    held.write_text(CODE.replace("scale", "grow"))
    pairs = train_edits([held, train], root=tmp_path)
    assert len(pairs) == 1 and pairs[0].source.startswith(train.name + ":")
    cases = heldout_edits([train, held], 5, root=tmp_path)
    assert len(cases) == 1 and cases[0].source.startswith(held.name + ":") and "grow" in cases[0].original
