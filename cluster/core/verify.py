"""Draft verification: the rejection sampler of speculative sampling.

Terminology (as in vLLM's rejection sampler):

* **accepted** tokens: the prefix of the draft the verifier keeps;
* **recovered** token: drawn from the residual distribution at the first rejected position;
* **bonus** token: drawn from the verifier at position L+1 when the whole draft is accepted.

Every step therefore emits ``accepted + 1`` tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from cluster.core.sampling import Rng, residual, sample


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one draft: ``accepted`` draft tokens are kept, then ``next_token``."""

    accepted: int
    next_token: int
    bonus: bool  # True when next_token is a bonus token (whole draft accepted)


def gen_spec_prefix(draft: list[int], q: torch.Tensor, pi: torch.Tensor, rng: Rng) -> Verdict | None:
    """The accept / recover part of GenSpecSample (Narasimhan et al., *Faster Cascades via Speculative
    Decoding*, Algorithm 4), shapes as in :func:`gen_spec_verify`: accept x_i with probability
    min(1, pi_i(x_i) / q_i(x_i)); at the first rejection return the verdict with a **recovered** token from
    norm(max(0, pi_i - q_i)).  ``None`` when all L are accepted (the caller draws the bonus token)."""
    L = len(draft)
    assert q.shape[0] == L and pi.shape[0] == L, (q.shape, pi.shape, L)
    for i, x in enumerate(draft):
        pix, qx = float(pi[i, x]), float(q[i, x])
        if not rng.bernoulli(pix / qx if qx > 0 else 1.0 if pix > 0 else 0.0):
            return Verdict(i, sample(residual(pi[i], q[i]), rng), bonus=False)
    return None


def gen_spec_verify(draft: list[int], q: torch.Tensor, pi: torch.Tensor, p_bonus: torch.Tensor,
                    rng: Rng) -> Verdict:
    """GenSpecSample (Narasimhan et al., *Faster Cascades via Speculative Decoding*, Algorithm 4).

    draft:   ``[L]`` tokens x_1..x_L drawn from the drafter;
    q:       ``[L, V]`` drafter distributions q_i = q(. | x^{i-1});
    pi:      ``[L, V]`` target distributions pi_i = T(q_i, p_i) to mimic at each draft position;
    p_bonus: ``[V]``   the distribution of the bonus token after the whole draft: p(. | x^L) in the first
             version of the paper, pi_{L+1} = T(q_{L+1}, p_{L+1}) in its later version.

    Accept x_i with probability min(1, pi_i(x_i) / q_i(x_i)); at the first rejection emit a
    **recovered** token from norm(max(0, pi_i - q_i)); if all L are **accepted** emit a **bonus**
    token from p_bonus.  Each emitted token at a draft position is distributed exactly as pi_i.
    """
    verdict = gen_spec_prefix(draft, q, pi, rng)
    return verdict if verdict is not None else Verdict(len(draft), sample(p_bonus, rng), bonus=True)


def verify_tokens(draft: list[int], q: torch.Tensor, p: torch.Tensor, rng: Rng) -> Verdict:
    """Token-level speculative sampling (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023, Algorithm 2).

    q: ``[L, V]`` drafter distributions; p: ``[L+1, V]`` verifier distributions p_i = M_b(. | x^{i-1}).
    This is :func:`gen_spec_verify` with pi = p: accept x_i w.p. min(1, p_i(x_i) / q_i(x_i)), recover
    from norm(max(0, p_i - q_i)), bonus from p_{L+1}.  The output is distributed exactly as the
    verifier (Leviathan et al., Theorem 3.5): lossless.
    """
    L = len(draft)
    assert p.shape[0] == L + 1, (p.shape, L)
    return gen_spec_verify(draft, q, p[:L], p[L], rng)
