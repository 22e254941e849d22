"""The family's instruction phase on literal source: pair extraction (docstring or leading comment -> request,
the function -> answer), the held-out split kept out of training, the chat rendering of a pair as served,
the packed training rows, and the exact greedy-speculation count of the build's evaluation."""
from __future__ import annotations

import ast
import textwrap
from types import SimpleNamespace

import pytest
import torch

import cluster.family.corpus as corpus
from cluster.family.chateval import parses, speculative_run
from cluster.family.instruct import chat_prompt, chat_stream, heldout_pairs, pairs_from_source, train_pairs
from cluster.family.tokenizer import train_tokenizer
from cluster.family.train import _batches
from cluster.models.chat_template import render_chat
from cluster.models.tokenizer import ByteTokenizer

SOURCE = textwrap.dedent('''\
    import os


    def reverse(items):
        """Return the items of a list in reverse order.

        The list itself is left as it is.
        """
        return items[::-1]


    # Join the parts of a path with the
    # platform's separator.
    @staticmethod
    def join(*parts):
        return os.sep.join(parts)


    class Box:
        def size(self):
            """Count the things in the box."""
            n = 0
            for _ in self:
                n += 1
            return n

        def only_doc(self):
            """This method has nothing but its docstring."""

        def short(self):
            """Too short."""
            return 1

        def no_request(self):
            return 2
    ''')


def test_docstring_or_comment_becomes_the_request_and_the_function_the_answer():
    pairs = pairs_from_source(SOURCE, "pkg/mod.py")
    assert [p.request for p in pairs] == [
        "Return the items of a list in reverse order.",            # first paragraph only
        "Join the parts of a path with the platform's separator.",  # comment lines joined, decorator dropped
        "Count the things in the box.",                             # a method, dedented
    ]
    assert pairs[0].answer == "def reverse(items):\n    return items[::-1]\n"   # docstring removed
    assert pairs[1].answer == "def join(*parts):\n    return os.sep.join(parts)\n"
    assert pairs[2].answer == "def size(self):\n    n = 0\n    for _ in self:\n        n += 1\n    return n\n"
    assert [p.source for p in pairs] == ["pkg/mod.py:4", "pkg/mod.py:15", "pkg/mod.py:20"]
    for p in pairs:
        ast.parse(p.answer)
    assert pairs_from_source("def broken(:\n", "x.py") == []


def _split_root(tmp_path):
    """A root with one training and one held-out file (membership is the SHA-1 of the relative path)."""
    names = [f"mod{i}.py" for i in range(400)]
    held = next(n for n in names if corpus.is_heldout(tmp_path / n, root=tmp_path))
    train = next(n for n in names if not corpus.is_heldout(tmp_path / n, root=tmp_path))
    (tmp_path / train).write_text(SOURCE)
    (tmp_path / held).write_text(SOURCE.replace("reverse", "flip"))
    return tmp_path / train, tmp_path / held


def test_held_out_files_give_no_training_pair(tmp_path):
    train, held = _split_root(tmp_path)
    pairs = train_pairs([held, train], root=tmp_path)                # listed or not, the held-out file is dropped
    assert len(pairs) == 3 and all(p.source.startswith(train.name + ":") for p in pairs)
    assert train_pairs([held], root=tmp_path) == []
    evals = heldout_pairs([train, held], 10, root=tmp_path)
    assert len(evals) == 3 and all(p.source.startswith(held.name + ":") for p in evals)
    assert any(p.answer.startswith("def flip(") for p in evals)
    assert heldout_pairs([train, held], 2, seed=1, root=tmp_path) == heldout_pairs([train, held], 2, seed=1,
                                                                                    root=tmp_path)


def test_real_split_pairs_are_disjoint_by_file():
    files = corpus.stdlib_files()
    _, held = corpus.split_files(files)
    held_keys = {corpus._rel_key(f) for f in held}
    sample = [f for f in files if corpus._rel_key(f) in held_keys or f.name == "os.py"]
    assert not {p.source.rsplit(":", 1)[0] for p in train_pairs(sample)} & held_keys


def test_a_pair_is_rendered_as_the_served_chat_prompt():
    request = "Return the items of a list in reverse order."
    prompt = chat_prompt(request)
    assert prompt == f"# user: {request}\n# assistant:\n"
    assert prompt == render_chat(ByteTokenizer(), [{"role": "user", "content": request}])


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer([SOURCE] * 4, 300)


def test_chat_stream_weighs_the_answers_only(tokenizer):
    pairs = pairs_from_source(SOURCE, "m.py")
    ids, weights, starts = chat_stream(tokenizer, pairs, eot_id=0)
    assert len(starts) == len(pairs) and starts[0] == 0 and ids.dtype == torch.int32
    bounds = [*starts.tolist(), len(ids)]
    for p, a, b in zip(pairs, bounds, bounds[1:]):
        text = tokenizer.decode(ids[a:b - 1].tolist())
        assert text == chat_prompt(p.request) + p.answer and ids[b - 1] == 0
        n_prompt = len(tokenizer(chat_prompt(p.request), add_special_tokens=False)["input_ids"])
        assert weights[a:a + n_prompt].sum() == 0 and bool(weights[a + n_prompt:b].eq(1).all())


def test_training_rows_mix_in_chat_rows_from_pair_starts(tokenizer):
    pairs = pairs_from_source(SOURCE, "m.py") * 8
    chat = chat_stream(tokenizer, pairs, eot_id=0)
    stream = torch.arange(1000, dtype=torch.int32)
    batches = list(_batches(stream, 2, 16, 4, seed=0, chats=[(chat, 3)], chat_from=2))
    assert [len(x) for x, _ in batches] == [2, 2, 5, 5]
    starts = {tuple(chat[0][s:s + 17].tolist()) for s in chat[2].tolist()}
    for x, w in batches[2:]:
        assert bool(w[:2].eq(1).all())
        for row, wr in zip(x[2:], w[2:]):
            assert tuple(row.tolist()) in starts                         # a row opens with a prompt
            assert wr[0] == 0                                            # whose tokens carry no loss


class _Oracle:
    """A stand-in drafter whose greedy prediction at each position is the next token of ``seq``, except at
    the answer positions in ``wrong``."""

    def __init__(self, seq: list[int], prompt_len: int, wrong: set[int]):
        self.next = [t if i - prompt_len not in wrong else t + 1 for i, t in enumerate(seq)]

    def __call__(self, input_ids):
        logits = torch.zeros(1, input_ids.shape[1], 50)
        for i in range(input_ids.shape[1]):
            logits[0, i, self.next[i + 1]] = 1.0
        return SimpleNamespace(logits=logits)


def test_greedy_speculation_count():
    prompt, answer = [1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    assert speculative_run(_Oracle(prompt + answer, 3, set()), prompt, answer, k=4) == (2, 8)
    # drafts 4,5 accepted, 6 rejected -> target emits 6; then 7..10 accepted, 11 is the bonus; then 12 wrong
    # -> target emits 12; then 13 accepted
    assert speculative_run(_Oracle(prompt + answer, 3, {2, 8}), prompt, answer, k=4) == (4, 7)
    assert speculative_run(_Oracle(prompt + answer, 3, set(range(10))), prompt, answer, k=4) == (10, 0)


def test_parses_needs_a_statement():
    assert parses("def f(x):\n    return x\n")
    assert not parses("        ") and not parses("def f(:\n") and not parses("#\n#\n")
