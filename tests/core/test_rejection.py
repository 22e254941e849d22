"""The batched sampler (cluster/core/rejection.py) against its per-row oracle (core/verify.py, core/block_verify.py,
core/sampling.py): the same exact laws by enumeration in float64, row by row inside a mixed batch, and the
counter-based draws' own law."""
import itertools

import numpy as np
import pytest
import torch

from cluster.core.block_verify import verify_block
from cluster.core.draws import CounterDraws, RngDraws, counter_hash, counter_uniform, inverse_cdf
from cluster.core.rejection import RowSampling, argmax, pick_rows, probs_batch, sample_batch, verify_batch
from cluster.core.sampling import SamplingParams, logits_to_probs, sample
from cluster.core.verify import verify_tokens
from cluster.core.verify_round import stack_rows
from tests.support.exact import enumerate_outcomes, max_abs_diff, random_dist

ORACLE = {"token": verify_tokens, "block": verify_block}
F64 = torch.float64


def _tables(seed, vocab, L, zeros=True):
    g = np.random.default_rng(seed)
    q = torch.tensor(np.stack([random_dist(g, vocab, zeros) for _ in range(max(L, 1))]))[:L]
    p = torch.tensor(np.stack([random_dist(g, vocab, zeros) for _ in range(L + 1)]))
    return q, p


def _pad(rows, K, V):
    """Stack per-row [n, V] tensors (n <= K) into [B, K, V] (zero padding)."""
    out = torch.zeros(len(rows), K, V, dtype=F64)
    for b, r in enumerate(rows):
        out[b, :r.shape[0]] = r
    return out


def _batch(rows, params, method, det=None):
    """rows: [(draft [L], q [L, V] | None, p [L+1, V])] with p already the law (logits = log p at T = 1).
    Returns run(rng) -> per-row verdict tuples, every row drawing from the same branching source."""
    V = rows[0][2].shape[-1]
    K = max(len(d) for d, _, _ in rows)
    with np.errstate(divide="ignore"):
        logits = _pad([torch.log(p) for _, _, p in rows], K + 1, V)
    for b, (_, _, p) in enumerate(rows):                  # padding rows: any finite logits
        logits[b, p.shape[0]:] = 0.0
    draft = torch.tensor([list(d) + [0] * (K - len(d)) for d, _, _ in rows], dtype=torch.long).reshape(len(rows), K)
    lengths = torch.tensor([len(d) for d, _, _ in rows])
    q = None if all(qq is None for _, qq, _ in rows) else \
        _pad([qq if qq is not None else torch.zeros(0, V, dtype=F64) for _, qq, _ in rows], K, V)
    if det is None and q is not None:
        det = torch.tensor([qq is None for _, qq, _ in rows])
    rs = RowSampling.of(params, V, "cpu", F64)

    def run(rng, drafts=None):
        d = draft if drafts is None else drafts
        v = verify_batch(logits, d, lengths, rs, RngDraws([rng] * len(rows)), q=q, det=det, method=method)
        return tuple(v.tolist())
    return run, draft


@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_row_of_a_batch_has_its_oracle_law(method, seed):
    """Two sampled rows of different lengths (one plain: L = 0) in one call: the joint law of their verdicts
    is the product of the per-row oracle's laws, for fixed drafts (enumerated over the verifier's draws)."""
    V = 3
    (q1, p1), (q2, p2), (_, p3) = _tables(seed, V, 2), _tables(seed + 10, V, 1), _tables(seed + 20, V, 0)
    g = np.random.default_rng(seed)
    d1 = [int(g.choice(V, p=q1[i].numpy())) for i in range(2)]
    d2 = [int(g.choice(V, p=q2[0].numpy()))]
    run, _ = _batch([(d1, q1, p1), (d2, q2, p2), ([], None, p3)], [SamplingParams(1.0)] * 3, method,
                    det=torch.tensor([False, False, True]))
    got = enumerate_outcomes(run)
    laws = [enumerate_outcomes(lambda r, d=d, q=q, p=p: (lambda v: (v.accepted, v.next_token, v.bonus))(
        ORACLE[method](d, q, p, r))) for d, q, p in ((d1, q1, p1), (d2, q2, p2), ([], p3[:0], p3))]
    want = {(a, b, c): x * y * z for (a, x), (b, y), (c, z) in itertools.product(*(lw.items() for lw in laws))}
    assert max_abs_diff(got, want) < 1e-12


@pytest.mark.parametrize("method", ["token", "block"])
def test_drafts_drawn_then_verified_emit_the_target_law(method):
    """Drafts drawn from q (enumerated too), verified in a batch with a second row: row 0's first emitted token
    follows p_1 exactly (Leviathan et al., Theorem 3.5; Sun et al., Theorem 1)."""
    V, L = 4, 3
    q, p = _tables(5, V, L)
    q2, p2 = _tables(6, V, 1)
    run, _ = _batch([([0] * L, q, p), ([0], q2, p2)], [SamplingParams(1.0)] * 2, method)

    def outcome(rng):
        d0 = [rng.categorical(q[i]) for i in range(L)]
        d1 = [rng.categorical(q2[0])]
        (a, t, _), _ = run(rng, torch.tensor([d0, d1 + [0] * (L - 1)]))
        return t if a == 0 else d0[0]
    got = enumerate_outcomes(outcome)
    assert max_abs_diff(got, {t: float(p[0, t]) for t in range(V)}) < 1e-12


def test_a_row_is_verified_against_its_own_distribution():
    """Swapping two rows swaps their verdicts' laws: fails if a row reads another row's p or q."""
    V = 3
    (q1, p1), (q2, p2) = _tables(7, V, 2), _tables(8, V, 2)
    rows = [([1, 2], q1, p1), ([2, 0], q2, p2)]
    run_a, _ = _batch(rows, [SamplingParams(1.0)] * 2, "token")
    run_b, _ = _batch(rows[::-1], [SamplingParams(1.0)] * 2, "token")
    a, b = enumerate_outcomes(run_a), enumerate_outcomes(run_b)
    assert max_abs_diff(a, {(y, x): w for (x, y), w in b.items()}) < 1e-12
    one = enumerate_outcomes(_batch(rows[:1], [SamplingParams(1.0)], "token")[0])
    marg = {}
    for (x, _), w in a.items():
        marg[(x,)] = marg.get((x,), 0.0) + w
    assert max_abs_diff(marg, one) < 1e-12


@pytest.mark.parametrize("method", ["token", "block"])
def test_greedy_rows_are_argmax_comparisons_and_draw_nothing(method):
    """A greedy row beside a sampled one: accepted = the prefix matching the target's argmax, next = the argmax
    after it; the only branches are the sampled row's (its law unchanged by the greedy neighbour)."""
    V = 4
    q, p = _tables(9, V, 2)
    pg = torch.tensor([[0.1, 0.6, 0.2, 0.1], [0.5, 0.1, 0.3, 0.1], [0.1, 0.1, 0.1, 0.7]], dtype=F64)
    for draft, want in (([1, 0], (2, 3, True)), ([1, 2], (1, 0, False)), ([3, 0], (0, 1, False))):
        run, _ = _batch([(draft, None, pg), ([1, 1], q, p)], [SamplingParams(0.0), SamplingParams(1.0)], method,
                        det=torch.tensor([True, False]))
        got = enumerate_outcomes(run)
        assert {k[0] for k in got} == {want}
        alone = enumerate_outcomes(_batch([([1, 1], q, p)], [SamplingParams(1.0)], method)[0])
        assert max_abs_diff({(k[1],): w for k, w in got.items()}, alone) < 1e-12


@pytest.mark.parametrize("method", ["token", "block"])
def test_deterministic_drafts_need_no_q_rows(method):
    """Max-Gram / prediction drafts (one-hot q, passed as q=None): the oracle's law with one-hot q rows."""
    V = 4
    _, p = _tables(11, V, 3)
    draft = [2, 0, 3]
    onehot = torch.nn.functional.one_hot(torch.tensor(draft), V).to(F64)
    run, _ = _batch([(draft, None, p)], [SamplingParams(1.0)], method)
    want = enumerate_outcomes(lambda r: (lambda v: ((v.accepted, v.next_token, v.bonus),))(
        ORACLE[method](draft, onehot, p, r)))
    assert max_abs_diff(enumerate_outcomes(run), want) < 1e-12


def test_probs_batch_is_logits_to_probs_row_by_row():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 2, 50, generator=g, dtype=F64) * 3
    params = [SamplingParams(0.7), SamplingParams(1.3, top_k=5), SamplingParams(1.0, top_p=0.8),
              SamplingParams(0.9, top_k=7, top_p=0.6), SamplingParams(2.0, top_k=50)]
    got = probs_batch(logits, RowSampling.of(params, 50, "cpu", F64))
    for b, sp in enumerate(params):
        assert torch.allclose(got[b], logits_to_probs(logits[b], sp), atol=1e-12, rtol=0)


def test_extreme_settings_stay_a_law_in_float32():
    """A temperature or top-p below float32's range (the fuzzer's 1e-4 and 5e-324): still a distribution, the
    argmax's one-hot, as the float64 oracle gives."""
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0]])
    for sp in (SamplingParams(1e-4, top_p=4.94065645841247e-324), SamplingParams(1e-300), SamplingParams(1e-4)):
        got = probs_batch(logits, RowSampling.of([sp], 4, "cpu", torch.float32))
        assert torch.isfinite(got).all() and got[0].tolist() == [0.0, 1.0, 0.0, 0.0], (sp, got)
        assert logits_to_probs(logits[0].double(), sp).tolist() == [0.0, 1.0, 0.0, 0.0]


def test_counter_hash_is_splitmix64_of_the_counter():
    """The int64 tensor arithmetic equals the same function in Python's unbounded integers mod 2^64."""
    M = (1 << 64) - 1

    def ref(seed, start, offset, purpose):
        x = (seed * 0x9E3779B97F4A7C15 + start * 0xBF58476D1CE4E5B9 + (offset * 8 + purpose) * 0x94D049BB133111EB
             + 0x9E3779B97F4A7C15) & M
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M
        return x ^ (x >> 31)
    cases = [(0, 0, 0, 1), (7, 123, 4, 2), ((1 << 62) + 5, 99999, 63, 3), (12345678901, 1, 0, 1)]
    for seed, start, off, purpose in cases:
        h = int(counter_hash(torch.tensor(seed), torch.tensor(start), torch.tensor(off), purpose))
        assert h & M == ref(seed, start, off, purpose)


def test_counter_uniforms_are_uniform_and_distinct_per_counter():
    seeds = torch.arange(200_000)
    for dtype in (torch.float32, torch.float64):
        u = counter_uniform(seeds, torch.tensor(17), torch.tensor(0), 2, dtype)
        assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
        hist = torch.histc(u.double(), bins=20, min=0, max=1)
        assert float((hist / 10_000 - 1).abs().max()) < 0.05          # 20 bins of 10,000 +- 5 %
    a = counter_uniform(torch.tensor(3), torch.arange(1000), torch.tensor(0), 1)
    b = counter_uniform(torch.tensor(3), torch.arange(1000), torch.tensor(0), 2)
    assert len(set(a.tolist()) | set(b.tolist())) == 2000


def test_inverse_cdf_literal():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]] * 5, dtype=F64)
    u = torch.tensor([0.0, 0.2499, 0.25, 0.9999, 0.99999999999], dtype=F64)
    assert inverse_cdf(probs, u).tolist() == [1, 1, 3, 3, 3]
    assert inverse_cdf(probs * 3, u).tolist() == [1, 1, 3, 3, 3]      # unnormalised rows
    assert inverse_cdf(probs.float(), u.float()).tolist() == [1, 1, 3, 3, 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("method", ["token", "block"])
def test_counter_draws_give_the_oracle_law_over_many_seeds(dtype, method):
    """20,000 rows of one (draft, q, p) with different seeds in one call: the empirical law of the verdicts
    is the exact one within 4 standard errors (deterministic seeds: the same numbers every run)."""
    V, n = 4, 20_000
    q, p = _tables(13, V, 2)
    draft = [1, 3]
    want = enumerate_outcomes(lambda r: (lambda v: (v.accepted, v.next_token))(ORACLE[method](draft, q, p, r)))
    logits = torch.log(p).to(dtype)[None].expand(n, 3, V)
    rs = RowSampling.of([SamplingParams(1.0)] * n, V, "cpu", dtype)
    draws = CounterDraws(torch.arange(n) * 7919 + 1, torch.full((n,), 40))
    v = verify_batch(logits, torch.tensor([draft] * n), torch.full((n,), 2), rs, draws,
                     q=q.to(dtype)[None].expand(n, 2, V), method=method)
    got = {}
    for a, t, _ in v.tolist():
        got[(a, t)] = got.get((a, t), 0) + 1 / n
    for key in set(got) | set(want):
        w = want.get(key, 0.0)
        assert abs(got.get(key, 0.0) - w) <= 4 * (w * (1 - w) / n) ** 0.5 + 1e-9, key


def test_sample_batch_mixed_rows():
    """Greedy rows take the argmax; sampled rows draw from their own law (one branch per positive token)."""
    logits = torch.log(torch.tensor([[0.2, 0.5, 0.3], [0.6, 0.1, 0.3], [0.0, 0.0, 1.0]], dtype=F64))
    params = [SamplingParams(0.0), SamplingParams(1.0), SamplingParams(1.0, top_k=1)]
    rs = RowSampling.of(params, 3, "cpu", F64)
    got = enumerate_outcomes(lambda r: tuple(sample_batch(logits, rs, RngDraws([r] * 3))[0].tolist()))
    want = {(1, t, 2): float(w) for t, w in enumerate([0.6, 0.1, 0.3])}
    assert max_abs_diff(got, want) < 1e-12
    one = enumerate_outcomes(lambda r: (sample(logits_to_probs(logits[1], params[1]), r),))
    assert max_abs_diff({(k[1],): w for k, w in got.items()}, one) < 1e-12


def test_pick_rows_is_advanced_indexing_whatever_the_layout():
    """Row (b, idx_b) of every request by index_select over one flat view: a contiguous block, a slice of a
    longer one, a broadcast one and a transposed one; one whose vocabulary entries are not adjacent (by advanced
    indexing) all give x[b, idx_b]."""
    g = torch.Generator().manual_seed(0)
    whole = torch.randn(5, 6, 7, generator=g)
    idx = torch.tensor([0, 3, 2, 3, 1])
    rows = torch.arange(5)
    for x in (whole, whole[:, :4], whole[:1].expand(5, 6, 7), whole.transpose(0, 1)[:5, :4],
              whole.transpose(1, 2)[:, :4], whole[..., ::2]):
        assert torch.equal(pick_rows(x, idx), x[rows, idx])
        picked = torch.tensor([4, 0, 0, 2])                          # other rows, in any order
        assert torch.equal(pick_rows(x, idx[:4], picked), x[picked, idx[:4]])


def test_stack_rows_reuses_a_batch_it_was_cut_from():
    """Rows cut from one [B, n, V] batch in order come back as that batch (no copy); any other list is stacked,
    zero-padded where the lengths differ."""
    batch = torch.randn(3, 4, 5)
    lens = [4, 2, 3]
    rows = [batch[b, :n] for b, n in enumerate(lens)]
    got = stack_rows(rows)
    assert got.data_ptr() == batch.data_ptr() and got.shape == (3, 4, 5)
    for b, n in enumerate(lens):
        assert torch.equal(got[b, :n], rows[b])
    moved = stack_rows(rows[::-1])                                   # not in the batch's order: a copy
    assert moved.data_ptr() != batch.data_ptr()
    assert torch.equal(moved, torch.nn.utils.rnn.pad_sequence(rows[::-1], batch_first=True))
    same = stack_rows([batch[2, :3], batch[0, :3]])
    assert torch.equal(same, torch.stack([batch[2, :3], batch[0, :3]]))
    steps = torch.randn(4, 3, 5)                                     # [n, B, V]: a drafter's steps in order
    cut = [steps[:, b] for b in range(3)]
    got = stack_rows(cut)
    assert got.data_ptr() == steps.data_ptr() and torch.equal(got, steps.transpose(0, 1))


def test_inverse_cdf_in_two_levels_is_the_one_level_draw():
    """A wide row is drawn block by block: the same index as one cumulative sum over the row (float64, seeded u:
    no u falls within rounding of a boundary), zero entries and whole zero blocks never drawn, u = 0 and u -> 1
    landing on the first and last positive entries."""
    g = torch.Generator().manual_seed(3)
    V = 5 * 1024 + 300                                                 # five whole blocks and a tail
    probs = torch.rand(64, V, generator=g, dtype=F64) * (torch.rand(64, V, generator=g) < 0.3)
    probs[:, :2048] = 0.0                                              # two empty leading blocks
    probs[1::2, 4000:] = 0.0                                           # half the rows end inside a block
    u = torch.rand(64, generator=g, dtype=F64)
    cdf = probs.cumsum(-1)
    one = torch.searchsorted(cdf, (u[:, None] * cdf[:, -1:]).contiguous(), right=True)[:, 0]
    got = inverse_cdf(probs, u)
    assert torch.equal(got, one)
    assert bool((probs.gather(1, got[:, None]) > 0).all())
    first = (probs > 0).long().argmax(-1)
    last = V - 1 - (probs.flip(-1) > 0).long().argmax(-1)
    assert torch.equal(inverse_cdf(probs, torch.zeros(64, dtype=F64)), first)
    assert torch.equal(inverse_cdf(probs, torch.full((64,), 1 - 2 ** -53, dtype=F64)), last)
    assert torch.equal(inverse_cdf(probs.float(), torch.full((64,), 1 - 2 ** -24)), last)


@pytest.mark.parametrize("shape", [(3, 4096), (2, 3, 5 * 1024 + 17), (4, 9000), (2, 128256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_two_level_argmax_is_torchs_argmax_with_ties_and_nans(shape, dtype):
    """The greedy pass over wide rows (rejection.argmax) returns torch's index: the first of tied maxima, the
    first NaN, a maximum in the ragged last block, a row of -inf."""
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g).to(dtype)
    flat = x.view(-1, shape[-1])
    V = shape[-1]
    flat[0, [7, 2048, V - 1]] = 50.0                       # ties across blocks: the first wins
    flat[1, V - 3] = 60.0                                  # the maximum in the ragged tail
    if flat.shape[0] > 2:
        flat[2, [3000, 100]] = float("nan")                # the first NaN
    flat[-1] = float("-inf")                               # every entry -inf: index 0
    assert torch.equal(argmax(x), x.argmax(-1))
