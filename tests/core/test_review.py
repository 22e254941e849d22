"""CS Drafting's reviews through the batched sampler (cluster.core.verify_round.review_round) against their
per-row oracle (GenSpecSample towards the lenient law, core/verify.py): the joint law of a mixed batch of reviews
is the product of the oracle's per-row laws (exact enumeration, float64), each row handing up its own laws."""
import itertools

import numpy as np
import pytest
import torch

from cluster.core.cascade_targets import lossy_target
from cluster.core.sampling import UNSCALED, SamplingParams, logits_to_probs
from cluster.core.verify import gen_spec_verify
from cluster.core.verify_round import ReviewItem, review_round
from tests.support.exact import enumerate_outcomes, max_abs_diff, random_dist

F64 = torch.float64


def _law(g, V):
    return torch.tensor(random_dist(g, V, True))


def _pi(q, p, lens):
    """The per-row oracle's law at each drafted position: lossy where l > 1 (CSDraftProgram.review)."""
    rows = [lossy_target(q[i], p[i], 1.0 - 1.0 / l) if l > 1.0 else p[i] for i, l in enumerate(lens)]
    return torch.stack(rows) if rows else p[:0]


def _rows(seed, V=3):
    """Three reviews: two neural q rows at l = 1; a Max-Gram token (one-hot q) then a neural row, l = 2.5 at the
    neural one only; an empty draft (only the next token)."""
    g = np.random.default_rng(seed)
    out = []
    for draft, onehot, lens in (([1, 2], [False, False], [1.0, 1.0]), ([0, 1], [True, False], [1.0, 2.5]),
                                ([], [], [])):
        p = torch.stack([_law(g, V) for _ in range(len(draft) + 1)])
        q = [None if o else _law(g, V) for o in onehot]
        out.append((draft, q, lens, p))
    return out


def _items(rows, rng, sampling):
    V = rows[0][3].shape[-1]
    K = max(len(d) for d, *_ in rows)
    with np.errstate(divide="ignore"):
        logits = torch.zeros(len(rows), K + 1, V, dtype=F64)
        for b, (_, _, _, p) in enumerate(rows):
            logits[b, :p.shape[0]] = torch.log(p)
    items = [ReviewItem(f"r{b}", list(d), tuple(q), tuple(lens), sampling, rng, b)
             for b, (d, q, lens, _) in enumerate(rows)]
    return logits, items


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_review_of_a_batch_has_its_oracle_law_and_hands_up_its_own_laws(seed):
    rows = _rows(seed)
    V = rows[0][3].shape[-1]
    sampling = SamplingParams(1.0)

    def run(rng):
        logits, items = _items(rows, rng, sampling)
        out = review_round(logits, items)
        for r, (d, q, lens, p) in zip(out, rows):        # the laws handed up: pi's rows, p_{L+1} for a bonus
            pi = _pi(torch.stack([x if x is not None else torch.nn.functional.one_hot(
                torch.tensor(d[i]), V).to(F64) for i, x in enumerate(q)]) if d else p[:0], p[:len(d)], lens)
            want = torch.cat([pi[:r.accepted], (p[len(d)] if r.bonus else pi[r.accepted])[None]])
            assert torch.allclose(r.laws, want, atol=1e-12)
        return tuple((r.accepted, r.next_token) for r in out)

    got = enumerate_outcomes(run)
    laws = []
    for d, q, lens, p in rows:
        qq = torch.stack([x if x is not None else torch.nn.functional.one_hot(torch.tensor(d[i]), V).to(F64)
                          for i, x in enumerate(q)]) if d else p[:0]
        pi = _pi(qq, p[:len(d)], lens)
        laws.append(enumerate_outcomes(lambda r, d=d, qq=qq, pi=pi, p=p: (lambda v: (v.accepted, v.next_token))(
            gen_spec_verify(d, qq, pi, p[len(d)], r))))
    want = {tuple(o for o, _ in combo): float(np.prod([w for _, w in combo]))
            for combo in itertools.product(*(lw.items() for lw in laws))}
    assert max_abs_diff(got, want) < 1e-12


def test_greedy_reviews_are_the_lenient_argmax_rule_and_draw_nothing():
    """Greedy: x_i kept if it is the reviewer's argmax or q_i(x_i) <= l p_i(x_i) (p at temperature 1); the
    first rejected position emits the argmax; p's rows handed up. Row by row as CSDraftProgram.review's oracle."""
    rows = _rows(5, V=4)
    logits, items = _items(rows, None, SamplingParams(0.0))
    out = review_round(logits, items)
    for r, (d, q, lens, p) in zip(out, rows):
        pu = logits_to_probs(torch.log(p), UNSCALED)
        arg = pu.argmax(-1).tolist()
        acc = 0
        while acc < len(d):
            qx = 1.0 if q[acc] is None else float(q[acc][d[acc]])
            if not (arg[acc] == d[acc] or qx <= lens[acc] * float(pu[acc, d[acc]])):
                break
            acc += 1
        assert (r.accepted, r.next_token, r.bonus) == (acc, arg[acc], acc == len(d))
        assert torch.allclose(r.laws, pu[:acc + 1], atol=1e-12)
