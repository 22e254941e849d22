"""The socket channel (``cluster.draft_channel: socket``) on a real draft-group actor (local Ray, configs/tiny.yaml
with the Max-Gram drafter): greedy outputs through it equal autoregressive's, each call's hop stamps are ordered
on the one host clock, errors cross it as the Ray channel raises them, and after the actor is killed (SIGKILL,
only the actor this module started) and Ray restarts it, the channel reconnects.  Synchronisation by polling
conditions with deadlines."""
from __future__ import annotations

import os
import signal

import pytest

from actors.protocol import StateLostError, StepCall
from cluster.core.draft.programs import DRAFTS
from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest
from cluster.errors import ModelUnavailableError
from tests.support.built import tiny_with_mag_on_ray
from tests.support.exact import local_engine
from tests.support.polling import poll

ray = pytest.importorskip("ray")

PROMPT = list(b"import os\nimport sys\nimport os\n")


@pytest.fixture(scope="module")
def link(tiny_engine):
    """(socket channel over the draft-group actor, the engine over it with the target in this process)."""
    from actors.draft_actor import start_draft_actor
    from cluster.models.build import build_handle, model_vocab_size
    from cluster.serving.control.remote import RemoteHandle
    from cluster.serving.control.socket_channel import SocketChannel
    cfg = tiny_with_mag_on_ray()
    actor = start_draft_actor(cfg, list(cfg.drafters), model_vocab_size(cfg, cfg.target), num_cpus=0.1)
    channel = SocketChannel([actor], name=DRAFTS, timeout_s=30.0)
    info = channel.ask("info").wait(300)[0]
    handles = {cfg.target: build_handle(cfg, cfg.target), DRAFTS: RemoteHandle(channel, info)}
    handles.update({n: RemoteHandle(channel, mi, member=n) for n, mi in info["members"].items()})
    engine = local_engine(handles, tiny_engine.tokenizer, target=cfg.target, defaults=cfg.engine.options)
    yield channel, engine
    channel.close()


def _generate(engine, strategy):
    return engine.generate(GenerationRequest(prompt_ids=PROMPT, max_new_tokens=40, sampling=SamplingParams(0.0),
                                             seed=3, strategy=strategy, ignore_eos=True)).token_ids


def _pid(channel):
    try:
        return ray.get(channel.actors[0].__ray_call__.remote(lambda self: os.getpid()), timeout=10)
    except (ray.exceptions.ActorUnavailableError, ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return None


def test_round_trip_greedy_equal_and_hops_on_one_clock(tiny_engine, link):
    channel, engine = link
    want = _generate(tiny_engine, "autoregressive")
    drafts = engine.models[DRAFTS]
    drafts.reset_timing()
    for strategy in ("speculative", "mag", "cs_drafting"):
        assert _generate(engine, strategy) == want, strategy
    t = drafts.per_method["draft_batch"]
    assert t.calls > 0 and channel.connects == 1
    # sent <= entry <= exit <= received on every call, so each hop's total is >= 0 (one clock for both processes)
    assert t.request_s > 0 and t.reply_s > 0 and t.actor_s >= t.compute_s > 0
    assert abs(t.request_s + t.actor_s + t.reply_s - t.wall_s) < 1e-6
    assert t.hits + t.misses > 0 and t.hit_calls == t.hits          # one request per call: a hit per call


def test_errors_cross_the_socket_as_through_ray(link):
    channel, _ = link
    with pytest.raises(ValueError, match="unknown method"):           # raised as itself, the channel stays up
        channel.call(StepCall(method="no_such_method"))
    assert not channel.down
    with pytest.raises(ModelUnavailableError) as e:                  # an unknown request: the actor lost state
        channel.call(StepCall(ops=[("extend", "never-prefilled", ([1],))]))
    assert isinstance(e.value.__cause__, StateLostError) and "never-prefilled" in str(e.value.__cause__)
    assert channel.down
    poll(channel.probe, "the channel to answer again")
    assert channel.call(StepCall())[0] is None


def test_reconnects_after_the_actor_is_killed_and_restarted(tiny_engine, link):
    channel, engine = link
    want = _generate(tiny_engine, "autoregressive")
    before, pid = channel.connects, _pid(channel)
    os.kill(pid, signal.SIGKILL)                   # the actor this module started, by its PID
    with pytest.raises(ModelUnavailableError):
        channel.call(StepCall())
    poll(channel.probe, "Ray to restart the draft actor", timeout=120)
    assert poll(lambda: _pid(channel), "the restarted actor's pid") != pid
    assert _generate(engine, "speculative") == want       # the engine prefills it again, through a new socket
    assert channel.connects == before + 1 and not channel.down
