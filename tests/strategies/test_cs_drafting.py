"""CS Drafting: greedy == target decoding on tiny HF models; exact target distribution under sampling
(exact enumeration, V = 4) with two neural drafters and MaG, lenience 1 and > 1 below the target."""
import numpy as np
import pytest
import yaml

from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest
from cluster.errors import ParamError
from cluster.models.maxgram import MagHandle
from cluster.strategies.cs_drafting import parse_kmatrix
from tests.support.exact import (
    TabularModel,
    VocabTokenizer,
    enumerate_outcomes,
    local_engine,
    max_abs_diff,
    steps_law,
    target_joint,
)


@pytest.fixture(scope="module")
def engine():
    from cluster.config.schema import config_from_dict
    from tests.support.built import engine_for
    data = yaml.safe_load(open("configs/tiny.yaml"))
    data["mag"] = {}
    return engine_for(config_from_dict(data))


PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(", "the cat sat on the mat. the cat"]


@pytest.mark.parametrize("drafters,kmatrix,lenience", [
    ("drafter-large,drafter-small,mag", "2,1,3;0,2,4;0,0,5", 1.0),
    ("drafter-large,drafter-small,mag", "1,2,0;0,1,3;0,0,2", 3.0),
    ("drafter-small,mag", "2,10;0,10", 1.0),
    ("drafter-small,mag", "3,0;0,6", 2.5),
    ("drafter-large,drafter-small", "2,2;0,3", 5.0),           # neural bottom drafter
    ("mag", "7", 1.0),
])
def test_greedy_equals_target(engine, drafters, kmatrix, lenience):
    for prompt in PROMPTS:
        base = dict(prompt=prompt, max_new_tokens=20, sampling=SamplingParams(0.0), seed=0, ignore_eos=True)
        want = engine.generate(GenerationRequest(strategy="autoregressive", **base)).token_ids
        res = engine.generate(GenerationRequest(strategy="cs_drafting", options=dict(
            drafters=drafters, kmatrix=kmatrix, lenience=lenience), **base))
        assert res.token_ids == want
        assert res.stats.target_forwards <= len(want)
        # no neural drafter above the bottom decodes autoregressively: one forward pass per review step
        assert all(m.active_requests() == [] for m in engine.models.values())


def test_default_options_and_validation(engine):
    req = dict(prompt=PROMPTS[0], max_new_tokens=8, sampling=SamplingParams(0.0), seed=0)
    res = engine.generate(GenerationRequest(strategy="cs_drafting", **req))
    assert len(res.token_ids) == 8
    for opts, needle in [(dict(drafters="drafter-small,mag", kmatrix="1,2,3;0,1,1;0,0,1"), "2x2"),
                         (dict(kmatrix="1,2;3,4"), "upper-triangular"),
                         (dict(kmatrix="1,x;0,1"), "upper-triangular"),
                         (dict(drafters="drafter-small,mag", kmatrix="0,0;0,1"), "row 0"),
                         (dict(drafters="target,mag"), "drafters"),
                         (dict(lenience=0.5), "lenience")]:
        with pytest.raises(ParamError, match=needle):
            engine.generate(GenerationRequest(strategy="cs_drafting", options=opts, **req))


def test_parse_kmatrix_forms():
    assert parse_kmatrix("2,10;0,10") == ((2, 10), (0, 10))
    assert parse_kmatrix([[2, 10], [0, 10]]) == ((2, 10), (0, 10))
    assert parse_kmatrix("[[1]]") == ((1,),)
    for bad in ("", "1,2", [[1, 2], [0]], "65", [[1.5]], [[True]]):
        with pytest.raises(ParamError):
            parse_kmatrix(bad)


def _cascade_distribution(lenience, kmatrix, sampling, vocab, budget, n=2, seed=0, batched=True):
    """Exact distribution of the first ``n`` tokens of CS Drafting steps run with a fixed per-step
    ``budget`` (so every level drafts deeply; the engine would shrink it to the tokens left), over a
    tabular target, two tabular neural drafters (``large`` reviews ``small``, which reviews MaG) and MaG."""
    from cluster.strategies import resolve_options
    target = TabularModel("target", vocab, seed=seed)
    large = TabularModel("large", vocab, seed=seed + 100, zeros=True)
    small = TabularModel("small", vocab, seed=seed + 200, zeros=True)
    mag = MagHandle(vocab, np.array([(i + 1) % vocab for i in range(vocab)]))
    models = {"target": target, "large": large, "small": small, "mag": mag}
    opts = resolve_options("cs_drafting", dict(drafters="large,small,mag", kmatrix=kmatrix, lenience=lenience), {})
    prompt = [0, 1, 0]

    return (steps_law("cs_drafting", opts, models, "target", prompt, sampling, n, budget, batched=batched),
            target_joint(target, prompt, n, sampling))


@pytest.mark.parametrize("vocab,budget,kmatrix,lenience,sampling", [
    (4, 4, "1,0,0;0,1,0;0,0,2", 1.0, SamplingParams(1.0)),      # target <- large <- small <- MaG
    (3, 4, "1,0,0;0,1,0;0,0,2", 2.5, SamplingParams(1.0)),      # lossy reviews below the target
    (3, 4, "1,1,1;0,1,1;0,0,2", 4.0, SamplingParams(1.0)),      # + horizontal cascade at every level
    (3, 4, "1,0,1;0,1,1;0,0,2", 2.0, SamplingParams(0.7, top_k=2)),
])
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "reference"])
def test_sampling_exact_target_distribution(vocab, budget, kmatrix, lenience, sampling, batched):
    """Both neural drafters review (lossy at lenience > 1), MaG proposes: the target's verdict is exact
    (handing up p instead of pi for accepted or resampled tokens breaks this by > 0.03), with the reviews through
    the batched sampler (verify_round.review_round) and through their per-row oracle."""
    got, want = _cascade_distribution(lenience, kmatrix, sampling, vocab, budget, batched=batched)
    assert max_abs_diff(got, want) < 1e-9


def test_sampling_exact_neural_bottom():
    """Without MaG the bottom drafter samples (its randomness is enumerated too)."""
    target = TabularModel("target", 3, seed=7)
    large = TabularModel("large", 3, seed=8, zeros=True)
    small = TabularModel("small", 3, seed=9)
    holder = {}
    engine = local_engine({"target": target, "large": large, "small": small}, VocabTokenizer(3),
                    rng_factory=lambda s: holder["rng"])

    def run(rng):
        holder["rng"] = large.rng = small.rng = rng
        return tuple(engine.generate(GenerationRequest(
            prompt_ids=[0], max_new_tokens=3, sampling=SamplingParams(1.0), seed=0, strategy="cs_drafting",
            options=dict(drafters="large,small", kmatrix="1,1;0,2", lenience=2.0))).token_ids)

    assert max_abs_diff(enumerate_outcomes(run), target_joint(target, [0], 3)) < 1e-9
