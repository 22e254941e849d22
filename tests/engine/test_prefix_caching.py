"""``engine.prefix_caching``: a conversation's later turns find their history in the target's and drafters'
caches (usage counts it), and every output equals the uncached engine's (greedy, speculative and plain)."""
from __future__ import annotations

import dataclasses

import pytest

from cluster.config.schema import load_config
from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest
from cluster.errors import ConfigError
from cluster.models.prefix_cache import BLOCK
from tests.support.built import engine_for


def _engine(caching: str):
    cfg = load_config("configs/tiny.yaml")
    return engine_for(dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, prefix_caching=caching)))


@pytest.mark.parametrize("strategy", ["speculative", "autoregressive"])
def test_later_turns_hit_the_cache_and_outputs_equal_the_uncached_engines(strategy):
    on, off = _engine("on"), _engine("off")
    system = list(range(3, 3 + 2 * BLOCK + 5))
    histories = {"on": list(system), "off": list(system)}
    for turn in range(3):
        outs = {}
        for name, eng in (("on", on), ("off", off)):
            ids = histories[name] + [40 + turn, 41 + turn, 42]
            res = eng.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=12, strategy=strategy,
                                                 sampling=SamplingParams(0.0), ignore_eos=True))
            outs[name] = res
            histories[name] = ids + res.token_ids
        assert outs["on"].token_ids == outs["off"].token_ids
        assert outs["off"].stats.cached_tokens == 0
        want = 0 if turn == 0 else (len(histories["on"]) - 12 - 3 - 1) // BLOCK * BLOCK
        assert want <= outs["on"].stats.cached_tokens <= outs["on"].stats.prompt_tokens - 1
        if turn:
            assert outs["on"].stats.cached_tokens >= 2 * BLOCK


def test_the_setting_is_validated_with_its_name():
    cfg = load_config("configs/tiny.yaml")
    with pytest.raises(ConfigError, match=r"engine.prefix_caching.*on, off.*'sometimes'"):
        dataclasses.replace(cfg.engine, prefix_caching="sometimes").validate("engine")
