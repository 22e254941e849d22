"""SpecDec++ stops drafting right after an EOS candidate (Huang et al., SpecDec++, footnote 1) with one
implementation of its stopping rule (cluster.core.draft.stop.DraftStop) in every drafter; still exact."""
from __future__ import annotations

import pytest
import torch

from cluster.core.draft.stop import DraftStop, stop_after
from cluster.core.sampling import SamplingParams, logits_to_probs
from cluster.engine.request import GenerationRequest
from cluster.models.head import AcceptanceHead
from tests.support.adaptive import AdaptiveTabular
from tests.support.exact import (
    TabularModel,
    VocabTokenizer,
    enumerate_outcomes,
    local_engine,
    max_abs_diff,
    target_joint,
)


def test_stop_rule_with_eos():
    assert stop_after([0.9, 0.8, 0.5, 0.9], 0.3, 10) == 4                        # unchanged without EOS
    assert stop_after([0.99] * 9, 0.5, 10, tokens=[5, 6, 2, 7], eos=2) == 3        # stop at the EOS candidate
    assert stop_after([0.99] * 9, 0.5, 10, tokens=[2], eos=2) == 1                 # even the first
    assert stop_after([0.99] * 9, 0.5, 10, tokens=[5, 6, 2, 7], eos=None) == 10    # ignore_eos: no EOS stop
    rule = DraftStop(0.3, 10)
    assert [rule.after(0, a) for a in (None, 0.9, 0.8, 0.5)] == [False, False, False, True]


def test_batched_worker_stops_drafting_at_eos(tiny_engine):
    """The production drafter (BatchedHFWorker.propose_adaptive_batch) applies the same rule."""
    w = tiny_engine.models["drafter-large"]
    head = AcceptanceHead(w.model.config.hidden_size, depth=1)
    with torch.no_grad():
        for prm in head.parameters():
            prm.zero_()
        head.out.bias.fill_(8.0)                                  # predicts acceptance ~0.9997: no early stop
    prompt = list(b"def add(a, b):\n    return a + b\n")
    w.prefill("eos", prompt, SamplingParams(0.0), 0)
    free, _ = w.propose_adaptive("eos", 6, head.eval(), 0.5)
    assert len(free) == 6
    eos = free[2]
    first = free.index(eos)
    w.rollback("eos", len(prompt))
    w.prefill("plain", prompt, SamplingParams(0.0), 0)
    try:         # one batch: a row with an EOS stop and a 4-field row (no EOS) side by side
        (toks, logits), (plain, _) = w.propose_adaptive_batch([("eos", 6, head, 0.5, eos), ("plain", 6, head, 0.5)])
        assert toks == free[:first + 1] and logits.shape[0] == first + 1 and plain == free
        assert w.length("eos") == len(prompt) + first + 1
    finally:
        w.release("eos"), w.release("plain")


class EosTokenizer(VocabTokenizer):
    eos_token_id = 1


def _target_law_until_eos(target, prompt, n, eos):
    """Autoregressive sampling from the target until EOS (not emitted) or n tokens."""
    out, frontier = {}, {(): 1.0}
    while frontier:
        nxt = {}
        for seq, w in frontier.items():
            if len(seq) == n:
                out[seq] = out.get(seq, 0.0) + w
                continue
            for tok, p in enumerate(logits_to_probs(target.logits(prompt + list(seq)), SamplingParams(1.0)).tolist()):
                if p > 0:
                    if tok == eos:
                        out[seq] = out.get(seq, 0.0) + w * p
                    else:
                        nxt[seq + (tok,)] = nxt.get(seq + (tok,), 0.0) + w * p
        frontier = nxt
    return out


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_specdec_pp_with_eos_stop_is_exact(ignore_eos):
    target = TabularModel("target", 3, seed=21)
    drafter = AdaptiveTabular("adaptive", 3, seed=22, accept=0.95, zeros=True)
    holder, drafts = {}, []
    engine = local_engine({"target": target, "adaptive": drafter}, EosTokenizer(3), rng_factory=lambda s: holder["rng"])
    propose = drafter.propose_adaptive

    def spy(rid, k_max, head, threshold, eos=None):
        toks, logits = propose(rid, k_max, head, threshold, eos)
        drafts.append((toks, eos))
        return toks, logits
    drafter.propose_adaptive = spy

    def run(rng):
        holder["rng"] = drafter.rng = rng
        res = engine.generate(GenerationRequest(prompt_ids=[0], max_new_tokens=4, sampling=SamplingParams(1.0),
                                                seed=0, strategy="specdec_pp", ignore_eos=ignore_eos,
                                                options=dict(drafter="adaptive", k_max=4, threshold=0.9)))
        return tuple(res.token_ids)

    got = enumerate_outcomes(run)
    if ignore_eos:
        assert max_abs_diff(got, target_joint(target, [0], 4)) < 1e-9
        assert all(eos is None for _, eos in drafts) and any(1 in t[:-1] for t, _ in drafts)
    else:
        assert max_abs_diff(got, _target_law_until_eos(target, [0], 4, 1)) < 1e-9
        assert all(eos == 1 for _, eos in drafts) and any(t[-1] == 1 for t, _ in drafts)
        assert not any(1 in t[:-1] for t, _ in drafts)              # never a candidate after EOS
