"""SpecDec++: the stopping rule, head training, and h = 1 == fixed k at the cap; greedy == target."""
import pytest
import torch

from cluster.core.draft.stop import stop_after
from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest
from cluster.family.heads import fit_head, make_features, sample_responses
from cluster.models.head import AcceptanceHead, load_head, save_head

PROMPT = "def add(a, b):\n    return a + b\n"


def test_stop_after_rule():
    # keep = 0.9 -> 0.72 -> 0.36: 1 - keep exceeds 0.3 first at i = 4 (after candidate 3's prediction)
    assert stop_after([0.9, 0.8, 0.5, 0.9], 0.3, 10) == 4
    assert stop_after([0.5], 0.3, 10) == 2
    assert stop_after([0.99] * 20, 0.5, 6) == 6              # the hard cap
    assert stop_after([0.0] * 20, 1.0, 7) == 7               # h = 1: never stops early
    assert stop_after([], 0.0, 1) == 1


def _const_head(hidden, prob):
    head = AcceptanceHead(hidden, depth=1)
    with torch.no_grad():
        for prm in head.parameters():
            prm.zero_()
        head.out.bias.fill_(float(torch.logit(torch.tensor(prob))))
    return head.eval()


@pytest.mark.parametrize("prob,threshold,k_max,want", [(0.8, 0.5, 10, 5), (0.5, 0.3, 10, 2), (0.95, 0.99, 6, 6)])
def test_worker_propose_adaptive_follows_rule(tiny_engine, prob, threshold, k_max, want):
    """A head predicting a constant acceptance a stops at the first i >= 2 with 1 - a^(i-1) > h."""
    w = tiny_engine.models["drafter-large"]
    head = _const_head(w.model.config.hidden_size, prob)
    assert stop_after([prob] * k_max, threshold, k_max) == want
    w.prefill("sd", list(PROMPT.encode()), SamplingParams(1.0), 0)
    try:
        toks, logits = w.propose_adaptive("sd", k_max, head, threshold)
        assert len(toks) == want and logits.shape == (want, w.vocab_size) and w.length("sd") == len(PROMPT) + want
    finally:
        w.release("sd")


def test_threshold_one_is_fixed_k_at_cap(tiny_engine, tmp_path, monkeypatch):
    head_dir = save_head(_const_head(tiny_engine.models["drafter-large"].model.config.hidden_size, 0.1), tmp_path / "h")
    monkeypatch.setattr(tiny_engine.models["drafter-large"], "specdec_head", str(head_dir), raising=False)
    base = dict(prompt=PROMPT, max_new_tokens=24, sampling=SamplingParams(0.0), seed=3, ignore_eos=True)
    ar = tiny_engine.generate(GenerationRequest(strategy="autoregressive", **base))
    fixed = tiny_engine.generate(GenerationRequest(strategy="speculative",
                                                   options=dict(drafter="drafter-large", k=5), **base))
    pp = tiny_engine.generate(GenerationRequest(strategy="specdec_pp", options=dict(
        drafter="drafter-large", k_max=5, threshold=1.0, head="drafter-large"), **base))
    assert pp.token_ids == fixed.token_ids == ar.token_ids
    assert (pp.stats.target_forwards, pp.stats.drafted_tokens, pp.stats.accepted_hist) == \
        (fixed.stats.target_forwards, fixed.stats.drafted_tokens, fixed.stats.accepted_hist)
    eager = tiny_engine.generate(GenerationRequest(strategy="specdec_pp", options=dict(
        drafter="drafter-large", k_max=5, threshold=0.5), **base))             # default: the drafter's head
    assert eager.token_ids == ar.token_ids
    assert len(eager.stats.drafted_per_pos) == 2            # predicted acceptance 0.1: stop after 2 candidates


def test_training_lowers_loss_and_roundtrips(tiny_engine, tmp_path):
    target = tiny_engine.models["target"].model
    drafter = tiny_engine.models["drafter-small"].model
    prompts = [list(PROMPT.encode())[:16], list(b"import os\nimport sys\n")[:16]] * 4
    seqs = sample_responses(target, prompts, 24, seed=0)
    feats, labels = make_features(target, drafter, seqs, 16, draws=2, mix=0.3, seed=1)
    assert feats.shape == (len(labels), drafter.config.hidden_size) and 0 < len(labels) <= 8 * 24 * 2
    assert bool(((labels >= 0) & (labels <= 1)).all())
    head, info = fit_head(feats, labels, depth=2, w_rej=3.0, epochs=30, progress=False)
    assert info["loss_after"] < info["loss_before"] - 0.05
    loaded = load_head(save_head(head, tmp_path / "head"))
    assert torch.allclose(loaded(feats[:5]), head(feats[:5]))


def test_missing_head_is_a_param_error(tiny_engine):
    from cluster.errors import ParamError
    with pytest.raises(ParamError, match="head"):
        tiny_engine.generate(GenerationRequest(prompt="x", max_new_tokens=2, strategy="specdec_pp",
                                               options=dict(drafter="drafter-large")))
