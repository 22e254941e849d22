"""Memory-safe admission by default (issue 30 item 4): with no ``engine.kv_budget_tokens`` the engine derives a
KV budget from the models' KV bytes per token, their weights and the device's memory; long prompts past it
wait, and one that can never fit is refused (RESOURCE_EXHAUSTED / 429) naming the limit."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from cluster.config.schema import config_from_dict, load_config
from cluster.core.model_set import ModelSet
from cluster.engine.engine import Engine
from cluster.engine.kv_budget import GIB, derive_kv_budget
from cluster.engine.request import GenerationRequest
from cluster.errors import ConfigError, OverloadedError
from cluster.models.build import build_handles, load_tokenizer
from cluster.serving.ops.error_table import classify

CFG = load_config("configs/tiny.yaml")
ROOM = 1000          # KV positions the test's memory leaves after the weights


@pytest.fixture(scope="module")
def handles():
    return build_handles(CFG)


def _by_hand(handles) -> tuple[int, int]:
    """(weight bytes, KV bytes per token) of every neural model, from the models themselves: 2 x layers x
    kv heads x head_dim x 4 bytes (float32), and every parameter's bytes."""
    weights = kv = 0
    for h in handles.values():
        model = getattr(h, "model", None)
        if model is None:
            continue
        c = model.config
        kv += 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4
        weights += sum(p.numel() * 4 for p in model.parameters())
    return weights, kv


def test_budget_is_what_the_memory_leaves_after_the_weights(handles):
    weights, kv = _by_hand(handles)
    assert kv == 2 * (4 + 2 + 1) * 4 * 16 * 4        # target 4 layers, drafters 2 and 1: 64 hidden, 4 heads
    memory_gib = (weights + ROOM * kv) / 0.9 / GIB
    assert derive_kv_budget(handles, fraction=0.9, memory_gib=memory_gib) == ROOM
    assert derive_kv_budget(handles, fraction=0.45, memory_gib=2 * memory_gib) == ROOM
    detected = derive_kv_budget(handles)             # this machine's RAM: far more than the tiny models need
    assert detected is not None and detected > 100_000


def test_no_room_after_the_weights_is_a_config_error(handles):
    weights, _ = _by_hand(handles)
    with pytest.raises(ConfigError, match="engine.kv_memory_fraction .* leaves no room for KV"):
        derive_kv_budget(handles, fraction=0.5, memory_gib=weights / GIB)


def test_handles_without_reports_give_no_budget():
    assert derive_kv_budget({"mag": SimpleNamespace(memory=None)}) is None      # declared: no report


def _engine(handles, **engine):
    cfg = dataclasses.replace(CFG, engine=dataclasses.replace(CFG.engine, max_batch=4, **engine))
    return Engine.configured(ModelSet.assemble(handles, cfg.target), load_tokenizer(cfg), cfg.engine)


def test_long_prompts_queue_past_the_derived_budget_and_one_too_long_is_refused(handles):
    weights, kv = _by_hand(handles)
    engine = _engine(handles, device_memory_gib=(weights + ROOM * kv) / 0.9 / GIB)
    assert engine.scheduler.limits.kv_budget_tokens == ROOM
    prompt = [5 + i % 250 for i in range(450)]         # 450 + 16 + 1 = 467 positions each: two fit in 1000
    seqs = [engine.add(GenerationRequest(prompt_ids=prompt, max_new_tokens=16, seed=i, ignore_eos=True,
                                         strategy="autoregressive")) for i in range(3)]
    engine.step()
    assert [s.status for s in seqs] == ["running", "running", "waiting"]    # the third waits for room
    assert engine.scheduler.kv_reserved <= ROOM
    while any(s.status != "finished" for s in seqs):
        engine.step()
        assert engine.scheduler.kv_reserved <= ROOM
    assert all(s.error is None and len(s.generated) == 16 for s in seqs)
    with pytest.raises(OverloadedError) as e:       # 900 + 120 + 1 > 1000 (within the model's 1024): never fits
        engine.add(GenerationRequest(prompt_ids=[5 + i % 250 for i in range(900)], max_new_tokens=120,
                                     strategy="autoregressive"))
    assert "engine.kv_budget_tokens = 1000" in str(e.value)
    kind = classify(e.value)
    assert (kind.grpc_code, kind.http_status) == ("RESOURCE_EXHAUSTED", 429)


def test_a_configured_budget_wins_over_the_derived_one(handles):
    assert _engine(handles, kv_budget_tokens=777).scheduler.limits.kv_budget_tokens == 777


@pytest.mark.parametrize("field,value,needle", [
    ("kv_memory_fraction", 0, "engine.kv_memory_fraction: must be in (0, 1], got 0"),
    ("kv_memory_fraction", 1.5, "engine.kv_memory_fraction: must be in (0, 1], got 1.5"),
    ("device_memory_gib", -1, "engine.device_memory_gib: must be in (0, 1048576]"),
])
def test_memory_fields_validated_by_name(field, value, needle):
    with pytest.raises(ConfigError) as e:
        config_from_dict({"models": {"target": {"tiny": {}}}, "engine": {field: value}})
    assert needle in str(e.value)
