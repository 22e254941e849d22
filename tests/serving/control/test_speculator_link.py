"""The far speculator on a real draft-group actor (local Ray, configs/tiny.yaml with the Max-Gram drafter) through
its socket link: a fill's reply equals the same speculator's in this process, greedy outputs through the near-far
draft side equal autoregressive's for every drafting strategy, batched, and after the actor is killed (SIGKILL,
only the actor this module started) decoding goes on near while the link reconnects.  Synchronisation by polling
conditions with deadlines."""
from __future__ import annotations

import os
import signal

import pytest

from cluster.core.draft.near_far import NearFarSide
from cluster.core.draft.programs import DRAFTS, DraftSpec
from cluster.core.draft.side import DraftSide
from cluster.core.draft.speculator import Fill, FillItem, Speculator
from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest
from tests.support.built import tiny_with_mag_on_ray
from tests.support.exact import local_engine
from tests.support.polling import poll

ray = pytest.importorskip("ray")

PROMPTS = [list(b"import os\nimport sys\nimport os\n"), list(b"def main():\n    return 1\n"), list(b"class A:\n")]


@pytest.fixture(scope="module")
def unit(tiny_engine):
    """(the link, the engine over a near-far draft side with the target and near drafters here, the config)."""
    from actors.draft_actor import start_draft_actor
    from cluster.models.build import build_handle, model_vocab_size
    from cluster.serving.control.speculator_link import SocketSpeculatorLink
    cfg = tiny_with_mag_on_ray()
    vocab = model_vocab_size(cfg, cfg.target)
    actor = start_draft_actor(cfg, list(cfg.drafters), vocab, num_cpus=0.1, overlap=False)
    link = SocketSpeculatorLink(actor)
    poll(lambda: (link.poll(), link.up)[1], "the speculator's socket", timeout=300)
    near = {n: build_handle(cfg, n) for n in cfg.drafters}
    near[cfg.mag.name] = build_handle(cfg, cfg.mag.name, vocab_size=vocab)
    side = NearFarSide(DraftSide(near), link, max_rows=8)     # the prompts batched through the cache
    engine = local_engine({cfg.target: build_handle(cfg, cfg.target), **near, DRAFTS: side}, tiny_engine.tokenizer,
                          target=cfg.target, defaults=cfg.engine.options)
    yield link, engine, cfg
    link.close()
    ray.kill(actor, no_restart=True)


def _generate(engine, strategy, n=40):
    reqs = [GenerationRequest(prompt_ids=p, max_new_tokens=n, sampling=SamplingParams(0.0), seed=3,
                              strategy=strategy, ignore_eos=True, request_id=f"{strategy}-{i}")
            for i, p in enumerate(PROMPTS)]
    return [r.token_ids for r in engine.generate_many(reqs)]


def test_a_fill_answered_far_equals_the_same_fill_drafted_here(unit):
    link, _, cfg = unit
    from cluster.models.build import build_handle
    drafter = cfg.drafters[0]
    fill = Fill(99, [FillItem("probe", PROMPTS[0], SamplingParams(0.0), 0, DraftSpec("propose", (drafter,)),
                              [10, 32], 3, 20, [[11], [33]])], [("bonus", -1, 0), ("reject", 0, 0), ("reject", 1, 0)])
    link.send(fill)
    got = poll(lambda: link.poll(), "the speculator's reply")
    want = Speculator({drafter: build_handle(cfg, drafter)}).fill(fill)
    assert [r.id for r in got] == [99]
    assert [(e.expect, e.block.tokens, e.key) for e in got[0].entries["probe"]] == \
        [(e.expect, e.block.tokens, e.key) for e in want.entries["probe"]]
    # the actor drafts the next fill ahead on the likeliest outcome (block accepted, bonus bet right): a fill that
    # comes as predicted is answered from that look-ahead, with the blocks a fresh speculator drafts for it
    bonus = next(e for e in got[0].entries["probe"] if e.key[0] == "bonus")
    nxt = Fill(100, [FillItem("probe", bonus.expect, SamplingParams(0.0), 0, DraftSpec("propose", (drafter,)),
                              bonus.block.tokens, 3, 17, bonus.block.alts)], fill.keys)
    link.send(nxt)
    got = poll(lambda: link.poll(), "the speculator's reply to the predicted fill")
    want = Speculator({drafter: build_handle(cfg, drafter)}).fill(nxt)
    assert [r.id for r in got] == [100] and got[0].ahead == 1
    assert [(e.expect, e.block.tokens, e.key) for e in got[0].entries["probe"]] == \
        [(e.expect, e.block.tokens, e.key) for e in want.entries["probe"]]
    link.send(Fill(0, [], [], ["probe"]))                # released: its branches leave the actor
    unpicklable = SamplingParams(0.0, constraint=lambda: None)
    bad = Fill(101, [FillItem("x", PROMPTS[0], unpicklable, 0, DraftSpec("propose", (drafter,)), [1], 1, 9)],
               [("bonus", -1, 0)])
    assert link.send(bad) is False and link.up           # a fill that cannot travel is not sent; the link stays


def test_greedy_outputs_through_the_speculation_cache_equal_autoregressive(tiny_engine, unit):
    _, engine, _ = unit
    want = _generate(tiny_engine, "autoregressive")
    side = engine.models[DRAFTS]
    side.cache.clear()
    for strategy in ("speculative", "mag", "cs_drafting"):
        assert _generate(engine, strategy) == want, strategy
    c = side.counters
    assert c.steps > 0 and c.calls > 0
    assert c.fills + c.late > 0          # every fill was answered in time or counted late (never waited for)
    assert not side.active_requests()


def _pid(actor):
    try:
        return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=10)
    except (ray.exceptions.ActorUnavailableError, ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return None


def test_a_dead_speculator_leaves_near_drafting_and_the_link_reconnects(tiny_engine, unit):
    link, engine, _ = unit
    want = _generate(tiny_engine, "autoregressive", 24)
    before, pid = link.connects, _pid(link.actor)
    os.kill(pid, signal.SIGKILL)                   # the actor this module started, by its PID
    poll(lambda: (link.poll(), not link.up)[1], "the link to see the speculator gone")
    assert _generate(engine, "speculative", 24) == want      # near only meanwhile, outputs unchanged
    poll(lambda: (link.poll(), link.up)[1], "the link to reconnect to the restarted actor", timeout=180)
    assert link.connects == before + 1
    assert _generate(engine, "speculative", 24) == want

