"""What the batched worker serves and how far: sliding-window masks against transformers' own mask functions,
refusal at load of what cannot be served exactly, and context limits (each architecture's position limit,
a too-long request refused with a ParamError naming ``prompt`` for the target and for a shorter drafter)."""
from __future__ import annotations

import pytest
import torch
import transformers as tf
from transformers.masking_utils import causal_mask_function, sdpa_mask, sliding_window_causal_mask_function

from cluster.config.schema import config_from_dict
from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest
from cluster.errors import ConfigError, ParamError
from cluster.local import build_engine
from cluster.models.batched import BatchedHFWorker
from cluster.models.build import build_handle
from cluster.models.support import FULL, SLIDING, AttentionLayout, build_masks
from tests.support.architectures import CONFIGS, tiny_model, write_checkpoint

torch.set_num_threads(1)


@pytest.mark.parametrize("window", [1, 3, 8])
def test_masks_match_transformers_per_row(window):
    """Row b of a ragged batch (offsets_b cached, n new) sees exactly what transformers' sdpa_mask gives a
    single sequence whose queries start at offsets_b, for full and sliding layers."""
    layout = AttentionLayout((SLIDING, FULL), {SLIDING: window}, mapping=True)
    offsets, n = [0, 5, 17, 2], 4
    length = max(offsets) + n
    masks = build_masks(layout, offsets, n, length, torch.float32, "cpu")
    assert set(masks) == {FULL, SLIDING} and masks[FULL].shape == (4, 1, n, length)
    for kind, fn in ((FULL, causal_mask_function), (SLIDING, sliding_window_causal_mask_function(window))):
        for b, off in enumerate(offsets):
            want = sdpa_mask(batch_size=1, q_length=n, kv_length=length, q_offset=off, mask_function=fn,
                             allow_is_causal_skip=False)[0, 0]                               # [n, T] bool
            assert torch.equal(masks[kind][b, 0] == 0, want), (kind, b)
    single = AttentionLayout((SLIDING, SLIDING), {SLIDING: window}, mapping=False)
    assert torch.equal(build_masks(single, offsets, n, length, torch.float32, "cpu"), masks[SLIDING])


def test_sliding_logits_match_and_window_matters():
    """Scored logits of a mixed sliding/global model equal transformers' no-cache forward to 1e-4 over a
    context 5x its window, under rollback; a layout with the window one off either way does not."""
    model = tiny_model("gemma3")
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.inference_mode():
        want = model(input_ids=torch.tensor([ids])).logits[0]                      # [40, V]
    worker = BatchedHFWorker(model, "g")
    assert worker.layout.windows == {SLIDING: 8} and worker.layout.mapping
    g = SamplingParams(0.0)
    worker.prefill_batch([("a", ids[:3], g, 0), ("b", ids[:11], g, 0)])
    worker.score_batch([("a", ids[3:30]), ("b", [1, 2, 3])])
    worker.rollback("a", 20)                                                     # drop 10 tokens, rescore them
    worker.rollback("b", 11)
    got = worker.score_batch([("a", ids[20:]), ("b", ids[11:])])
    assert (got[0] - want[19:]).abs().max() < 1e-4 and (got[1] - want[10:]).abs().max() < 1e-4
    for shift in (-1, 1):
        off = BatchedHFWorker(model, "off")
        off.layout = AttentionLayout(off.layout.layer_types, {SLIDING: 8 + shift}, True)
        off.prefill("a", ids[:1], g, 0)
        assert (off.score("a", ids[1:]) - want).abs().max() > 1e-3, shift


@pytest.mark.parametrize("config, why", [
    (tf.T5Config(), "encoder-decoder"),
    (tf.MambaConfig(), "recurrent state"),
    (tf.BloomConfig(), "not in the architecture matrix"),
    (tf.Gemma3TextConfig(use_bidirectional_attention=True), "not causal"),
], ids=["t5", "mamba", "bloom", "bidirectional"])
def test_refused_at_load_before_weights(tmp_path, config, why):
    """A checkpoint directory holding only a config.json is refused through the builder with a ConfigError
    naming the architecture and the reason (no weights are read, so none are needed)."""
    config.architectures = [f"{type(config).__name__[:-6]}ForX"]
    config.save_pretrained(tmp_path)
    cfg = config_from_dict({"models": {"target": {"path": str(tmp_path)}}})
    with pytest.raises(ConfigError) as err:
        build_handle(cfg, "target")
    assert why in str(err.value) and config.model_type in str(err.value) and "ForX" in str(err.value)


def test_tensor_parallel_refused_without_a_plan(tmp_path):
    """GPT-2 has no base_model_tp_plan: tp_size 2 is refused before any process group is needed."""
    path = write_checkpoint(tmp_path, "gpt2")
    cfg = config_from_dict({"models": {"target": {"path": str(path)}}})
    with pytest.raises(ConfigError, match="no tensor-parallel plan.*tp_size: 1"):
        build_handle(cfg, "target", tp_size=2)


def test_position_limits_per_architecture():
    """max_length is the position limit (GPT-2's n_positions), never a sliding window."""
    for name, (cls, kwargs) in CONFIGS.items():
        worker = BatchedHFWorker(tiny_model(name), name)
        assert worker.max_length == kwargs.get("n_positions", kwargs.get("max_position_embeddings")), name
        assert worker.max_length > 4 * max(worker.layout.windows.values(), default=0)


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    """Target Llama (512 positions) with a GPT-2 drafter of 64 positions and a Llama drafter of 512."""
    root = tmp_path_factory.mktemp("limits")
    models = {"target": {"path": str(write_checkpoint(root, "llama"))},
              "short": {"path": str(write_checkpoint(root, "gpt2", n_positions=64))},
              "long": {"path": str(write_checkpoint(root / "long", "llama", seed=1))}}
    return build_engine(config_from_dict({"target": "target", "models": models}))


def _request(n, new, strategy, **opts):
    ids = torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    return GenerationRequest(prompt_ids=ids, max_new_tokens=new, sampling=SamplingParams(0.0), seed=0,
                             strategy=strategy, options=opts, ignore_eos=True)


@pytest.mark.parametrize("n, new, strategy, limit", [
    (500, 13, "autoregressive", 512),             # past the target's limit
    (60, 5, "speculative", 64),                   # within the target's, past the drafter's
    (30, 40, "speculative", 64),                  # the new tokens would carry the drafter past its limit
])
def test_too_long_is_a_param_error(limited, n, new, strategy, limit):
    opts = {"drafter": "short", "k": 3} if strategy == "speculative" else {}
    with pytest.raises(ParamError) as err:
        limited.add(_request(n, new, strategy, **opts))
    assert err.value.name == "prompt" and f"model length {limit}" in str(err.value), str(err.value)
    assert not any(m.active_requests() for m in limited.models.values())


def test_at_the_limit_runs(limited):
    """Exactly at a limit nothing is refused or truncated: the request emits every token asked for."""
    for n, new, strategy, opts in ((500, 12, "autoregressive", {}), (60, 4, "speculative", {"drafter": "short"}),
                                   (60, 40, "autoregressive", {}),    # a drafter's limit binds only its requests
                                   (60, 40, "speculative", {"drafter": "long"})):  # ... not another drafter's
        result = limited.generate(_request(n, new, strategy, **opts))
        assert len(result.token_ids) == new, (n, new, strategy)


def test_attention_implementation():
    """Gemma-2 loads with eager attention (its soft-capping; transformers' sdpa refuses softcap), and a
    kernel that ignores a prepared 4D mask (flex, flash) is refused rather than served unmasked."""
    assert BatchedHFWorker(tiny_model("gemma2"), "g").model.config._attn_implementation == "eager"
    model = tiny_model("llama")
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ConfigError, match="attn_implementation 'flex_attention'"):
        BatchedHFWorker(model, "flex")


def test_unknown_architecture_refused(tmp_path):
    """A config.json transformers does not know (custom code) is a ConfigError naming the directory."""
    (tmp_path / "config.json").write_text('{"model_type": "foo_custom", "architectures": ["FooForCausalLM"]}')
    cfg = config_from_dict({"models": {"target": {"path": str(tmp_path)}}})
    with pytest.raises(ConfigError, match=f"{tmp_path}.*foo_custom.*trust_remote_code"):
        build_handle(cfg, "target")
