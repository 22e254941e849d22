"""The suffix index (cluster/core/suffix.py): its counts equal a rescan under appends, rollbacks and evictions, its
drafts follow the definition, memory stays bounded, and salts never see each other's documents."""
from __future__ import annotations

import random

import pytest

from cluster.core.suffix import SuffixIndex
from tests.support.suffix_oracle import check_draft, occurrences


def test_the_docstrings_worked_example():
    idx = SuffixIndex(max_depth=4)
    idx.sync("a", "", [1, 2, 3, 4])
    idx.finish("a")
    idx.sync("b", "", [1, 2, 3, 5])
    idx.finish("b")
    idx.sync("r", "", [7, 1, 2])
    assert idx.draft("r", 8, min_prob=0.5) == [3, 5]            # 5 and 4 seen once each: the one seen last
    assert idx.draft("r", 8, min_prob=0.6) == [3]               # 1 * 1/2 < 0.6
    assert idx.draft("r", 8, min_prob=0.5, spec_factor=0.5) == [3]
    assert idx.draft("r", 1, min_prob=0.0) == [3]
    assert idx.stats("", [1, 2]) == (3, 2) and idx.stats("", [1, 2, 3]) == (2, 2) and idx.stats("", [9]) == (0, 0)
    idx.sync("r", "", [7, 1, 2, 3, 4])                          # the request goes on like "a": 4 now leads
    idx.sync("s", "", [1, 2, 3])
    assert idx.draft("s", 8, min_prob=0.0) == [4]


def test_continuations_come_from_any_document_and_the_match_is_the_longest():
    idx = SuffixIndex(max_depth=8)
    idx.sync("old", "", [5, 6, 7, 8, 9, 10, 11])                 # an earlier request's prompt and output
    idx.finish("old")
    idx.sync("new", "", [1, 2, 6, 7])                            # a running request: its own history too
    assert idx.draft("new", 8, min_prob=0.0) == [8, 9]           # p = 2: at most 2 tokens (spec_factor 1)
    assert idx.draft("new", 8, min_prob=0.0, spec_factor=4.0) == [8, 9, 10, 11]
    idx.sync("new", "", [1, 2, 6, 7, 1, 2])                      # "1 2" was followed by 6 in this very request
    assert idx.draft("new", 3, min_prob=0.0) == [6, 7]


@pytest.mark.parametrize("seed", range(60))
def test_counts_and_drafts_equal_a_rescan_under_appends_rollbacks_and_drops(seed):
    rng = random.Random(seed)
    depth, vocab = rng.choice([2, 3, 4, 6]), rng.choice([2, 3, 5])
    idx, docs = SuffixIndex(depth, 10 ** 9), {}
    for _ in range(rng.randrange(5, 25)):
        key, r = rng.randrange(4), rng.random()
        cur = docs.get(key, [])
        if r < 0.1:
            idx.drop(key)
            docs.pop(key, None)
            continue
        keep = len(cur) if r < 0.6 else rng.randrange(len(cur) + 1)            # an append, or a rollback first
        new = cur[:keep] + [rng.randrange(vocab) for _ in range(rng.randrange(0 if r >= 0.6 else 1, 6))]
        idx.sync(key, "", new)
        docs[key] = new
        windows = {tuple(d[i:j]) for d in docs.values() for i in range(len(d))
                   for j in range(i + 1, min(len(d), i + depth) + 1)}
        windows |= {tuple(rng.randrange(vocab) for _ in range(rng.randrange(1, depth + 1))) for _ in range(5)}
        for w in windows:
            seen, after = occurrences(list(docs.values()), w, depth)
            assert idx.stats("", w) == (seen, sum(after.values())), w
        for key in docs:
            k, min_prob, factor = rng.randrange(1, 12), rng.choice([0.0, 0.3, 0.6]), rng.choice([0.5, 1.0, 3.0, 10.0])
            check_draft(list(docs.values()), docs[key], idx.draft(key, k, min_prob=min_prob, spec_factor=factor),
                        k, depth, min_prob, factor)
    assert idx.tokens == sum(map(len, docs.values()))
    for key in list(docs):
        idx.drop(key)
    assert idx.nodes == 0 and idx.tokens == 0 and idx.salts() == [] and len(idx) == 0


def test_finished_documents_are_evicted_oldest_first_and_running_ones_never():
    idx = SuffixIndex(max_depth=4, max_tokens=10)
    idx.sync("live", "", [9, 9, 9, 9])
    for i in range(3):
        idx.sync(i, "", [10 * i + 1, 10 * i + 2])
        idx.finish(i)
    assert idx.tokens == 10 and idx.stats("", [1, 2]) == (1, 0)
    idx.sync(3, "", [31, 32])
    idx.finish(3)                                                # 12 > 10: the oldest finished one goes
    assert idx.tokens == 10 and idx.stats("", [1, 2]) == (0, 0) and idx.stats("", [11, 12]) == (1, 0)
    idx.sync("live", "", [9] * 12)                               # a running document grows past the bound ...
    idx.finish("unknown")                                        # ... and every finished one is evicted for it
    assert idx.stats("", [9, 9]) == (11, 10) and idx.stats("", [31, 32]) == (0, 0) and idx.tokens == 12


def test_salts_never_see_each_others_documents():
    idx = SuffixIndex(max_depth=8)
    idx.sync("a-old", "tenant-a", [1, 2, 3, 4, 5, 6])
    idx.finish("a-old")
    idx.sync("a-new", "tenant-a", [1, 2, 3])
    idx.sync("b-new", "tenant-b", [1, 2, 3])
    idx.sync("none", "", [1, 2, 3])
    assert idx.draft("a-new", 8, min_prob=0.0, spec_factor=4.0) == [4, 5, 6]
    assert idx.draft("b-new", 8, min_prob=0.0, spec_factor=4.0) == []
    assert idx.draft("none", 8, min_prob=0.0, spec_factor=4.0) == []
    assert idx.stats("tenant-b", [3, 4]) == (0, 0) and idx.stats("tenant-a", [3, 4]) == (1, 1)
    with pytest.raises(ValueError, match="another salt"):
        idx.sync("a-new", "tenant-b", [1])
    for key in ("a-old", "a-new"):
        idx.drop(key)
    assert sorted(idx.salts()) == ["", "tenant-b"]


def test_unique_text_costs_a_few_nodes_per_token_not_one_per_window():
    rng = random.Random(0)
    idx = SuffixIndex(max_depth=24)
    for d in range(20):
        idx.sync(d, "", [rng.randrange(4096) for _ in range(400)])
        idx.finish(d)
    assert idx.tokens == 8000 and idx.nodes < 2 * idx.tokens      # uncompressed: ~24 per token
    text = list(b"def f(x):\n    return x\n" * 40)              # repetition shares its nodes
    idx.sync("rep", "", text)
    assert idx.nodes < 2 * idx.tokens


def test_bad_sizes_are_refused():
    for kw in (dict(max_depth=1), dict(max_tokens=0)):
        with pytest.raises(ValueError):
            SuffixIndex(**kw)
