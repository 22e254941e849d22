"""The Max-Gram drafter's two readings: most recent occurrence, matches capped at max_ngram (ours) and the
first occurrence of a match of any length (Chen et al., CS Drafting, appendix A, Listing 1)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.core.maxgram import MaxGramIndex
from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest
from cluster.models.maxgram import MagHandle
from tests.support.exact import (
    TabularModel,
    VocabTokenizer,
    enumerate_outcomes,
    local_engine,
    max_abs_diff,
    target_joint,
)
from tests.support.maxgram_oracle import brute_force_predict

ops = st.lists(st.one_of(st.tuples(st.just("append"), st.lists(st.integers(0, 2), min_size=1, max_size=8)),
                         st.tuples(st.just("truncate"), st.integers(1, 60))), min_size=1, max_size=20)


@settings(max_examples=300, deadline=None)
@given(seq=st.lists(st.integers(0, 2), min_size=1, max_size=60), ops=ops, k=st.integers(1, 6),
       occurrence=st.sampled_from(["recent", "first"]), capped=st.booleans(), table=st.integers(1, 5),
       bigram=st.lists(st.integers(0, 2), min_size=3, max_size=3))
def test_index_matches_brute_force_for_both_readings(seq, ops, k, occurrence, capped, table, bigram):
    """Capped at ``table`` or uncapped (the table indexes ``table``-grams, longer matches are extended), latest
    or first occurrence: the incremental index predicts what a full rescan predicts, under appends and rollbacks."""
    bigram = np.array(bigram)
    max_ngram = table if capped else 0
    idx = MaxGramIndex(seq, max_ngram, occurrence, table_ngram=table)
    cur = list(seq)
    for op, arg in ops:
        if op == "append":
            idx.extend(arg)
            cur += arg
        else:
            idx.truncate(arg)
            cur = cur[:arg]
        assert idx.predict(k, bigram) == brute_force_predict(cur, k, bigram, max_ngram, occurrence)


def test_literal_first_vs_recent_and_the_cap():
    bigram = np.array([1, 2, 3, 0, 0])
    seq = [0, 1, 2, 0, 1, 3, 4, 0, 1]         # suffix "0 1" occurred at 0..1 (then 2) and 3..4 (then 3)
    assert MaxGramIndex(seq).predict(2, bigram) == [3, 4]
    assert MaxGramIndex(seq, occurrence="first").predict(2, bigram) == [2, 0]
    long = [4] + [0, 1, 2] * 10 + [3] + [0, 1, 2] * 10          # a 30-token repeat: capped at 4 vs uncapped
    assert MaxGramIndex(long, 4, "first").longest_match()[0] == 4
    n, e = MaxGramIndex(long, 0, "first", table_ngram=4).longest_match()
    assert (n, e) == (30, 30)                                  # the whole first run, ending before the 3
    assert MaxGramIndex(long, 0, "first", table_ngram=4).predict(2, bigram) == [3, 0]
    with pytest.raises(ValueError, match="occurrence"):
        MaxGramIndex(seq, occurrence="last")


@pytest.mark.parametrize("occurrence,max_ngram", [("first", 0), ("recent", 2)])
def test_mag_strategy_exact_for_both_readings(occurrence, max_ngram):
    target = TabularModel("target", 3, seed=15)
    mag = MagHandle(3, np.array([1, 2, 0]), max_ngram=max_ngram, occurrence=occurrence)
    holder = {}
    engine = local_engine({"target": target, "mag": mag}, VocabTokenizer(3), rng_factory=lambda s: holder["rng"])

    def run(rng):
        holder["rng"] = rng
        return tuple(engine.generate(GenerationRequest(prompt_ids=[0, 1, 2, 0, 1, 0, 1], max_new_tokens=3,
                                                       strategy="mag", sampling=SamplingParams(1.0), seed=0,
                                                       options={"k": 3})).token_ids)

    assert max_abs_diff(enumerate_outcomes(run), target_joint(target, [0, 1, 2, 0, 1, 0, 1], 3)) < 1e-9


def test_deterministic_drafters_build_one_hot_rows_only_where_asked():
    """A verifier reads a deterministic drafter's tokens alone: a propose item with ``rows`` False gets no
    ``[k, V]`` row (at 128k entries that is half a megabyte per token per request), one with rows its one-hot
    rows, the same tokens either way; across processes, the rows are rebuilt only where they were asked."""
    import torch

    from actors.protocol import expand_onehot, tokens_only
    from cluster.core.calls import ProposeItem
    from cluster.models.suffix import SuffixHandle

    for make in (lambda: MagHandle(50), lambda: SuffixHandle(50)):
        a, b = make(), make()
        for h in (a, b):
            h.prefill("r", [3, 4, 5, 3, 4, 5, 3, 4])
        bare = a.propose_batch([ProposeItem("r", 3, rows=False)])
        full = b.propose_batch([ProposeItem("r", 3)])
        assert bare[0][1] is None
        assert bare[0][0] == full[0][0] and full[0][0]
        toks, rows = full[0]
        assert rows.shape == (len(toks), 50)
        assert torch.equal(rows.argmax(-1), torch.tensor(toks)) and torch.isinf(rows).sum() == len(toks) * 49
        items = [ProposeItem("r", 3, rows=False), ProposeItem("s", 3)]
        sent = tokens_only("propose_batch", [full[0], full[0]])
        back = expand_onehot("propose_batch", sent, 50, items)
        assert back[0][1] is None and torch.equal(back[1][1], rows)
