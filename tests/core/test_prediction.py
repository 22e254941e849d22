"""The predicted-output index (cluster/core/prediction.py): what it drafts from where, and when it leads."""
from __future__ import annotations

from cluster.core.prediction import Prediction


def _leading(p: Prediction) -> Prediction:
    p.verified(1, 1)                   # one prediction token accepted: the prediction leads
    return p


def test_leads_from_the_start_then_follows_the_generated_suffix():
    p = _leading(Prediction([5, 6, 7, 8, 9, 10], offset=2, k=3))
    assert p.lead([1, 2], 8) == [5, 6, 7]                    # nothing generated yet: the prediction's start
    assert p.lead([1, 2, 5, 6, 7], 8) == [8, 9, 10]          # suffix 6, 7 found: what follows it
    assert p.lead([1, 2, 5, 6, 7], 2) == [8, 9]              # never more than the step's limit
    assert p.lead([1, 2, 5, 6, 7], 0) == []


def test_no_match_or_too_short_a_match_drafts_nothing():
    p = _leading(Prediction([5, 6, 7, 8], offset=0, k=4, min_match=2))
    assert p.lead([1, 2, 3], 4) == []                        # the suffix never occurs
    assert p.lead([1, 2, 6], 4) == []                        # one token matches, two are needed
    assert p.lead([5], 4) == [6, 7, 8]                       # ... unless all generated tokens are its start
    assert p.lead([6], 4) == []                              # (not merely somewhere in it)
    assert p.lead([5, 6, 7, 8], 4) == []                     # the match is the prediction's end: nothing follows


def test_repeated_text_follows_the_prediction_in_order():
    # "a b X" twice with different continuations: after the second copy's start the draft follows it,
    # not the latest (or first) occurrence as plain Max-Gram would
    ids = [1, 2, 3, 40, 41, 1, 2, 3, 50, 51, 1, 2, 3, 60]
    p = _leading(Prediction(ids, offset=0, k=2))
    assert p.lead([1, 2, 3], 2) == [40, 41]                  # from the start: the first copy
    assert p.lead([1, 2, 3, 40, 41, 1, 2, 3], 2) == [50, 51]    # the next copy, past where the sequence stood
    assert p.lead([1, 2, 3, 40, 41, 1, 2, 3, 50, 51, 1, 2, 3], 2) == [60]
    late = _leading(Prediction(ids, offset=0, k=2))
    late.cursor = 13                                         # nothing past the cursor: the latest copy
    assert late.lead([7, 1, 2, 3], 2) == [60]


def test_a_fresh_prediction_follows_the_drafter_and_extends_only_an_agreeing_draft():
    p = Prediction([5, 6, 7, 8, 9, 10, 11], offset=1, k=3)
    assert not p.leading and p.lead([0], 8) == []            # nothing verified yet: the drafter drafts
    assert p.follow([0], [5, 6], 8) == [7, 8, 9]             # the whole draft is the prediction's start
    assert p.follow([0], [5, 9], 8) == []                    # only its last token matches
    assert p.follow([0, 5, 6], [7, 8], 8) == [9, 10, 11]     # draft and the token before it match
    assert p.follow([0, 5, 1], [7, 8], 8) == []              # the draft matches, the token before it does not
    assert p.follow([0, 5, 6], [7, 8], 1) == [9] and p.follow([0, 5, 6], [], 8) == []


def test_it_leads_while_mostly_accepted_and_gives_way_when_mostly_refused():
    p = Prediction(list(range(10, 30)), offset=0, k=4)
    p.verified(4, 4)
    assert p.leading and p.min_match == 2
    p.verified(8, 1)                                         # mostly refused: a longer match is needed
    assert not p.leading and p.min_match == 4
    assert p.lead([10, 11, 12], 4) == [13, 14, 15, 16]       # ... but every generated token matches: re-synced
    assert p.lead([1, 12, 13, 14, 15], 4) == []              # 4 of 5 match: not a re-synchronisation
    p.verified(8, 0)
    p.verified(8, 0)
    assert p.min_match == 8                                  # capped at the indexed n-gram length
    assert p.lead(list(range(10, 19)), 2) == [19, 20]        # 8 generated tokens match: re-synced
    assert p.follow([1, 10, 11, 12], [13, 14], 4) == []      # 3 + 2 tokens match: fewer than min_match
    assert p.follow([1, 10, 11, 12, 13, 14, 15], [16, 17], 2) == [18, 19]   # 6 + 2 do
    p.verified(4, 4)
    p.verified(4, 3)
    assert p.min_match == 2 and not p.leading                # 8 of 37 accepted: still following
