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

from .sampling import Rng, residual, sample


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one draft: ``accepted`` draft tokens are kept, then ``next_token``."""

    accepted: int
    next_token: int
    bonus: bool  # True when next_token is a bonus token (whole draft accepted)


def verify_tokens(draft: list[int], q: torch.Tensor, p: torch.Tensor, rng: Rng) -> Verdict:
    """Token-level speculative sampling (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023, Algorithm 2).

    draft: ``[L]`` tokens x_1..x_L drawn from the drafter;
    q:     ``[L, V]`` drafter distributions, q[i] = M_s(. | x^{i});
    p:     ``[L+1, V]`` verifier distributions, p[i] = M_b(. | x^{i}).

    Accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection emit a
    recovered token from norm(max(0, p_i - q_i)); if all L are accepted emit a bonus token from
    p_L.  The emitted tokens are distributed exactly as the verifier's (Leviathan et al., Thm 3.5).
    """
    L = len(draft)
    assert q.shape[0] == L and p.shape[0] == L + 1, (q.shape, p.shape, L)
    for i, x in enumerate(draft):
        px, qx = float(p[i, x]), float(q[i, x])
        if not rng.bernoulli(px / qx if qx > 0 else 1.0 if px > 0 else 0.0):
            return Verdict(i, sample(residual(p[i], q[i]), rng), bonus=False)
    return Verdict(L, sample(p[L], rng), bonus=True)


# Verifiers by name (``--verify``); each maps (draft [L], q [L, V], p [L+1, V], rng) -> Verdict.
VERIFIERS = {"token": verify_tokens}
