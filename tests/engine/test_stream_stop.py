"""Streaming with stop strings: the chunks' token ids concatenate to the result's ids for every strategy,
also when a stop string ends generation in the middle of a multi-token step (an accepted block)."""
from __future__ import annotations

import numpy as np
import pytest

from cluster.core.sampling import Rng, SamplingParams
from cluster.engine.request import GenerationRequest
from cluster.models.maxgram import MagHandle
from cluster.models.suffix import SuffixHandle
from cluster.strategies import REGISTRY
from tests.support.adaptive import AdaptiveTabular
from tests.support.exact import TabularModel, VocabTokenizer
from tests.support.exact import local_engine

V = 4
CASES = {
    "autoregressive": {},
    "speculative": dict(drafter="drafter", k=4),
    "mag": dict(k=4),
    "cs_drafting": dict(drafters="drafter,small,mag", kmatrix="1,1,2;0,1,2;0,0,3"),
    "specdec_pp": dict(drafter="adaptive", k_max=5, threshold=0.9),
    "spec_cascade": dict(drafter="drafter", k=4, rule="token_v3", alpha=0.3),
    "lossy": dict(drafter="drafter", k=4, alpha=0.5, beta=1.0, bonus="pi"),
    "token_cascade": dict(drafter="drafter", alpha=0.7),
    "oracle_cascade": dict(drafter="drafter", rule="diff", alpha=0.1),
    "suffix": dict(k=4),
}
SINGLE_TOKEN_STEPS = {"autoregressive", "oracle_cascade"}


def _engine():
    models = {"target": TabularModel("target", V, seed=1),
              "drafter": TabularModel("drafter", V, seed=2),
              "small": TabularModel("small", V, seed=3),
              "adaptive": AdaptiveTabular("adaptive", V, seed=2, accept=0.97),
              "mag": MagHandle(V, np.array([1, 2, 3, 0])), "suffix": SuffixHandle(V)}
    return local_engine(models, VocabTokenizer(V)), models


def _stream(engine, models, strategy, options, seed, stop=()):
    for m in models.values():
        if isinstance(m, TabularModel):
            m.rng = Rng(seed + 7)                # the drafters' own draws, replayed identically
    chunks = list(engine.stream(GenerationRequest(prompt_ids=[0, 1, 2, 3, 0, 1], max_new_tokens=40, seed=seed,
                                                  sampling=SamplingParams(1.0), strategy=strategy,
                                                  options=options, stop=stop)))
    return chunks, chunks[-1].result


def test_every_strategy_is_covered():
    assert set(CASES) == set(REGISTRY)


@pytest.mark.parametrize("strategy", sorted(CASES))
def test_streamed_ids_concatenate_to_result_when_a_stop_string_lands_mid_block(strategy):
    engine, models = _engine()
    landed_mid_block = 0
    for seed in range(6):
        if strategy == "suffix":
            engine, models = _engine()
        chunks, full = _stream(engine, models, strategy, CASES[strategy], seed)
        assert [t for c in chunks for t in c.token_ids] == full.token_ids and len(full.token_ids) == 40
        # cut inside the first step that emitted >= 2 tokens (or after the third token of one-token steps)
        start, cut = 0, 3
        for c in chunks:
            if len(c.token_ids) >= 2 and start >= 1:
                cut = start + 1                  # keep the block's first token only
                break
            start += len(c.token_ids)
        text = engine.tokenizer.decode(full.token_ids[:cut])   # one letter per token
        n = next(n for n in range(1, cut + 1) if text[cut - n:] not in text[:cut - 1])
        stop = text[cut - n:]                    # the shortest suffix that first occurs ending at ``cut``
        if strategy == "suffix":     # its index remembers the first run's output, which changes its drafts
            engine, models = _engine()
        chunks, res = _stream(engine, models, strategy, CASES[strategy], seed, stop=(stop,))
        streamed = [t for c in chunks for t in c.token_ids]
        assert res.finish_reason == "stop" and res.token_ids == full.token_ids[:cut]
        assert streamed == res.token_ids, (strategy, seed, [c.token_ids for c in chunks])
        assert "".join(c.text for c in chunks) == res.text == text[:cut - n]      # the stop string is cut
        assert chunks[-1].token_ids, "the last chunk carries the ids of its step up to the stop string"
        assert res.stats.generated_tokens == len(res.token_ids)
        landed_mid_block += cut == start + 1
    if strategy not in SINGLE_TOKEN_STEPS:
        assert landed_mid_block >= 3             # the stop string really fell inside accepted blocks
