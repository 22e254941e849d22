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


@pytest.mark.parametrize("strategy", ["speculative", "autoregressive"])
def test_a_batch_opening_with_one_system_prompt_computes_it_once(strategy):
    """Four requests admitted together with one system prompt (nothing cached yet): the target and the drafter
    prefill it for the first and copy it to the others (shared_in_batch), and every output equals the uncached
    engine's, batched; a request of another cache_salt shares nothing."""
    on, off = _engine("on"), _engine("off")
    system = list(range(3, 3 + 5 * BLOCK + 7))
    fed: dict[str, list[int]] = {}
    for name, worker in on.models.items():
        if hasattr(worker, "_forward"):
            real = worker._forward

            def counting(reqs, *a, _real=real, _name=name, **kw):
                ends = kw.get("ends") or [len(r.tokens) for r in reqs]
                fed.setdefault(_name, []).append(sum(e - r.cached for r, e in zip(reqs, ends)))
                return _real(reqs, *a, **kw)
            worker._forward = counting

    def reqs(salts):
        return [GenerationRequest(prompt_ids=system + [60 + i, 61, 62 + i], max_new_tokens=8, strategy=strategy,
                                  sampling=SamplingParams(0.0), ignore_eos=True, cache_salt=s, request_id=f"r{i}")
                for i, s in enumerate(salts)]
    salts = [None, None, None, "tenant-b"]
    results = on.generate_many(reqs(salts))
    assert [r.token_ids for r in results] == [r.token_ids for r in off.generate_many(reqs(salts))]
    P = len(system) + 2                                   # prefilled tokens a request (its last one stays pending)
    shared = len(system) // BLOCK * BLOCK
    target = fed[on.target][:2]                           # the prefill: leaders, then the followers' rest
    assert target == [2 * P, 2 * (P - shared)]            # leaders: the first and tenant-b's; two followers
    assert [r.stats.cached_tokens for r in results] == [0, shared, shared, 0]


def test_each_model_reports_its_cache_size_and_an_uncached_one_none():
    """cache_info (ServerInfo's per-model figures): after a request, the target and the drafter hold its prompt's
    full blocks in a kept slot; the draft side lists its members'; caching off reports nothing."""
    on, off = _engine("on"), _engine("off")
    ids = list(range(3, 3 + 3 * BLOCK + 5))
    for eng in (on, off):
        eng.generate(GenerationRequest(prompt_ids=ids, max_new_tokens=6, strategy="speculative",
                                       sampling=SamplingParams(0.0), ignore_eos=True))
    target = on.models[on.target].cache_info()
    assert target["tokens"] >= 3 * BLOCK and target["slots"] == 1
    side = on.models["@drafts"].cache_info()["members"]
    assert any(info.get("tokens", 0) >= 3 * BLOCK for info in side.values())
    assert off.models[off.target].cache_info() == {}
