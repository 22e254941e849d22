"""The target's logprobs of every emitted token, whatever strategy produced it (issue 21, item 5).

Oracles: autoregressive decoding's logprobs (greedy speculative decoding emits the same tokens, so it must
report the same numbers), and ``log_softmax`` of one full forward of the target over prompt + output (no
cache), which holds under sampling and for lossy strategies too (they report the target's numbers).
"""
import math

import pytest
import torch
import yaml

from cluster.config.schema import config_from_dict
from cluster.core.logprobs import token_logprobs
from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest
from cluster.models.head import save_head
from tests.strategies.test_specdec_pp import _const_head
from tests.support.built import engine_for
from tests.support.tolerance import assert_logprobs_close

PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(", "the cat sat on the mat. the cat", "import os\n"]
LOSSLESS = [("speculative", dict(drafter="drafter-large", k=3)),
            ("speculative", dict(drafter="drafter-small", k=5, verify="block")),
            ("mag", dict(k=4)), ("mag", dict(k=3, verify="block")),
            ("cs_drafting", dict(drafters="drafter-large,drafter-small,mag", kmatrix="2,1,3;0,2,4;0,0,5")),
            ("cs_drafting", dict(drafters="drafter-small,mag", kmatrix="2,10;0,10", lenience=3.0))]
LOSSY = [("spec_cascade", dict(k=4)), ("lossy", dict(k=3, alpha=0.3)), ("token_cascade", dict(alpha=0.5)),
         ("oracle_cascade", {}), ("spec_cascade", dict(k=3, bonus="pi"))]
TOP = 5


@pytest.fixture(scope="module")
def engine():
    data = yaml.safe_load(open("configs/tiny.yaml"))
    data["mag"] = {}
    return engine_for(config_from_dict(data))


def _req(prompt, strategy, options, temperature=0.0, max_new=24, **kw):
    return GenerationRequest(prompt=prompt, max_new_tokens=max_new, sampling=SamplingParams(temperature, **kw),
                             seed=5, strategy=strategy, options=options, ignore_eos=True, logprobs=TOP)


_close = assert_logprobs_close          # float32 over other forward shapes: see tests/support/tolerance.py


def _full_forward(engine, prompt, res):
    """The target's logprobs of ``res``'s tokens from one forward over prompt + output, no cache."""
    prompt = engine.tokenizer.encode(prompt)
    ids = prompt + res.token_ids
    with torch.no_grad():
        logits = engine.models["target"].model(input_ids=torch.tensor([ids])).logits[0]     # [P+N, V]
    return token_logprobs(logits[len(prompt) - 1:-1], res.token_ids, TOP)


def _run(engine, prompt, strategy, options, **kw):
    return engine.generate(_req(prompt, strategy, options, **kw))


@pytest.mark.parametrize("strategy,options", LOSSLESS)
def test_greedy_logprobs_equal_autoregressive(engine, strategy, options):
    for prompt in PROMPTS:
        want = _run(engine, prompt, "autoregressive", {})
        got = _run(engine, prompt, strategy, options)
        assert got.token_ids == want.token_ids and len(got.logprobs) == len(got.token_ids) == 24
        _close(got.logprobs, want.logprobs)


def test_greedy_logprobs_equal_autoregressive_batched(engine):
    """Mixed strategies in one batch, one request joining after the others have run two steps."""
    want = {p: _run(engine, p, "autoregressive", {}).logprobs for p in PROMPTS}
    reqs = [(p, s, o) for (s, o), p in zip(LOSSLESS, PROMPTS * 2)]
    seqs = [engine.add(_req(p, s, o)) for p, s, o in reqs[:-1]]
    engine.step(), engine.step()
    seqs.append(engine.add(_req(*reqs[-1])))
    while engine.has_work:
        engine.step()
    for seq, (prompt, _, _) in zip(seqs, reqs):
        _close(seq.result.logprobs, want[prompt])


def test_specdec_pp_logprobs_equal_autoregressive(engine, tmp_path, monkeypatch):
    drafter = engine.models["drafter-large"]
    head = save_head(_const_head(drafter.model.config.hidden_size, 0.7), tmp_path / "h")
    monkeypatch.setattr(drafter, "specdec_head", str(head), raising=False)
    want = _run(engine, PROMPTS[0], "autoregressive", {})
    got = _run(engine, PROMPTS[0], "specdec_pp", dict(drafter="drafter-large", k_max=6, threshold=0.5))
    _close(got.logprobs, want.logprobs)


@pytest.mark.parametrize("strategy,options", [("autoregressive", {})] + LOSSLESS[:3] + LOSSLESS[4:5] + LOSSY)
def test_sampled_logprobs_are_the_targets_full_forward(engine, strategy, options):
    """Under sampling (T = 1.3, top-p 0.9: not applied to the reported numbers) and for lossy strategies."""
    res = _run(engine, PROMPTS[1], strategy, options, temperature=1.3, top_p=0.9, max_new=20)
    assert len(res.logprobs) == len(res.token_ids) == 20
    _close(res.logprobs, _full_forward(engine, PROMPTS[1], res))


def test_top_n_sorted_and_consistent(engine):
    res = _run(engine, PROMPTS[0], "speculative", dict(k=4), temperature=1.0, max_new=30)
    for lp in res.logprobs:
        values = [v for _, v in lp.top]
        assert len(lp.top) == TOP and values == sorted(values, reverse=True)
        assert lp.logprob <= values[0] + 1e-6 and math.fsum(math.exp(v) for v in values) <= 1 + 1e-5
        ranks = dict(lp.top)
        if lp.token_id in ranks:
            assert abs(ranks[lp.token_id] - lp.logprob) < 1e-6
        else:
            assert lp.logprob <= values[-1] + 1e-6


def test_stream_chunks_align_with_ids_under_stop_and_budget(engine):
    """EOS / stop strings / max_new_tokens cut a block mid-way: logprobs are cut with the ids."""
    full = _run(engine, PROMPTS[0], "autoregressive", {}, max_new=30)
    text = engine.tokenizer.decode(full.token_ids)
    stop = text[len(text) // 2: len(text) // 2 + 2]
    req = _req(PROMPTS[0], "speculative", dict(k=6), max_new=30)
    req.stop = (stop,)
    chunks = list(engine.stream(req))
    res = chunks[-1].result
    assert res.finish_reason == "stop" and len(res.token_ids) < 30
    assert [lp for c in chunks for lp in c.logprobs] == res.logprobs
    assert [c_id for c in chunks for c_id in c.token_ids] == res.token_ids == full.token_ids[:len(res.token_ids)]
    _close(res.logprobs, full.logprobs[:len(res.token_ids)])
    cut = engine.generate(_req(PROMPTS[0], "speculative", dict(k=6), max_new=7))        # budget inside a block
    _close(cut.logprobs, full.logprobs[:7])


def test_no_logprobs_unless_asked(engine):
    req = _req(PROMPTS[2], "speculative", dict(k=3), max_new=6)
    req.logprobs = None
    chunks = list(engine.stream(req))
    assert all(c.logprobs is None for c in chunks) and chunks[-1].result.logprobs is None


def test_token_cascade_runs_without_deferral_are_scored_without_changing_them(engine):
    """alpha = 1 never defers: each step is a drafter run the target never saw; asking for logprobs adds one
    target pass per run and leaves the tokens as they were."""
    opts = dict(drafter="drafter-small", alpha=1.0)
    res = _run(engine, PROMPTS[0], "token_cascade", opts, temperature=1.0, max_new=40)
    plain = engine.generate(GenerationRequest(prompt=PROMPTS[0], max_new_tokens=40, sampling=SamplingParams(1.0),
                                              seed=5, strategy="token_cascade", options=opts, ignore_eos=True))
    assert res.token_ids == plain.token_ids and plain.stats.target_forwards == 0
    assert res.stats.target_forwards == 2                   # one pass per run: MAX_RUN = 32 tokens, then 8
    _close(res.logprobs, _full_forward(engine, PROMPTS[0], res))


def test_eos_cut_mid_block_keeps_logprobs_aligned():
    """Tabular target (its law known exactly, EOS = token 2): an EOS inside an accepted block ends the
    request; the logprobs kept are those of the ids kept, each log p_target(token | prefix)."""
    from tests.support.exact import local_engine
    from tests.support.exact import TabularModel, VocabTokenizer

    class EosTokenizer(VocabTokenizer):
        eos_token_id = 2
    from cluster.core.sampling import Rng
    target, drafter = TabularModel("target", 4, seed=1), TabularModel("drafter", 4, seed=2, rng=Rng(0))
    engine = local_engine({"target": target, "drafter": drafter}, EosTokenizer(4))
    prompt, reasons = [0, 1, 3, 0, 1], []
    for seed in range(60):
        res = engine.generate(GenerationRequest(prompt_ids=prompt, max_new_tokens=30, seed=seed, logprobs=2,
                                                prompt_logprobs=1, sampling=SamplingParams(1.0), options={"k": 4}))
        s = res.stats                  # steps emit accepted + 1 each; beyond the ids kept and the EOS: cut mid-block
        reasons.append((res.finish_reason, s.accepted_tokens + s.steps > len(res.token_ids) + 1))
        assert [lp.token_id for lp in res.logprobs] == res.token_ids and 2 not in res.token_ids
        seq, lps = prompt + res.token_ids, res.prompt_logprobs + res.logprobs      # both aligned with seq
        assert lps[0] is None and len(lps) == len(seq)
        for i, lp in enumerate(lps[1:], start=1):
            want = float(torch.log_softmax(target.logits(seq[:i]), -1)[seq[i]])
            assert abs(lp.logprob - want) < 1e-6 and len(lp.top) == (1 if i < len(prompt) else 2)
    assert reasons.count(("eos", True)) >= 5
