"""The draft side (cluster.core.draft.side) and its blocks (cluster.core.draft.programs): literal packing forms, exact
output laws with pre-drafting (overlap) on, alone and batched, and pre-drafted blocks that are used."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cluster.core.draft.side import DraftSide
from cluster.core.draft.programs import DRAFTS, DraftSpec, pack_block
from cluster.core.sampling import Rng, SamplingParams, logits_to_probs
from cluster.engine.request import GenerationRequest
from cluster.models.maxgram import MagHandle
from cluster.strategies import resolve_options
from tests.support.exact import (
    TabularModel,
    VocabTokenizer,
    enumerate_outcomes,
    local_engine,
    max_abs_diff,
    mixed_batch,
    steps_law,
    target_joint,
)


# -- literal blocks ---------------------------------------------------------------------------------
def test_blocks_travel_in_the_smallest_exact_form():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, -1.0, 0.5, 0.2, 0.1] * 4] * 2)        # [2, 32]
    greedy = pack_block([3, 3], logits_to_probs(logits, SamplingParams(0.0)), SamplingParams(0.0), logits=logits)
    assert greedy.form == "onehot" and greedy.q is None and greedy.nbytes() == 16
    assert torch.equal(greedy.probs(32, SamplingParams(0.0)), torch.nn.functional.one_hot(
        torch.tensor([3, 3]), 32).double())
    topk = SamplingParams(1.0, top_k=2)
    q = logits_to_probs(logits, topk)
    sparse = pack_block([3, 11], q, topk, logits=logits)
    assert sparse.form == "sparse" and sparse.q.shape == (2, 4)              # 4 tokens tie at the 2nd value
    assert torch.equal(sparse.probs(32, topk), q)                           # exactly the drawn-from rows
    full = SamplingParams(1.0)
    dense = pack_block([1, 2], logits_to_probs(logits, full), full, logits=logits)
    assert dense.form == "logits" and torch.equal(dense.probs(32, full), logits_to_probs(logits, full))
    pis = pack_block([1], logits_to_probs(logits[:1], full), full)            # a cascade's pi rows: no logits
    assert pis.form == "dense" and pis.q.dtype == torch.float64
    assert [len(b.tokens) for b in (sparse.tail(1, 4), sparse.tail(0, 1))] == [1, 1]
    assert greedy.nbytes() < sparse.nbytes() < dense.nbytes()


# -- exact laws with pre-drafting -------------------------------------------------------------------
@pytest.mark.parametrize("strategy,opts,sampling", [
    ("speculative", dict(drafter="d", k=2), SamplingParams(1.0)),
    ("speculative", dict(drafter="d", k=2, verify="block"), SamplingParams(0.8, top_k=2)),
])
def test_overlap_keeps_the_target_law_exactly(strategy, opts, sampling):
    """Every next block is pre-drafted on the all-accepted outcome (used when it comes true, dropped
    otherwise): the first three tokens still follow the target exactly (all draws enumerated)."""
    target, d = TabularModel("target", 3, seed=5), TabularModel("d", 3, seed=6, zeros=True)
    models = {"target": target, "d": d}
    got = steps_law(strategy, resolve_options(strategy, opts, {}), models, "target", [0, 1], sampling, 3, 4,
                    overlap=True)
    assert max_abs_diff(got, target_joint(target, [0, 1], 3, sampling)) < 1e-9


@pytest.mark.parametrize("sampling", [SamplingParams(1.0), SamplingParams(0.7), SamplingParams(1.0, top_k=2)])
@pytest.mark.parametrize("verify", ["token", "block"])
def test_a_drafter_that_hands_on_its_laws_keeps_the_target_law_exactly(sampling, verify):
    """A drafter that hands on the probabilities it drew from (``laws``, as the batched worker does): q is read
    from them, not recomputed from logits, and the first three tokens still follow the target exactly."""
    target, d = TabularModel("target", 3, seed=5), TabularModel("d", 3, seed=6, zeros=True, laws=True)
    opts = resolve_options("speculative", dict(drafter="d", k=2, verify=verify), {})
    got = steps_law("speculative", opts, {"target": target, "d": d}, "target", [0, 1], sampling, 3, 4)
    assert max_abs_diff(got, target_joint(target, [0, 1], 3, sampling)) < 1e-9
    side = DraftSide({"d": d}, sampled=True)
    side.prefill_batch([("r", [0, 1], sampling, 0)])
    d.rng = Rng(0)
    block = side.draft_batch([("r", DraftSpec("propose", ("d",)), 2, 2)])[0]
    assert block.form == "dense" and block.q.dtype == torch.float64          # q as drawn, no logits


def test_overlap_keeps_the_cascade_law_exactly():
    """CS Drafting on the draft side (two tabular drafters reviewing MaG, lenience below the target), with
    pre-drafting: exactly the target's law."""
    target = TabularModel("target", 3, seed=0)
    models = {"target": target, "large": TabularModel("large", 3, seed=100, zeros=True),
              "small": TabularModel("small", 3, seed=200, zeros=True),
              "mag": MagHandle(3, np.array([1, 2, 0]))}
    opts = resolve_options("cs_drafting", dict(drafters="large,small,mag", kmatrix="1,0,0;0,1,0;0,0,2",
                                               lenience=2.0), {})
    got = steps_law("cs_drafting", opts, models, "target", [0, 1, 0], SamplingParams(1.0), 2, 4, overlap=True)
    assert max_abs_diff(got, target_joint(target, [0, 1, 0], 2, SamplingParams(1.0))) < 1e-9


def test_overlap_batched_engine_is_exact_per_request():
    """A sampled request decoded together with a greedy one by the engine, pre-drafting on: the sampled one's
    law is the target's, the greedy one is the target's argmax path (its draws enumerated alongside)."""
    holder = {}
    target, d = TabularModel("target", 3, seed=21), TabularModel("d", 3, seed=22, zeros=True)
    side = DraftSide({"d": d}, overlap=True, rng_factory=lambda s: holder["rng"], sampled=True)
    engine = local_engine({"target": target, "d": d, DRAFTS: side}, VocabTokenizer(3), rng_factory=lambda s: holder["rng"])
    sampling, greedy = SamplingParams(1.0), SamplingParams(0.0)
    want_greedy = target_joint(target, [2, 1], 3, greedy)

    def run(rng):
        holder["rng"] = d.rng = rng
        return mixed_batch(engine, sampling, want_greedy)

    got = enumerate_outcomes(run)
    assert max_abs_diff(got, target_joint(target, [0], 3, sampling)) < 1e-9
    assert not target.seqs and not d.seqs and side.hits + side.misses > 0


def test_prediction_that_comes_true_is_used_and_greedy_output_is_unchanged():
    """A drafter equal to the target: every block is accepted and its bonus token is the drafter's own next
    token, so every block after the first was drafted ahead (a hit) and nothing is drafted twice."""
    target, twin = TabularModel("target", 5, seed=9), TabularModel("twin", 5, seed=9)
    side = DraftSide({"twin": twin}, overlap=True)
    engine = local_engine({"target": target, "twin": twin, DRAFTS: side}, VocabTokenizer(5))
    req = dict(prompt_ids=[1, 2], max_new_tokens=25, sampling=SamplingParams(0.0), seed=0)
    want = local_engine({"target": TabularModel("target", 5, seed=9)}, VocabTokenizer(5)).generate(
        GenerationRequest(strategy="autoregressive", **req)).token_ids
    got = engine.generate(GenerationRequest(strategy="speculative", options={"drafter": "twin", "k": 4}, **req))
    assert got.token_ids == want
    assert side.hits >= 3 and side.misses == 0
    assert got.stats.target_forwards == 6            # the target-only first token, then 5 tokens per step
    assert not side.active_requests() and not twin.seqs


def test_spec_change_or_a_rejection_drops_the_predraft():
    d = TabularModel("d", 4, seed=2)
    side = DraftSide({"d": d}, overlap=True)
    side.prefill_batch([("r", [0, 1], SamplingParams(0.0), 0)])
    spec = DraftSpec("propose", ("d",))
    (block,) = side.draft_batch([("r", spec, 2, 10)])
    assert side._reqs["r"].pre is not None and side._reqs["r"].pre.expect[:4] == [0, 1, *block.tokens]
    side.rollback("r", 2)                                       # nothing accepted: another token committed
    side.extend("r", [(block.tokens[0] + 1) % 4])
    side.draft_batch([("r", spec, 2, 10)])
    assert side.misses == 1 and side.hits == 0
    side.release("r")
    assert not d.seqs and not side.active_requests()


class _GivesUp(DraftSide):
    """The draft host's pattern in one thread: pre-draft after each answer, told to give up at its ``after``-th
    question (between drafting rounds), as the host does when the next call shows a rejection."""

    def __init__(self, members, after: int):
        super().__init__(members, overlap=True, deferred=True)
        self.after, self.stopped = after, 0

    def draft_batch(self, items):
        out = super().draft_batch(items)
        asked = [0]

        def stop() -> bool:
            asked[0] += 1
            self.stopped += asked[0] == self.after
            return asked[0] >= self.after
        self.predraft(stop=stop)
        return out


@pytest.mark.parametrize("strategy,opts", [
    ("cs_drafting", dict(drafters="large,small,mag", kmatrix="1,0,0;0,1,0;0,0,2")),
    ("speculative", dict(drafter="large", k=4))])
@pytest.mark.parametrize("after", [1, 2, 3])
def test_a_predraft_given_up_between_rounds_leaves_the_drafters_consistent(strategy, opts, after):
    """CS Drafting (several drafter rounds per block) and one drafter (a stoppable pre-draft proposes one token
    per round) whose every pre-draft is stopped after ``after`` - 1 rounds: greedy output still equals the
    target's, nothing is left on any drafter (what each drafter holds matches what the draft side recorded,
    else its next sync would diverge)."""
    models = {"large": TabularModel("large", 5, seed=101), "small": TabularModel("small", 5, seed=202),
              "mag": MagHandle(5, np.array([1, 2, 3, 4, 0]))}
    side = _GivesUp(models, after)
    engine = local_engine({"target": TabularModel("target", 5, seed=3), **models, DRAFTS: side}, VocabTokenizer(5))
    req = dict(prompt_ids=[1, 2, 0], max_new_tokens=30, sampling=SamplingParams(0.0), seed=0, ignore_eos=True)
    want = local_engine({"target": TabularModel("target", 5, seed=3)}, VocabTokenizer(5)).generate(
        GenerationRequest(strategy="autoregressive", **req)).token_ids
    assert engine.generate(GenerationRequest(strategy=strategy, options=opts, **req)).token_ids == want
    assert side.stopped > 0 and side.hits == 0
    assert not side.active_requests() and all(not m.seqs for m in (models["large"], models["small"]))


def test_a_stoppable_predraft_drafts_the_same_block_token_by_token():
    """Not stopped, a pre-draft proposed one token per round is the block one call of k would have given: a
    drafter equal to the target still has every later block pre-drafted and used."""
    target, twin = TabularModel("target", 5, seed=9), TabularModel("twin", 5, seed=9)
    side = _GivesUp({"twin": twin}, after=10_000)
    engine = local_engine({"target": target, "twin": twin, DRAFTS: side}, VocabTokenizer(5))
    req = dict(prompt_ids=[1, 2], max_new_tokens=25, sampling=SamplingParams(0.0), seed=0)
    want = local_engine({"target": TabularModel("target", 5, seed=9)}, VocabTokenizer(5)).generate(
        GenerationRequest(strategy="autoregressive", **req)).token_ids
    got = engine.generate(GenerationRequest(strategy="speculative", options={"drafter": "twin", "k": 4}, **req))
    # the first token comes from the target's prefill alone, then 24 tokens in blocks of k + 1 = 5
    assert got.token_ids == want and side.hits >= 3 and side.misses == 0 and got.stats.target_forwards == 1 + 5


def test_could_use_reads_the_next_calls_bookkeeping():
    """A pre-draft in flight can be used only if the bookkeeping commits its whole block plus one token."""
    side = DraftSide({"d": TabularModel("d", 4, seed=2)}, overlap=True, deferred=True)
    side.prefill_batch([("r", [0, 1], SamplingParams(0.0), 0)])
    (block,) = side.draft_batch([("r", DraftSpec("propose", ("d",)), 2, 10)])
    side._drafting = {"r": [0, 1, *block.tokens]}           # as predraft sets it while it runs
    accepted = [("rollback", "r", (2 + len(block.tokens),)), ("extend", "r", ([3],))]
    rejected = [("rollback", "r", (3,)), ("extend", "r", ([3],))]
    assert side.could_use(accepted) and not side.could_use(rejected)
    assert not side.could_use([("release", "r", ())]) and not side.could_use([])


def test_a_block_over_a_batch_buffer_stays_a_view_and_pickles_only_its_own_rows():
    """In process a row's laws are a view of the batch's [k, B, V] buffer (the verifier reads the batch without a
    copy); pickled to another process, the block carries its own [L, V] elements, not the buffer."""
    import pickle
    laws = torch.rand(3, 8, 1000)                          # [k, B, V]
    row = laws.transpose(0, 1)[5]                          # request 5's [k, V], strided
    block = pack_block([1, 2, 3], row, SamplingParams(temperature=1.0))
    assert block.form == "dense" and block.q.data_ptr() == row.data_ptr()
    data = pickle.dumps(block)
    assert len(data) < 2 * row.numel() * row.element_size()   # not the 8x larger buffer
    back = pickle.loads(data)
    assert torch.equal(back.q, row) and back.tokens == [1, 2, 3] and block.q.data_ptr() == row.data_ptr()
