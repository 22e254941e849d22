"""CS Drafting's published readings beside ours (Chen et al., *Cascade Speculative Drafting for Even Faster LLM
Inference*): K-matrix entries as review steps (ours) or as tokens (the paper's step loop), lenience on Max-Gram
drafts on (ours) or off (the paper's appendix B) -- every combination exact at the target under sampling."""
import numpy as np
import pytest
import yaml

from cluster.config.schema import MagSpec, config_from_dict
from cluster.core.sampling import Rng, SamplingParams
from cluster.engine.request import GenerationRequest
from cluster.errors import ParamError
from cluster.models.maxgram import MagHandle
from cluster.strategies import resolve_options
from tests.support.built import engine_for
from tests.support.exact import (
    TabularModel,
    VocabTokenizer,
    local_engine,
    max_abs_diff,
    steps_law,
    target_joint,
)


def _models(vocab, seed, occurrence="recent"):
    return {"target": TabularModel("target", vocab, seed=seed),
            "large": TabularModel("large", vocab, seed=seed + 100, zeros=True),
            "small": TabularModel("small", vocab, seed=seed + 200, zeros=True),
            "mag": MagHandle(vocab, np.array([(i + 1) % vocab for i in range(vocab)]), occurrence=occurrence,
                             max_ngram=0 if occurrence == "first" else 24)}


def _distribution(options, sampling, vocab, budget, n=2, seed=0, occurrence="recent"):
    """Exact law of the first ``n`` tokens of CS Drafting steps with a fixed per-step ``budget``."""
    models = _models(vocab, seed, occurrence)
    opts = resolve_options("cs_drafting", dict(drafters="large,small,mag", **options), {})
    prompt = [0, 1, 0]

    return (steps_law("cs_drafting", opts, models, "target", prompt, sampling, n, budget),
            target_joint(models["target"], prompt, n, sampling))


@pytest.mark.parametrize("unit,mag_lenience,kmatrix,lenience,vocab,sampling,occurrence", [
    ("tokens", "on", "2,0,0;0,2,0;0,0,2", 2.5, 3, SamplingParams(1.0), "recent"),
    ("tokens", "off", "2,0,0;0,1,1;0,0,2", 3.0, 3, SamplingParams(1.0), "recent"),
    ("reviews", "off", "1,0,1;0,1,1;0,0,2", 4.0, 3, SamplingParams(1.0), "first"),
    ("tokens", "off", "1,0,1;0,2,1;0,0,2", 2.0, 3, SamplingParams(0.7, top_k=2), "first"),
])
def test_variants_are_exact_at_the_target(unit, mag_lenience, kmatrix, lenience, vocab, sampling, occurrence):
    got, want = _distribution(dict(kmatrix=kmatrix, lenience=lenience, kmatrix_unit=unit, mag_lenience=mag_lenience),
                              sampling, vocab, budget=4, occurrence=occurrence)
    assert max_abs_diff(got, want) < 1e-9


def _spy_run(unit, kmatrix="3,0;0,4", seed=0, new=40):
    """Per target step: (review calls of ``small``, draft length the target verified)."""
    models = {k: v for k, v in _models(4, 3).items() if k != "large"}
    models["small"].rng = Rng(seed)
    log, reviews = [], [0]
    small_score, target_score = models["small"].score, models["target"].score

    def small(rid, draft):
        reviews[0] += 1
        return small_score(rid, draft)

    def target(rid, draft):
        log.append((reviews[0], len(draft)))
        reviews[0] = 0
        return target_score(rid, draft)
    models["small"].score, models["target"].score = small, target
    engine = local_engine(models, VocabTokenizer(4))
    res = engine.generate(GenerationRequest(prompt_ids=[0, 1, 2, 3, 0, 1], max_new_tokens=new, seed=seed,
                                            sampling=SamplingParams(1.0), strategy="cs_drafting",
                                            options=dict(drafters="small,mag", kmatrix=kmatrix, kmatrix_unit=unit)))
    return log, res


def test_kmatrix_units_count_review_steps_or_tokens():
    ours, _ = _spy_run("reviews")
    paper, _ = _spy_run("tokens")
    # (review calls, draft length) per target step; in the last steps the budget (tokens left) cuts drafts short
    assert all(r == 3 for r, L in ours[:-4] if L >= 3)            # exactly K[0][0] = 3 review steps
    assert all(r <= 3 and (L >= 3 or r == 0 or L == r) for r, L in paper)   # reviews until >= 3 tokens
    assert any(r < 3 and L >= 3 for r, L in paper)                # a review that emitted several tokens ends it
    # fewer review calls per token verified: per seed the sample paths differ, so over four of them
    runs = {unit: [_spy_run(unit, seed=s)[0] for s in range(4)] for unit in ("reviews", "tokens")}
    calls = {unit: sum(r for log in logs for r, _ in log) for unit, logs in runs.items()}
    assert calls["tokens"] < calls["reviews"], calls


def test_mag_lenience_off_keeps_reviews_of_mag_tokens_strict():
    """Greedy, lenience 1000: with lenience on MaG tokens every MaG token is accepted by the reviewer (q = 1 <=
    l p); off, only the reviewer's argmax -- so the drafts the target sees differ, and both equal the target."""
    data = yaml.safe_load(open("configs/tiny.yaml"))
    data["mag"] = {}
    engine = engine_for(config_from_dict(data))
    base = dict(prompt="def add(a, b):\n    return a + b\n\ndef add(", max_new_tokens=24,
                sampling=SamplingParams(0.0), seed=0, ignore_eos=True)
    want = engine.generate(GenerationRequest(strategy="autoregressive", **base)).token_ids
    stats = {}
    for ml in ("on", "off"):
        for unit in ("reviews", "tokens"):
            res = engine.generate(GenerationRequest(strategy="cs_drafting", options=dict(
                drafters="drafter-small,mag", kmatrix="2,2;0,6", lenience=1000.0, mag_lenience=ml,
                kmatrix_unit=unit), **base))
            assert res.token_ids == want, (ml, unit)
            stats[(ml, unit)] = res.stats
    on, off = stats[("on", "reviews")], stats[("off", "reviews")]
    assert on.drafted_tokens != off.drafted_tokens or on.accepted_tokens != off.accepted_tokens


@pytest.mark.parametrize("options,pattern", [
    (dict(kmatrix_unit="steps"), r"invalid kmatrix_unit: 'steps' \(allowed: one of tokens, reviews\)"),
    (dict(mag_lenience="no"), r"invalid mag_lenience: 'no' \(allowed: one of off, on\)"),
])
def test_option_errors(options, pattern):
    models = _models(3, 0)
    engine = local_engine(models, VocabTokenizer(3))
    with pytest.raises(ParamError, match=pattern):
        engine.generate(GenerationRequest(prompt_ids=[0], max_new_tokens=2, strategy="cs_drafting", options=options))


def test_named_defaults():
    """The defaults the README's strategy table names: the paper's K-matrix reading and lenience setting, ours for
    the Max-Gram occurrence (a served drafter's config) and GenSpecSample's bonus."""
    cs = resolve_options("cs_drafting", {}, {})
    assert (cs["kmatrix_unit"], cs["mag_lenience"]) == ("tokens", "off")
    assert resolve_options("spec_cascade", {}, {})["bonus"] == "p"
    lossy = resolve_options("lossy", {}, {})
    assert (lossy["beta"], lossy["bonus"]) == ("solve", "p")
    assert (MagSpec().occurrence, MagSpec().max_ngram) == ("recent", 24)
