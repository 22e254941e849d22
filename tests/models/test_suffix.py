"""The suffix drafter's handle (cluster/models/suffix.py): prompts indexed at prefill, outputs at release (the draft
side tells it what was committed first), one-hot proposals of at most k tokens, salts apart; built from config."""
from __future__ import annotations

import pytest
import yaml

from cluster.config.schema import config_from_dict
from cluster.core.calls import PrefillItem
from cluster.core.draft.programs import DraftSpec
from cluster.core.draft.side import DraftSide
from cluster.core.interfaces import UnknownRequestError, UnsupportedCallError
from cluster.core.sampling import SamplingParams
from cluster.errors import ConfigError
from cluster.models.suffix import SuffixHandle

GREEDY = SamplingParams(0.0)


def test_a_running_requests_prompt_drafts_for_another_and_proposals_are_one_hot():
    h = SuffixHandle(16, max_depth=8, min_prob=0.0, spec_factor=8.0)
    h.prefill_batch([PrefillItem("a", [1, 2, 3, 4, 5, 6], GREEDY, 0), ("b", [9, 1, 2], GREEDY, 0)])
    toks, logits = h.propose("b", 3)
    assert toks == [3, 4, 5] and logits.shape == (3, 16) and logits.argmax(-1).tolist() == toks
    assert bool((logits.exp().sum(-1) == 1).all()) and h.length("b") == 6
    h.rollback("b", 3)                                      # the proposals rejected: the next ask starts over
    assert h.propose("b", 8)[0] == [3, 4, 5, 6] and h.propose("b", 2)[0] == []      # after 6 nothing was seen
    with pytest.raises(UnsupportedCallError):
        h.score("b", [1])
    with pytest.raises(UnknownRequestError):
        h.propose("c", 2)
    assert sorted(h.active_requests()) == ["a", "b"] and h.capabilities()["statistical"] == "suffix"


def test_outputs_stay_after_release_and_the_draft_side_commits_them_first():
    """The drafter holds its own last proposals when the request ends; the draft side brings it to the committed
    sequence before releasing, so the index keeps the output (what the engine committed), not the proposals."""
    h = SuffixHandle(16, max_depth=8, min_prob=0.0, spec_factor=8.0)
    h.prefill_batch([PrefillItem("old", [1, 2, 3, 4, 5], GREEDY, 0)])
    h.release("old")
    side = DraftSide({"suffix": h})
    side.prefill_batch([PrefillItem("r", [7, 1, 2], GREEDY, 0)])
    (block,) = side.draft_batch([("r", DraftSpec("propose", ("suffix",)), 4, 10)])
    assert block.tokens == [3, 4, 5] and block.form == "onehot"
    side.rollback("r", 4)                                   # the target kept 3, then emitted 9 and 8
    side.extend("r", [9, 8])
    side.release("r")
    assert not h.active_requests() and len(h.index) == 2
    assert h.index.stats("", [3, 9, 8]) == (1, 0) and h.index.stats("", [3, 4, 5]) == (1, 0)
    h.prefill_batch([PrefillItem("next", [2, 3], GREEDY, 0)])
    assert h.propose("next", 4)[0] == [9, 8]                 # the later of two continuations, once each


def test_each_salt_drafts_only_from_its_own_requests():
    h = SuffixHandle(16, max_depth=8, min_prob=0.0, spec_factor=8.0)
    h.prefill_batch([PrefillItem("a", [1, 2, 3, 4, 5], GREEDY, 0, "tenant-a")])
    h.release("a")
    h.prefill_batch([PrefillItem("same", [1, 2], GREEDY, 0, "tenant-a"), PrefillItem("other", [1, 2], GREEDY, 0, "b"),
                     ("none", [1, 2], GREEDY, 0)])
    assert h.propose("same", 3)[0] == [3, 4, 5]
    assert h.propose("other", 3)[0] == [] and h.propose("none", 3)[0] == []


def test_the_index_is_bounded_by_max_tokens():
    h = SuffixHandle(100, max_depth=4, max_tokens=20)
    for i in range(10):
        h.prefill_batch([PrefillItem(f"r{i}", [10 * i + j for j in range(5)], GREEDY, 0)])
        h.release(f"r{i}")
    assert h.index.tokens <= 20 and len(h.index) == 4       # the oldest finished requests went first
    assert h.index.stats("", [0, 1]) == (0, 0) and h.index.stats("", [90, 91]) == (1, 1)


def _tiny(**suffix):
    data = yaml.safe_load(open("configs/tiny.yaml"))
    data["suffix"] = suffix
    return config_from_dict(data)


def test_built_from_its_config_section_and_refused_by_field():
    from cluster.models.build import build_handles
    cfg = _tiny(max_tokens=1000, max_depth=12, spec_factor=2.0, min_prob=0.25)
    h = build_handles(cfg)["suffix"]
    assert isinstance(h, SuffixHandle) and h.vocab_size == build_handles(cfg, [cfg.target])[cfg.target].vocab_size
    assert (h.index.max_tokens, h.index.max_depth, h.spec_factor, h.min_prob) == (1000, 12, 2.0, 0.25)
    for bad, words in ((dict(max_tokens=0), "suffix.max_tokens"), (dict(max_depth=1), "suffix.max_depth"),
                       (dict(spec_factor=0), "suffix.spec_factor"), (dict(min_prob=2), "suffix.min_prob"),
                       (dict(name="target"), "suffix.name"), (dict(depth=3), "suffix.depth: unknown field")):
        with pytest.raises(ConfigError, match=words):
            _tiny(**bad)
