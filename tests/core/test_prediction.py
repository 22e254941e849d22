"""The predicted-output index (cluster/core/prediction.py): what it drafts from where."""
from __future__ import annotations

from cluster.core.prediction import Prediction


def test_drafts_the_start_before_any_token_then_follows_the_generated_suffix():
    p = Prediction([5, 6, 7, 8, 9, 10], offset=2, k=3)
    assert p.draft([1, 2], 8) == [5, 6, 7]                   # nothing generated yet: the prediction's start
    assert p.draft([1, 2, 5, 6, 7], 8) == [8, 9, 10]         # suffix 6, 7 found: what follows it
    assert p.draft([1, 2, 5, 6, 7], 2) == [8, 9]             # never more than the step's limit
    assert p.draft([1, 2, 5, 6, 7], 0) == []


def test_no_match_or_too_short_a_match_drafts_nothing():
    p = Prediction([5, 6, 7, 8], offset=0, k=4, min_match=2)
    assert p.draft([1, 2, 3], 4) == []                       # the suffix never occurs
    assert p.draft([1, 2, 6], 4) == []                       # one token matches, two are needed
    assert p.draft([6], 4) == [7, 8]                         # ... unless only one token was generated
    assert p.draft([5, 6, 7, 8], 4) == []                    # the match is the prediction's end: nothing follows


def test_repeated_text_follows_the_prediction_in_order():
    # "a b X" twice with different continuations: after the second copy's start the draft follows it,
    # not the latest (or first) occurrence as plain Max-Gram would
    ids = [1, 2, 3, 40, 41, 1, 2, 3, 50, 51, 1, 2, 3, 60]
    p = Prediction(ids, offset=0, k=2)
    assert p.draft([1, 2, 3], 2) == [40, 41]                 # from the start: the first copy
    assert p.draft([1, 2, 3, 40, 41, 1, 2, 3], 2) == [50, 51]   # the next copy, past the last draft's start
    assert p.draft([1, 2, 3, 40, 41, 1, 2, 3, 50, 51, 1, 2, 3], 2) == [60]
    late = Prediction(ids, offset=0, k=2)
    late.cursor = 13                                         # nothing past the cursor: the latest copy
    assert late.draft([7, 1, 2, 3], 2) == [60]
