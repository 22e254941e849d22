"""The architecture matrix: tiny random checkpoints of every supported architecture, loaded through a config's
``path:`` as a user's own would be, serve greedy output identical to transformers' own forward on the full
sequence without a cache (:func:`tests.support.architectures.oracle_greedy`), for every lossless strategy:
autoregressive, speculative with token and block verification (a same-architecture drafter and one of another
architecture), and CS Drafting over both drafters; alone and batched with requests joining mid-run; and the
target log-probabilities reported with each token equal the oracle's to ``LOGPROB_TOL``.  Contexts pass every
sliding window (windows 8-14; prompts 6-20 tokens plus 32 new ones).

Genuine near-ties are guarded, not hidden by a tolerance: a request is compared up to the first position
where the oracle's top-2 logit margin is below ``TIE`` (batched and unbatched float arithmetic may
legitimately break such a tie differently), and such cuts must be rare.
"""
from __future__ import annotations

import pytest
import torch

from cluster.config.schema import config_from_dict
from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest
from cluster.local import build_engine
from tests.support.architectures import CONFIGS, oracle_greedy, tiny_model, write_checkpoint, write_drafter
from tests.support.tp_ranks import free_port, run_tp

torch.set_num_threads(1)
NEW = 32
TIE = 1e-4
LOGPROB_TOL = 1e-4                                   # float32 cached vs uncached arithmetic
GREEDY = SamplingParams(0.0)
ARCHS = list(CONFIGS)
PROMPT_LENGTHS = (6, 13, 20, 9, 16)
VARIANTS = [
    ("autoregressive", {}),
    ("speculative", dict(drafter="self", k=4)),
    ("speculative", dict(drafter="self", k=3, verify="block")),
    ("speculative", dict(drafter="other", k=3)),
    ("cs_drafting", dict(drafters="self,other", kmatrix="3,2;0,2")),
]


def other_arch(name: str) -> str:
    """A drafter of a different architecture (model_type) than ``name``: the one four places on."""
    return ARCHS[(ARCHS.index(name) + 4) % len(ARCHS)]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("archs")


def engine_of(root, name: str):
    """An in-process engine whose target is ``name`` (seed 0), ``self`` its first layer, ``other`` a random
    checkpoint of :func:`other_arch`; all from ``save_pretrained`` directories through ``path:``."""
    target = root / name
    if not target.is_dir():
        write_checkpoint(root, name)
    models = {"target": {"path": str(target)},
              "self": {"path": str(write_drafter(root, name))},
              "other": {"path": str(write_checkpoint(root / "other", other_arch(name), seed=1))}}
    return build_engine(config_from_dict({"target": "target", "models": models,
                                          "engine": {"max_batch": 8, "max_queue": 8}}))


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 300, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def run(engine, items, join_after: int | None = None) -> list:
    """Run ``items`` = [(prompt, variant index)]; with ``join_after`` the second half is submitted only after
    that many steps of the first (continuous batching: requests join a running batch)."""
    def add(batch):
        return [engine.add(GenerationRequest(prompt_ids=p, max_new_tokens=NEW, sampling=GREEDY, seed=0,
                                             strategy=VARIANTS[v][0], options=VARIANTS[v][1], ignore_eos=True,
                                             logprobs=0))
                for p, v in batch]
    half = len(items) // 2 if join_after is not None else len(items)
    seqs, steps = add(items[:half]), 0
    while any(s.status != "finished" for s in seqs) or steps <= (join_after or 0):
        if join_after is not None and steps == join_after:
            assert any(s.status != "finished" for s in seqs)       # the first half is still running
            seqs += add(items[half:])
        engine.step()
        steps += 1
    for s in seqs:
        assert s.error is None, s.error
    assert all(not m.active_requests() for m in engine.models.values())
    return seqs


@pytest.mark.parametrize("name", ARCHS)
def test_matrix_greedy_equals_transformers(root, name):
    engine = engine_of(root, name)
    ps = prompts()
    oracle = [oracle_greedy(engine.models["target"].model, p, NEW) for p in ps]
    cuts = [next((i for i, m in enumerate(margins) if m < TIE), NEW) for _, margins, _ in oracle]
    assert sum(c < NEW for c in cuts) <= 1, cuts                     # near-ties are rare

    def check(items, seqs):
        for (p, v), s in zip(items, seqs):
            result, (want, _, want_lp) = s.chunks[-1].result, oracle[ps.index(p)]
            got, cut = result.token_ids, cuts[ps.index(p)]
            assert len(got) == NEW and got[:cut] == want[:cut], (name, VARIANTS[v], len(p))
            lp = [e.logprob for e in result.logprobs[:cut]]
            assert [e.token_id for e in result.logprobs] == got
            err = max((abs(a - b) for a, b in zip(lp, want_lp)), default=0.0)
            assert err < LOGPROB_TOL, (name, VARIANTS[v], len(p), err)

    alone = [(ps[v % len(ps)], v) for v in range(len(VARIANTS))]
    for item in alone:                                               # each strategy alone
        check([item], run(engine, [item]))
    mixed = [(ps[i], (i + 1) % len(VARIANTS)) for i in range(len(ps))] + [(ps[0], 0), (ps[3], 2), (ps[1], 4)]
    seqs = run(engine, mixed, join_after=3)                          # batched, three joining mid-run
    check(mixed, seqs)
    spec = [s.stats for s, (_, v) in zip(seqs, mixed) if VARIANTS[v][1].get("drafter") == "self"]
    assert sum(st.accepted_tokens for st in spec) > 0                # the accept path ran too


@pytest.mark.slow      # ~26 s; tests/serving/test_serve.py's gloo TP test covers TP in the default run
def test_tensor_parallel_matrix(root):
    """Every architecture with a tensor-parallel plan, its target sharded over two gloo ranks with
    transformers' plan: greedy output of autoregressive, speculative and block-verified decoding equals the
    no-cache oracle; GPT-2, without a plan, is refused at load (tests/models/test_support.py)."""
    names = [n for n in ARCHS if CONFIGS[n][0]().base_model_tp_plan]
    ps, new = prompts()[:2], 24
    variants = VARIANTS[:3]
    jobs = []
    for n in names:
        if not (root / n).is_dir():
            write_checkpoint(root, n)
        jobs.append((n, {"target": {"path": str(root / n)}, "self": {"path": str(write_drafter(root, n))}},
                     ps, new, variants))
    results = run_tp(jobs, free_port())
    for n in names:
        got = results[n]
        assert isinstance(got, dict), got                              # else the rank's traceback
        assert got["sharded"] > 0, n                                   # the target really was split
        model = tiny_model(n)
        for i, p in enumerate(ps):
            want, margins, _ = oracle_greedy(model, p, new)
            cut = next((j for j, m in enumerate(margins) if m < TIE), new)
            for v in range(len(variants)):
                assert got["tokens"][i * len(variants) + v][:cut] == want[:cut], (n, variants[v], len(p))
