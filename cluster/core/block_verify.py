"""Block verification (Sun et al., *Optimal Block-Level Draft Verification for Accelerating
Speculative Decoding*, Algorithm 3 "BlockVerify", in its final published form).

Token verification accepts each draft token on its own (accept x_i w.p. min(1, p_i(x_i)/q_i(x_i)),
stop at the first rejection).  Block verification judges the draft *as a block*: it carries the
clipped likelihood ratio of the whole prefix, so an unlikely token can be rescued by a later likely
one.  It is lossless (the output follows the target exactly) and its expected number of accepted
tokens, sum_i E[p_i], is never below token verification's (Sun et al., Block-Level Draft Verification,
Theorem 2 / Lemma 2).
"""
from __future__ import annotations

import math

import torch

from cluster.core.sampling import Rng, sample
from cluster.core.verify import Verdict


def block_weights(draft: list[int], q: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The clipped prefix ratios p_0..p_L and the stopping probabilities h_1..h_L.

    draft: ``[L]`` tokens X_1..X_L; q: ``[L, V]`` drafter rows M_s(. | X^{i-1});
    p: ``[L+1, V]`` target rows M_b(. | X^{i-1}).  Returns (weights ``[L+1]``, h ``[L]``), float64:

    * p_0 = 1, p_i = min(p_{i-1} * M_b(X_i | X^{i-1}) / M_s(X_i | X^{i-1}), 1)  — accumulated in
      log space, since the running product of ratios can underflow long before it is clipped;
    * R_i = sum_x max(p_i * M_b(x | X^i) - M_s(x | X^i), 0);
      h_i = R_i / (R_i + 1 - p_i) for i < L (1 when the denominator is 0), h_L = p_L.
    """
    L = len(draft)
    q, p = q.to(torch.float64), p.to(torch.float64)
    log_w = [0.0]                                                      # log p_0 = 0
    for i, x in enumerate(draft):
        pb, qs = float(p[i, x]), float(q[i, x])
        if pb <= 0.0:
            step = -math.inf
        elif qs <= 0.0:                                                # off-support draft: ratio inf
            step = math.inf
        else:
            step = math.log(pb) - math.log(qs)
        log_w.append(min(log_w[-1] + step, 0.0) if log_w[-1] > -math.inf else -math.inf)
    w = torch.tensor(log_w, dtype=torch.float64).exp()                 # [L+1]
    R = torch.clamp(w[:L, None] * p[:L] - q, min=0.0).sum(-1)          # [L]  (row i is position i)
    denom = R + 1.0 - w[:L]
    h = torch.where(denom > 0, R / torch.where(denom > 0, denom, 1.0), torch.ones_like(R))  # [L]
    # h_i for i = 1..L-1 uses R_i, i.e. row i; h_L = p_L.
    h = torch.cat([h[1:], w[L:]]) if L else h                          # [L]: h_1..h_L
    return w, h


def verify_block(draft: list[int], q: torch.Tensor, p: torch.Tensor, rng: Rng) -> Verdict:
    """Block verification: draft ``[L]``, q ``[L, V]``, p ``[L+1, V]`` -> :class:`Verdict`.

    Draws eta_i ~ Bernoulli(h_i) for every i = 1..L (the scan does not stop at a failure);
    tau = the largest i with a success (0 if none).  If tau = L the next token is a bonus token from
    M_b(. | X^L); otherwise it is a correction token from
    norm(max(p_tau * M_b(. | X^tau) - M_s(. | X^tau), 0)).  Sun et al., Block-Level Draft Verification,
    Algorithm 3 (final form).
    """
    L = len(draft)
    assert q.shape[0] == L and p.shape[0] == L + 1, (q.shape, p.shape, L)
    if L == 0:
        return Verdict(0, sample(p[0].to(torch.float64), rng), bonus=True)
    w, h = block_weights(draft, q, p)
    tau = 0
    for i in range(1, L + 1):
        if rng.bernoulli(float(h[i - 1])):
            tau = i
    if tau == L:
        return Verdict(L, sample(p[L].to(torch.float64), rng), bonus=True)
    target = p[tau].to(torch.float64)
    r = torch.clamp(w[tau] * target - q[tau].to(torch.float64), min=0.0)   # [V]
    mass = float(r.sum())
    # mass == 0 only on floating-point ties (p_tau = 1 and M_b = M_s there), where it has probability
    # zero in exact arithmetic; fall back to the target row.
    return Verdict(tau, sample(r / mass if mass > 0 else target, rng), bonus=False)

