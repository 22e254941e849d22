"""How far apart two float32 forwards of one model may legitimately be, and a logprob comparison built on it.

Speculative decoding reads the target's logits from a verification forward over k + 1 new tokens, plain decoding
from a one-token forward; batching, rollback and a no-cache oracle add other routes to the same numbers. The math is
the same, the arithmetic is not: the GEMM and softmax kernels choose their blocking (and so the order of every sum)
from the matrix shapes and from the CPU's vector units (AVX2, AVX-512, AMX), so the same logit rounds differently
from one route to another and from one x86-64 CPU to another. Token equality stays exact in every test; only the
reported floats get a tolerance, and this one is derived, not fitted to one machine:

* each rounding is within float32's epsilon (2**-23 ~ 1.2e-7) relative; a logit is a dot product over the hidden
  width fed by a chain of such reductions through every layer, and a log-softmax subtracts a log-sum-exp over the
  vocabulary, so the error grows with depth and width, not with the value compared;
* measured: 1.0e-5 to 1.1e-5 between a 5-token verification and a one-token forward on an x86-64 Xeon (~90 epsilon,
  which failed the 1e-5 this module replaces), up to 2e-5 across batch shapes;
* ``FORWARD_ATOL`` = 1,000 epsilon (~1.2e-4): an order of magnitude above what was seen on any machine, as in the
  architecture matrix (tests/models/test_architectures.py), and still far below any difference that would change
  a token or a reported top-n list except at a genuine near-tie, which ``assert_logprobs_close`` allows for.
"""
from __future__ import annotations

import torch

FORWARD_ATOL = 1000 * torch.finfo(torch.float32).eps           # ~1.2e-4, see the module docstring


def assert_logprobs_close(got, want, atol: float = FORWARD_ATOL) -> None:
    """Two lists of per-token ``TokenLogprob``: the same tokens exactly, their logprobs within ``atol``, and the
    same top-n entries, where two entries whose values lie within ``atol`` of each other may trade places (a near-tie
    that float32 routes may break either way) and the last place may differ only by such a tie."""
    assert [g.token_id for g in got] == [w.token_id for w in want]
    for g, w in zip(got, want):
        assert abs(g.logprob - w.logprob) <= atol, (g.token_id, g.logprob, w.logprob)
        assert len(g.top) == len(w.top)
        ranks = dict(w.top)
        floor = w.top[-1][1] if w.top else float("-inf")
        for i, ((gi, gv), (_, wv)) in enumerate(zip(g.top, w.top)):
            assert abs(gv - wv) <= atol, (i, g.top, w.top)            # the i-th largest value, either route
            if gi in ranks:
                assert abs(gv - ranks[gi]) <= atol, (gi, g.top, w.top)
            else:                                                      # swapped in at the edge by a near-tie
                assert gv <= floor + atol, (gi, g.top, w.top)
