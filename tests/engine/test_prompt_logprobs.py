"""Prompt logprobs (OpenAI ``echo`` + ``logprobs``, lm-eval's loglikelihood): the target's logprobs of each
prompt token from the forward that prefills it; ``max_new_tokens = 0`` scores the prompt only."""
import pytest
import torch

from cluster.core.logprobs import token_logprobs
from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest
from cluster.errors import ParamError
from tests.support.tolerance import assert_logprobs_close

PROMPTS = ["def fibonacci(n):\n    if n < 2:", "Привет, мир! 你好", "x"]


def _oracle(engine, ids, n):
    with torch.no_grad():
        logits = engine.models["target"].model(input_ids=torch.tensor([ids])).logits[0]   # [P, V]
    return [None] + token_logprobs(logits[:-1], ids[1:], n)


def _req(prompt, max_new, n=3, **kw):
    return GenerationRequest(prompt=prompt, max_new_tokens=max_new, prompt_logprobs=n,
                             sampling=SamplingParams(0.0), seed=1, ignore_eos=True, **kw)


def _close(got, want):
    assert got[0] is None and want[0] is None and len(got) == len(want)
    assert_logprobs_close(got[1:], want[1:])        # prefill vs a no-cache forward: tests/support/tolerance.py


@pytest.mark.parametrize("max_new", [0, 1, 12])
def test_prompt_logprobs_equal_a_full_forward(tiny_engine, max_new):
    for prompt in PROMPTS:
        res = tiny_engine.generate(_req(prompt, max_new))
        ids = tiny_engine.tokenizer.encode(prompt)
        assert len(res.prompt_logprobs) == len(ids)
        _close(res.prompt_logprobs, _oracle(tiny_engine, ids, 3))
        assert len(res.token_ids) == max_new and res.finish_reason == "length"
        assert all(len(lp.top) == 3 for lp in res.prompt_logprobs[1:])


def test_scoring_does_not_change_the_output(tiny_engine):
    """Prefilling through the scored forward leaves the target's state as a plain prefill does."""
    for strategy in ("autoregressive", "speculative"):
        plain = tiny_engine.generate(GenerationRequest(prompt=PROMPTS[0], max_new_tokens=16, strategy=strategy,
                                                       sampling=SamplingParams(0.0), ignore_eos=True))
        scored = tiny_engine.generate(_req(PROMPTS[0], 16, strategy=strategy))
        assert scored.token_ids == plain.token_ids and plain.prompt_logprobs is None


def test_batched_prefill_mixes_scored_and_plain(tiny_engine):
    reqs = [_req(PROMPTS[0], 0), _req(PROMPTS[1], 5, n=0),
            GenerationRequest(prompt=PROMPTS[1], max_new_tokens=5, sampling=SamplingParams(0.0), ignore_eos=True)]
    zero, five, plain = tiny_engine.generate_many(reqs)
    assert zero.token_ids == [] and zero.text == "" and zero.finish_reason == "length"
    _close(zero.prompt_logprobs, _oracle(tiny_engine, tiny_engine.tokenizer.encode(PROMPTS[0]), 3))
    assert five.token_ids == plain.token_ids and all(lp.top == () for lp in five.prompt_logprobs[1:])


def test_zero_new_tokens_needs_prompt_logprobs(tiny_engine):
    with pytest.raises(ParamError, match=r"invalid max_new_tokens: 0 \(allowed: integer in \[1, 512\]\)"):
        tiny_engine.generate(GenerationRequest(prompt="x", max_new_tokens=0))
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ParamError, match=rf"invalid {name}: 21 \(allowed: integer in \[0, 20\]\)"):
            tiny_engine.generate(GenerationRequest(prompt="x", **{name: 21}))
