"""The gRPC front's chat messages and logprobs (cluster/serving/fronts/app.py, grpc_api.py) without Ray: the
deployment's Generate / GenerateStream over the in-process tiny engine, as Serve's gRPC proxy calls them."""
from __future__ import annotations

import asyncio

import grpc

from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest
from cluster.models.chat_template import render_chat
from cluster.serving.fronts import app as app_mod
from cluster.serving.ops.auth import Keys
from cluster.serving.client.sdk import SpecServeClient
from tests.support.fake_coordinator import CFG, EngineCoordinator

MESSAGES = [{"role": "user", "content": "def fib(n):"}]


class Context:
    def __init__(self):
        self.code = self.details = None

    def invocation_metadata(self):
        return ()

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        self.details = details


def _deployment(engine):
    d = object.__new__(app_mod.SpecServeDeployment)
    d.cfg, d.keys, d.coord = CFG, Keys(), EngineCoordinator(engine)
    return d


def test_grpc_chat_with_logprobs_is_the_engines(tiny_engine):
    d, ctx = _deployment(tiny_engine), Context()
    m = SpecServeClient.request(messages=MESSAGES, max_new_tokens=5, temperature=0.0, seed=1, ignore_eos=True,
                                logprobs=3, prompt_logprobs=1)
    r = asyncio.run(d.Generate(m, ctx))
    prompt = render_chat(tiny_engine.tokenizer, MESSAGES)
    want = tiny_engine.generate(GenerationRequest(prompt=prompt, max_new_tokens=5, sampling=SamplingParams(0.0),
                                                  seed=1, ignore_eos=True, logprobs=3, prompt_logprobs=1))
    assert ctx.code is None and list(r.token_ids) == want.token_ids and r.text == want.text
    assert [(x.token_id, x.logprob, list(x.top_ids), list(x.top_logprobs)) for x in r.logprobs] == \
        [(lp.token_id, lp.logprob, [t for t, _ in lp.top], [v for _, v in lp.top]) for lp in want.logprobs]
    assert len(r.prompt_logprobs) == len(tiny_engine.tokenizer.encode(prompt)) - 1      # from the second token

    async def stream():
        return [c async for c in d.GenerateStream(m, ctx)]
    chunks = asyncio.run(stream())
    assert [x.logprob for c in chunks for x in c.logprobs] == [x.logprob for x in r.logprobs]


def test_grpc_chat_refusals_are_invalid_argument_naming_the_field(tiny_engine):
    d = _deployment(tiny_engine)
    for m, name in ((SpecServeClient.request(messages=[{"role": "robot", "content": "x"}]), "messages"),
                    (SpecServeClient.request(messages=MESSAGES, prompt="also a prompt"), "messages"),
                    (SpecServeClient.request("x", logprobs=21), "logprobs"),
                    (SpecServeClient.request("x", cache_salt=""), "cache_salt"),
                    (SpecServeClient.request("x", cache_salt="t" * 257), "cache_salt")):
        ctx = Context()
        asyncio.run(d.Generate(m, ctx))
        assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT and ctx.details.startswith(f"invalid {name}: "), \
            ctx.details
    assert [o for _, o in d.coord.metrics.records] == ["invalid"] * 5


def test_grpc_cache_salt_is_carried_and_leaves_the_output_unchanged(tiny_engine):
    """``GenerateRequest.cache_salt`` (optional: unset is no salt) reaches the prepared request; the output is the
    unsalted one's."""
    from cluster.serving.fronts.grpc_api import fields_from_proto
    assert fields_from_proto(SpecServeClient.request("x", cache_salt="tenant-a")).cache_salt == "tenant-a"
    assert fields_from_proto(SpecServeClient.request("x")).cache_salt is None
    d = _deployment(tiny_engine)
    out = {}
    for salt in (None, "tenant-a"):
        ctx = Context()
        r = asyncio.run(d.Generate(SpecServeClient.request("def f(x):", max_new_tokens=6, temperature=0.0, seed=1,
                                                           ignore_eos=True, cache_salt=salt), ctx))
        assert ctx.code is None
        out[salt] = list(r.token_ids)
    assert out["tenant-a"] == out[None] and len(out[None]) == 6


def test_grpc_resume_token_ids_continue_a_stream_exactly(tiny_engine):
    """``GenerateRequest.resume_token_ids``: a sampled stream cut after its second chunk and sent again with the ids
    it delivered goes on with exactly the chunks that followed; a bad one is INVALID_ARGUMENT naming the field."""
    d = _deployment(tiny_engine)
    kw = dict(max_new_tokens=24, temperature=0.8, seed=4, ignore_eos=True, strategy="speculative")

    async def chunks(m):
        return [c async for c in d.GenerateStream(m, Context())]
    whole = asyncio.run(chunks(SpecServeClient.request("def f(x):", **kw)))
    cut = [t for c in whole[:2] for t in c.token_ids]
    rest = asyncio.run(chunks(SpecServeClient.request("def f(x):", resume_token_ids=cut, **kw)))
    assert cut + [t for c in rest for t in c.token_ids] == list(whole[-1].result.token_ids)
    assert rest[-1].result.text == whole[-1].result.text and rest[-1].result.stats.generated_tokens == 24
    ctx = Context()
    asyncio.run(d.Generate(SpecServeClient.request("x", resume_token_ids=[1] * 24, **kw), ctx))
    assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT and ctx.details.startswith("invalid resume_token_ids: ")
