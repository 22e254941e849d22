"""The Max-Gram drafter: incremental index == brute-force rescan; MaG speculative decoding is exact."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.core.maxgram import MaxGramIndex
from cluster.family.bigram import build_bigram
from cluster.models.maxgram import MagHandle, load_bigram, save_bigram
from tests.support.maxgram_oracle import brute_force_predict

ops = st.lists(st.one_of(st.tuples(st.just("append"), st.lists(st.integers(0, 3), min_size=1, max_size=6)),
                         st.tuples(st.just("truncate"), st.integers(0, 40))), min_size=1, max_size=25)


@settings(max_examples=300, deadline=None)
@given(seq=st.lists(st.integers(0, 3), min_size=1, max_size=60), ops=ops, k=st.integers(1, 6),
       max_ngram=st.integers(1, 8), bigram=st.lists(st.integers(0, 3), min_size=4, max_size=4))
def test_index_matches_brute_force_under_appends_and_rollbacks(seq, ops, k, max_ngram, bigram):
    """After any interleaving of appends and truncations, the incremental index predicts exactly what a
    full rescan of the current sequence predicts (longest earlier suffix match, latest occurrence, then
    bigram continuation), and its table holds exactly the n-grams ending before the last token."""
    bigram = np.array(bigram)
    idx = MaxGramIndex(seq, max_ngram)
    cur = list(seq)
    for op, arg in ops:
        if op == "append":
            idx.extend(arg)
            cur += arg
        elif arg >= 1:
            idx.truncate(arg)
            cur = cur[:arg]
        assert idx.seq == cur
        assert idx.predict(k, bigram) == brute_force_predict(cur, k, bigram, max_ngram)
    fresh = MaxGramIndex(cur, max_ngram)
    assert idx.table == fresh.table


def test_literal_match_copies_latest_occurrence_then_bigram():
    bigram = np.array([1, 2, 3, 0, 0])
    idx = MaxGramIndex([4, 1, 2, 0, 1, 2, 3, 4, 1, 2])
    # longest earlier match of the suffix [.., 4, 1, 2]: "4 1 2" occurs at the start (ends at 2)
    assert idx.longest_match() == (3, 2)
    assert idx.predict(3, bigram) == [0, 1, 2]
    assert idx.predict(10, bigram)[:7] == [0, 1, 2, 3, 4, 1, 2]   # copy runs out -> bigram from 2
    assert MaxGramIndex([3]).predict(3, bigram) == [0, 1, 2]       # no match: bigram from the last token


def test_build_bigram_most_frequent_successor_and_roundtrip(tmp_path):
    table = build_bigram([[0, 1, 0, 1, 0, 2], [2, 2, 2]], vocab_size=4)
    assert table.tolist() == [1, 0, 2, 2]          # 3 never seen as a predecessor -> most frequent token
    path = save_bigram(table, tmp_path / "b.npy")
    assert load_bigram(path).tolist() == table.tolist()


def test_handle_propose_is_one_hot_and_rolls_back():
    h = MagHandle(5, np.array([1, 2, 3, 4, 0]))
    h.prefill("r", [0, 1, 2, 0, 1], None, 0)
    toks, logits = h.propose("r", 4)
    assert toks == [2, 0, 1, 2] and h.length("r") == 9
    assert logits.shape == (4, 5) and (logits.argmax(-1).tolist() == toks)
    assert bool((logits.exp().sum(-1) == 1).all())
    h.rollback("r", 5)
    assert h.propose("r", 4)[0] == toks
    scored = h.score("r", [])
    assert scored.shape == (1, 5)
    h.release("r")
    assert h.active_requests() == []


def test_rejects_mismatched_bigram():
    with pytest.raises(ValueError, match="vocabulary size"):
        MagHandle(5, np.array([0, 1]))


@pytest.fixture(scope="module")
def tiny_mag_engine():
    import yaml

    from cluster.config.schema import config_from_dict
    from tests.support.built import engine_for
    data = yaml.safe_load(open("configs/tiny.yaml"))
    data["mag"] = {}
    return engine_for(config_from_dict(data))


def test_mag_strategy_greedy_equals_target(tiny_mag_engine):
    from cluster.core.sampling import SamplingParams
    from cluster.engine.request import GenerationRequest
    for prompt in ("def foo(x):\n    return x + 1\n\ndef foo(", "abcabcabcabc"):
        base = dict(prompt=prompt, max_new_tokens=24, sampling=SamplingParams(0.0), ignore_eos=True, seed=0)
        ar = tiny_mag_engine.generate(GenerationRequest(strategy="autoregressive", **base))
        for k in (1, 3, 8):
            res = tiny_mag_engine.generate(GenerationRequest(strategy="mag", options={"k": k}, **base))
            assert res.token_ids == ar.token_ids
            assert res.stats.drafter_forwards.get("mag", 0) > 0


def test_mag_exact_under_sampling():
    """MaG drafting on a tabular target over 3 tokens: the output is exactly the target's joint."""
    from cluster.core.sampling import SamplingParams
    from tests.support.exact import local_engine
    from cluster.engine.request import GenerationRequest
    from tests.support.exact import (
        TabularModel,
        VocabTokenizer,
        enumerate_outcomes,
        max_abs_diff,
        target_joint,
    )
    target = TabularModel("target", 4, seed=5)
    mag = MagHandle(4, np.array([1, 2, 3, 0]))
    holder = {}
    engine = local_engine({"target": target, "mag": mag}, VocabTokenizer(4), rng_factory=lambda s: holder["rng"])

    def run(rng):
        holder["rng"] = rng
        return tuple(engine.generate(GenerationRequest(prompt_ids=[0, 1, 0], max_new_tokens=3, strategy="mag",
                                                       sampling=SamplingParams(1.0), seed=0,
                                                       options={"k": 2})).token_ids)

    assert max_abs_diff(enumerate_outcomes(run), target_joint(target, [0, 1, 0], 3)) < 1e-9
