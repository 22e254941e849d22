"""Target distributions for lossy speculative sampling and speculative cascades.

GenSpecSample (Narasimhan et al., *Faster Cascades via Speculative Decoding*, Algorithm 4;
:func:`cluster.core.verify.gen_spec_verify`) emits, at every draft position, a token distributed exactly
as a *target distribution* pi = T(q, p) built from the drafter's q and the verifier's p.  This module
holds those functions T, pure over ``[..., V]`` tensors (float64 in the per-row reference and the exactness
tests, float32 on the device in serving):

* :func:`lossy_target`    lossy speculative sampling (Narasimhan et al. 2024, Faster Cascades, Table 1 row
  "Lossy SpecDecoding", Lemma in its appendix; Tran-Thien 2023): pi = max{min{q, p/(1-alpha)}, p/beta},
  beta solved; or with a fixed beta in [1-alpha, 1] (section 2: "a common heuristic is to simply set
  beta = 1"), the law that procedure emits;
* :func:`cascade_target`  speculative cascades (Narasimhan et al. 2024, Faster Cascades, Algorithm 5 / eq. (6)):
  pi = (1-delta) q + delta p, delta from **chow**, **diff**, **opt** (Table 1), and the
  token-specific cascades (the later version of Narasimhan et al., *Faster Cascades via Speculative Decoding*,
  section 5): pi(v) = q(v)(1-r(v)) + p(v) * sum_v' r(v') q(v'), r from **token_v1/v2/v3**.

Temperature / top-p (Narasimhan et al., Faster Cascades (later version), appendix C.1): the deferral
rules read the *unscaled* distributions ``q_raw, p_raw``; the mixture is built from the *scaled* ones
``q, p`` (what is actually sampled), and OPT's TV distance uses the scaled ones too.  Lossy sampling uses
the scaled ones throughout (appendix C.2).

alpha conventions (one ``--alpha`` for every rule): ``alpha = 1`` never defers for every rule
(pi = q); ``alpha = -2`` always defers for every rule (pi = p; for OPT up to the case TV(p,q) = 0,
where p = q anyway).  Lossy sampling takes alpha in [0, 1); ``alpha = 0`` is lossless (pi = p).
"""
from __future__ import annotations

import torch

from cluster.errors import ParamError, check_float

ALPHA_RANGE = (-2.0, 1.0)     # cascade rules: -2 = always defer, 1 = never defer


BETA_SOLVE = "solve"      # lossy_target's beta: solved per position (Tran-Thien 2023) instead of a number


def _real(q: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both in their common floating dtype (float64 when neither is floating)."""
    dt = torch.promote_types(q.dtype, p.dtype)
    dt = dt if dt.is_floating_point else torch.float64
    return q.to(dt), p.to(dt)


def lossy_target(q: torch.Tensor, p: torch.Tensor, alpha: float, beta: float | str = BETA_SOLVE) -> torch.Tensor:
    """Lossy speculative sampling's target: beta solved (:data:`BETA_SOLVE`) or a fixed number
    (:func:`lossy_target_fixed_beta`, e.g. the paper's heuristic beta = 1).

    Solved: pi = max{min{q, p/(1-alpha)}, p/beta}, with beta >= 1-alpha solved so that sum pi = 1.

    Narasimhan et al. 2024, Faster Cascades, Table 1 ("Lossy SpecDecoding") and appendix D.3 (the condition
    sum max{0, q - p/(1-alpha)} = sum max{0, p/beta - q} of Tran-Thien 2023 is exactly sum pi = 1).
    Run through GenSpecSample, this accepts x w.p. min(1, p(x) / ((1-alpha) q(x))) and recovers from
    norm(max{0, p/beta - q}) (Narasimhan et al. 2024, Faster Cascades, section 2).

    q, p: ``[..., V]`` probability tensors; alpha in [0, 1).  Returns pi ``[..., V]`` (in the inputs' dtype).

    Solved exactly, not by grid search: with t = 1/beta in (0, 1/(1-alpha)] and m = min{q, p/(1-alpha)},
    g(t) = sum_x max{m_x, t p_x} is continuous, non-decreasing and piecewise linear with breakpoints
    b_x = m_x / p_x; g(b_min) = sum m <= 1 <= g(1/(1-alpha)) = 1/(1-alpha).  We find the last breakpoint
    with g <= 1 and solve the linear piece.  alpha = 0 returns p itself (lossless).
    """
    alpha = check_float("alpha", alpha, 0.0, 1.0, high_open=True)
    if beta != BETA_SOLVE:
        return lossy_target_fixed_beta(q, p, alpha, beta)
    q, p = _real(q, p)
    if alpha == 0.0:
        return p.clone()
    m = torch.minimum(q, p / (1.0 - alpha))                                     # [..., V]
    pos = p > 0
    b = torch.where(pos, m / torch.where(pos, p, 1.0), torch.inf)               # [..., V] breakpoints
    b, order = torch.sort(b, dim=-1)
    ps, ms = p.gather(-1, order), m.gather(-1, order)
    P = ps.cumsum(-1)                                                          # sum p over b_x <= b_j
    M = ms.sum(-1, keepdim=True) - ms.cumsum(-1)                               # sum m over b_x > b_j
    g = torch.where(torch.isfinite(b), b * P + M, torch.inf)                   # g(b_j)
    j = ((g <= 1.0).sum(-1, keepdim=True) - 1).clamp(min=0)                    # last j with g(b_j) <= 1
    Pj, Mj = P.gather(-1, j), M.gather(-1, j)
    t = ((1.0 - Mj) / Pj).clamp(max=1.0 / (1.0 - alpha))                       # [..., 1]
    pi = torch.maximum(m, t * p)
    return pi / pi.sum(-1, keepdim=True)


def lossy_target_fixed_beta(q: torch.Tensor, p: torch.Tensor, alpha: float, beta: float = 1.0) -> torch.Tensor:
    """The law lossy speculative sampling emits with a *fixed* beta (Narasimhan et al. 2024, Faster Cascades,
    section 2: accept x w.p. min(1, p(x) / ((1-alpha) q(x))), else resample from norm(max{0, p/beta - q});
    "a common heuristic is to simply set beta = 1", their main lossy baseline, section 6):

        pi = m + (1 - sum m) * norm(max{0, p/beta - q}),   m = min{q, p/(1-alpha)}.

    With beta in [1-alpha, 1] this pi, run through GenSpecSample (Algorithm 4), *is* that procedure: where
    p/beta > q, also p/(1-alpha) > q, so m = q and pi >= q (accepted w.p. 1, as min(1, p/((1-alpha) q)) = 1);
    elsewhere pi = m <= q (accepted w.p. m/q); and max{0, pi - q} = (1 - sum m) max{0, p/beta - q}, the same
    residual.  beta <= 1 keeps that residual non-empty whenever a rejection is possible (sum p/beta >= sum q,
    with equality only if beta = 1 and p = q, where nothing is rejected).  Table 1's max{m, p/beta} is a
    distribution only for the solved beta (:func:`lossy_target`); alpha = 0, beta = 1 gives pi = p.

    q, p: ``[..., V]``; alpha in [0, 1); beta in [1-alpha, 1].  Returns pi ``[..., V]`` (in the inputs' dtype).
    """
    alpha = check_float("alpha", alpha, 0.0, 1.0, high_open=True)
    beta = check_beta(beta, alpha)
    q, p = _real(q, p)
    m = torch.minimum(q, p / (1.0 - alpha))                                     # [..., V]
    r = torch.clamp(p / beta - q, min=0.0)                                     # [..., V]
    mass = r.sum(-1, keepdim=True)
    r = r / torch.where(mass > 0, mass, 1.0)
    return m + (1.0 - m.sum(-1, keepdim=True)).clamp(min=0.0) * r


def check_beta(beta, alpha: float) -> float:
    """A fixed beta of lossy speculative sampling: a number in [1 - alpha, 1] (ParamError otherwise)."""
    low = 1.0 - float(alpha)
    try:
        value = float(beta)
    except (TypeError, ValueError):
        value = None
    if value is None or isinstance(beta, bool) or not low - 1e-12 <= value <= 1.0:
        raise ParamError("beta", f"'{BETA_SOLVE}' or a number in [1 - alpha, 1] = [{low:g}, 1]", beta)
    return value


def tv(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """D_TV(p, q) = sum_v max{0, p(v) - q(v)} over the last axis (Narasimhan et al. 2024, Faster Cascades,
    eq. under (7))."""
    return torch.clamp(p - q, min=0.0).sum(-1)


def defer_chow(q: torch.Tensor, p: torch.Tensor, alpha: float, **_) -> torch.Tensor:
    """delta = 1(max q < 1 - alpha) (Narasimhan et al. 2024, Faster Cascades, eq. (2)); ``[...]`` bool. Ignores p."""
    return q.amax(-1) < 1.0 - alpha


def defer_diff(q: torch.Tensor, p: torch.Tensor, alpha: float, **_) -> torch.Tensor:
    """delta = 1(max q < max p - alpha) (Narasimhan et al. 2024, Faster Cascades, eq. (5))."""
    return q.amax(-1) < p.amax(-1) - alpha


def defer_opt(q: torch.Tensor, p: torch.Tensor, alpha: float, tv_dist: torch.Tensor | None = None,
              **_) -> torch.Tensor:
    """delta = 1(max q < max p - alpha * TV) (Narasimhan et al. 2024, Faster Cascades, eq. (10));
    ``tv_dist`` from the scaled distributions (Narasimhan et al. 2024, Faster Cascades, section 4.3 /
    Narasimhan et al., Faster Cascades (later version), appendix C.1), default TV(p, q)."""
    if tv_dist is None:
        tv_dist = tv(p, q)
    return q.amax(-1) < p.amax(-1) - alpha * tv_dist


def defer_token_v1(q: torch.Tensor, p: torch.Tensor, alpha: float, **_) -> torch.Tensor:
    """r(v) = 1(q(v) < max p - alpha) (Narasimhan et al., Faster Cascades (later version), section 5,
    TokenV1); ``[..., V]`` bool."""
    return q < p.amax(-1, keepdim=True) - alpha


def defer_token_v2(q: torch.Tensor, p: torch.Tensor, alpha: float, **_) -> torch.Tensor:
    """r(v) = 1(p(v) < max p - alpha) (Narasimhan et al., Faster Cascades (later version), section 5, TokenV2)."""
    return p < p.amax(-1, keepdim=True) - alpha


def defer_token_v3(q: torch.Tensor, p: torch.Tensor, alpha: float, **_) -> torch.Tensor:
    """r(v) = 1(p(v) < (1 - alpha) max p) (Narasimhan et al., Faster Cascades (later version), section 5, TokenV3)."""
    return p < (1.0 - alpha) * p.amax(-1, keepdim=True)


SEQUENCE_RULES = {"chow": defer_chow, "diff": defer_diff, "opt": defer_opt}


TOKEN_RULES = {"token_v1": defer_token_v1, "token_v2": defer_token_v2, "token_v3": defer_token_v3}


RULES = {**SEQUENCE_RULES, **TOKEN_RULES}


def mix(q: torch.Tensor, p: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """T_delta(q, p) = (1 - delta) q + delta p with delta ``[...]`` in {0, 1} (Narasimhan et al. 2024,
    Faster Cascades, eq. (6))."""
    return torch.where(delta.unsqueeze(-1), p, q)


def token_mix(q: torch.Tensor, p: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """pi(v) = q(v) (1 - r(v)) + p(v) * sum_v' r(v') q(v') (Narasimhan et al., Faster Cascades (later
    version), section 5); r ``[..., V]``."""
    rf = r.to(q.dtype)
    eta = (rf * q).sum(-1, keepdim=True)                                       # [..., 1]
    return q * (1.0 - rf) + p * eta


def cascade_target(q: torch.Tensor, p: torch.Tensor, rule: str, alpha: float,
                   q_raw: torch.Tensor | None = None, p_raw: torch.Tensor | None = None) -> torch.Tensor:
    """pi for speculative cascade ``rule`` at ``alpha`` (``[..., V]``).

    q, p: the scaled (sampled) drafter / verifier distributions ``[..., V]``; q_raw, p_raw: the
    unscaled ones the rule reads (default: q, p).  Narasimhan et al., Faster Cascades (later version), appendix C.1.
    """
    if rule not in RULES:
        raise ParamError("rule", "one of " + ", ".join(RULES), rule)
    alpha = check_float("alpha", alpha, *ALPHA_RANGE)
    q, p = _real(q, p)
    q_raw = q if q_raw is None else q_raw.to(q.dtype)
    p_raw = p if p_raw is None else p_raw.to(q.dtype)
    if rule in TOKEN_RULES:
        return token_mix(q, p, TOKEN_RULES[rule](q_raw, p_raw, alpha))
    return mix(q, p, SEQUENCE_RULES[rule](q_raw, p_raw, alpha, tv_dist=tv(p, q)))


def deferral_rate(q_raw: torch.Tensor, p_raw: torch.Tensor, q: torch.Tensor, rule: str,
                  alpha: float, p: torch.Tensor | None = None) -> torch.Tensor:
    """Expected fraction of drafter mass the rule defers, ``[...]`` (1 or 0 for sequence rules,
    sum_v r(v) q(v) for token rules); for statistics only."""
    if rule in TOKEN_RULES:
        return (TOKEN_RULES[rule](q_raw, p_raw, alpha).to(q.dtype) * q).sum(-1)
    tvd = tv(p if p is not None else p_raw, q)
    return SEQUENCE_RULES[rule](q_raw, p_raw, alpha, tv_dist=tvd).to(q.dtype)
