"""The batched sampler: every row of a step sampled and verified in one call, on the logits' device.

One call per verification round covers the whole batch (vLLM's ``RejectionSampler`` is the model; the code is
ours).  Shapes (B rows, K the longest draft of the round, V the vocabulary):

  logits    [B, K+1, V]  the target's raw logits; row b's positions 0..L_b are its verification rows
  draft     [B, K]       long, the drafted tokens x_1..x_{L_b}, padded past L_b
  lengths   [B]          long, L_b (0: a plain decoding step, only the bonus token is drawn)
  q         [B, K, V]    the distributions the drafts were drawn from (None: every draft deterministic)
  det       [B]          bool, row b's drafts are deterministic (one-hot q: Max-Gram, a prediction, greedy);
                         None: none is where q is given

and it returns, per row:

* **accepted** tokens: the prefix of the draft the verifier keeps;
* the **recovered** token: drawn from the residual norm(max(0, p_i - q_i)) at the first rejected position
  (token verification; Leviathan et al. 2023, *Fast Inference from Transformers via Speculative Decoding*,
  Alg. 1; Chen et al. 2023, Alg. 2), or from norm(max(w_tau p_tau - q_tau, 0)) (block verification; Sun et al.,
  *Block Verification Accelerates Speculative Decoding*, Alg. 3);
* the **bonus** token: drawn from p_{L+1} when the whole draft is accepted.

A greedy row is an argmax comparison and materialises no probability row.  Sampled rows use the per-row
temperature / top-k / top-p as tensors (:class:`RowSampling`), in the logits' dtype: float32 on the device in
serving, float64 in the exact-enumeration tests (one code path, two dtypes).  Every random draw goes through a
:class:`cluster.core.draws.Draws` (counter-based on the device in serving, per-row sources in the enumeration
tests).  The per-row code of :mod:`cluster.core.verify` and
:mod:`cluster.core.block_verify` is this module's test oracle.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from cluster.core.draws import FINAL, Draws
from cluster.core.sampling import SamplingParams


# -- per-row sampling settings as tensors -------------------------------------------------------------
@dataclass(frozen=True)
class RowSampling:
    """Per-row sampling settings ``[B]`` on a device, with the host-side facts that pick the code path."""

    temperature: torch.Tensor    # [B] float, 1 where greedy (never divides by 0)
    top_k: torch.Tensor          # [B] long, V where off
    top_p: torch.Tensor          # [B] float, 1 where off
    greedy: torch.Tensor         # [B] bool
    n_greedy: int                # host: how many rows are greedy
    max_top_k: int               # host: the largest top-k in force (0: none)
    any_top_p: bool              # host: some row filters by top-p
    unit_temperature: bool = False   # host: every row's temperature is 1 (or greedy)

    @classmethod
    def of(cls, params: list[SamplingParams], vocab: int, device, dtype=torch.float32) -> "RowSampling":
        greedy = [p.greedy for p in params]
        ks = [p.top_k if 0 < p.top_k < vocab and not p.greedy else vocab for p in params]
        ps = [p.top_p if not p.greedy else 1.0 for p in params]
        return cls(torch.tensor([1.0 if g else p.temperature for g, p in zip(greedy, params)], dtype=dtype,
                                device=device),
                   torch.tensor(ks, dtype=torch.long, device=device),
                   torch.tensor(ps, dtype=dtype, device=device),
                   torch.tensor(greedy, dtype=torch.bool, device=device),
                   sum(greedy), max([k for k in ks if k < vocab], default=0), any(p < 1.0 for p in ps),
                   all(g or p.temperature == 1.0 for g, p in zip(greedy, params)))

    @property
    def rows(self) -> int:
        return int(self.temperature.shape[0])

    @property
    def all_greedy(self) -> bool:
        return self.n_greedy == self.rows


def _per_row(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t [B]`` shaped to broadcast over ``like [B, ..., V]``."""
    return t.view(-1, *([1] * (like.dim() - 1)))


def _scaled(logits: torch.Tensor, rs: RowSampling) -> torch.Tensor:
    """``logits / temperature`` per row, in ``rs``' dtype (no pass over the logits where every row's is 1)."""
    x = logits.to(rs.temperature.dtype)
    if rs.unit_temperature:
        return x
    # the row's maximum first, so that a tiny temperature sends the others to -inf, never the top to inf - inf
    t = _per_row(rs.temperature.clamp(min=torch.finfo(x.dtype).tiny), x)
    return (x - x.amax(-1, keepdim=True)) / t


def probs_batch(logits: torch.Tensor, rs: RowSampling, out: torch.Tensor | None = None) -> torch.Tensor:
    """The sampling law of every row: ``logits [B, ..., V]`` -> probabilities, in ``rs``' dtype (written into
    ``out`` where given: a caller's slice of a larger buffer).  Row b is exactly
    :func:`cluster.core.sampling.logits_to_probs` under row b's settings (temperature, then top-k on the scaled
    logits, softmax, then the smallest top-p prefix); a greedy row's law is left unscaled (its callers take the
    argmax instead)."""
    x = _scaled(logits, rs)
    V = x.shape[-1]
    if rs.max_top_k:
        top = torch.topk(x, rs.max_top_k, dim=-1).values                      # [B, ..., k_max]
        k = _per_row(rs.top_k.clamp(max=rs.max_top_k), x).expand(*x.shape[:-1], 1)
        kth = top.gather(-1, k - 1)                                            # [B, ..., 1]
        off = _per_row(rs.top_k >= V, x)
        x = x.masked_fill((x < kth) & ~off, float("-inf"))
    if not rs.any_top_p:
        return torch.softmax(x, dim=-1, out=out)
    probs = torch.softmax(x, dim=-1)
    sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
    top_p = _per_row(rs.top_p, probs)
    drop = ((sorted_p.cumsum(-1) - sorted_p) >= top_p) & (top_p < 1.0)
    drop[..., 0] = False                          # the top token always stays (a top_p below the dtype's range)
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
    probs = probs / probs.sum(-1, keepdim=True)
    return probs if out is None else out.copy_(probs)


# -- the greedy pass --------------------------------------------------------------------------------------
ARGMAX_BLOCK = 256           # entries per block of :func:`argmax` (256: the fastest at V = 4,096 and 128,256)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` (the first index of the largest entry, a NaN counting as largest), in two levels over a
    wide last dimension: each block of :data:`ARGMAX_BLOCK` entries' maximum (a vectorised reduction), the first
    block holding the row's maximum, the first index of it inside that block.  Written here because torch's CPU
    argmax is a scalar loop: over a 32 x 5 x 128,256 block it costs more than a softmax (47 vs 41 ms on one
    thread), the two levels 5 ms (below 16k entries in all, torch's is the faster); the answer is the same index,
    ties and NaNs included (tested)."""
    V = x.shape[-1]
    n = V // ARGMAX_BLOCK
    if n < 8 or x.numel() < 1 << 14 or x.dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        return x.argmax(-1)
    top = x[..., :n * ARGMAX_BLOCK].unflatten(-1, (n, ARGMAX_BLOCK)).amax(-1)                 # [..., n]
    if V > n * ARGMAX_BLOCK:
        top = torch.cat([top, x[..., n * ARGMAX_BLOCK:].amax(-1, keepdim=True)], -1)
    at = top.argmax(-1, keepdim=True) * ARGMAX_BLOCK + torch.arange(ARGMAX_BLOCK, device=x.device)
    inside = x.gather(-1, at.clamp(max=V - 1)).masked_fill(at >= V, float("-inf"))          # [..., BLOCK]
    return at[..., 0] + inside.argmax(-1)


# -- sampling and verification --------------------------------------------------------------------------
def sample_batch(logits: torch.Tensor, rs: RowSampling, draws: Draws, offset: int = 0,
                 purpose: int = FINAL, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One token per row of ``logits [B, V]``: the argmax for greedy rows, a draw from the row's law for the
    others -> (tokens [B], the laws [B, V] (in ``out`` where given) or None when every row is greedy)."""
    arg = argmax(logits) if rs.n_greedy else None
    if rs.all_greedy:
        return arg, None
    probs = probs_batch(logits, rs, out)
    tok = draws.categorical(probs, ~rs.greedy, purpose, offset)
    return (tok if arg is None else torch.where(rs.greedy, arg, tok)), probs


@dataclass(frozen=True)
class Verdicts:
    """One verification round's outcome, per row ``[B]`` (long): ``accepted`` draft tokens are kept, then
    ``next_token`` (recovered, or bonus where ``bonus`` is 1).  One device-to-host read: :meth:`tolist`."""

    accepted: torch.Tensor
    next_token: torch.Tensor
    bonus: torch.Tensor

    def tolist(self) -> list[tuple[int, int, bool]]:
        rows = torch.stack([self.accepted, self.next_token, self.bonus.long()]).tolist()
        return [(a, t, bool(b)) for a, t, b in zip(*rows)]


class Laws:
    """The sampling laws of rows ``[B, n, V]`` given as raw logits (or as probabilities), materialised once, when
    first read: the probabilities of given tokens (:meth:`at`), one row per request (:meth:`row`), all of them
    (:meth:`full`).  (A fused softmax is the cheapest pass there is over the rows: a log-sum-exp alone costs more
    on the CPU, and every later read is a gather.)"""

    def __init__(self, logits: torch.Tensor | None, rs: RowSampling, probs: torch.Tensor | None = None):
        self.logits, self.rs, self.probs = logits, rs, probs

    def full(self) -> torch.Tensor:
        if self.probs is None:
            self.probs = probs_batch(self.logits, self.rs)
        return self.probs

    def at(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens [B, m]`` -> the probability of ``tokens[b, i]`` under row (b, i), ``[B, m]``."""
        return self.full()[:, :tokens.shape[1]].gather(-1, tokens[..., None])[..., 0]

    def row(self, idx: torch.Tensor) -> torch.Tensor:
        """``idx [B]`` -> row (b, idx_b) of every request, ``[B, V]`` (whole rows copied by ``index_select``:
        advanced indexing walks the elements, several times slower over V-wide rows on the CPU)."""
        return pick_rows(self.full(), idx)


def pick_rows(x: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """``x [B, n, V]``, ``idx [R]`` -> ``x[rows_r, idx_r]`` ``[R, V]`` (``rows`` default: 0..B-1): whole rows
    copied by ``index_select`` over ``x``'s rows as one ``[*, V]`` view where its layout allows (a slice of a
    longer ``[B, n', V]``, or of an ``[n', B, V]`` transposed, too); advanced indexing walks the elements,
    several times slower over V-wide rows on the CPU."""
    B, n, V = x.shape
    rows = torch.arange(B, device=idx.device) if rows is None else rows
    if not (B and n and x.stride(2) == 1 and x.stride(1) % V == 0 and x.stride(0) % V == 0 and x.stride(1)):
        return x[rows, idx]
    m, s = x.stride(0) // V, x.stride(1) // V             # rows of V between two requests', two positions' rows
    flat = x.as_strided(((B - 1) * m + (n - 1) * s + 1, V), (V, 1))
    return flat.index_select(0, rows * m + idx * s)


def verify_batch(logits: torch.Tensor, draft: torch.Tensor, lengths: torch.Tensor, rs: RowSampling,
                 draws: Draws, *, q: "torch.Tensor | Laws | None" = None, det: torch.Tensor | None = None,
                 method: str = "token", target: torch.Tensor | None = None,
                 p: torch.Tensor | None = None) -> Verdicts:
    """The rejection sampler over every row of a round (shapes in the module docstring); ``method``
    ``token`` (Leviathan et al., Alg. 1), ``block`` (Sun et al., Alg. 3) or ``accept`` (every draft token is
    kept, only the next token is drawn: a cascade that did not defer).  ``q``: the draft laws as
    probabilities ``[B, K, V]``, or as :class:`Laws` (a drafter's raw logits, read only where needed).

    ``target [B, K, V]``: GenSpecSample (Narasimhan et al., *Faster Cascades via Speculative Decoding*, Alg. 4)
    towards pi = ``target`` at the drafted positions instead of p: accept x_i w.p. min(1, pi_i(x_i) / q_i(x_i)),
    recover from norm(max(0, pi_i - q_i)); the bonus still comes from p's row L.  ``p [B, K+1, V]``: the
    verifier's laws as probabilities (default: from ``logits`` under ``rs``)."""
    B, K1, V = logits.shape
    K = K1 - 1
    rows = torch.arange(B, device=logits.device)
    valid = torch.arange(K, device=logits.device)[None] < lengths[:, None]          # [B, K]
    if rs.n_greedy:                                                                 # argmax comparisons
        arg = argmax(logits)                                                        # [B, K+1]
        g_acc = lengths if method == "accept" else ((draft == arg[:, :K]) & valid).long().cumprod(-1).sum(-1)
        g_next = arg[rows, g_acc]
        if rs.all_greedy:
            return Verdicts(g_acc, g_next, g_acc == lengths)
    p = Laws(logits, rs, probs=p)
    if isinstance(q, torch.Tensor):
        q = Laws(None, rs, probs=q)
    if method == "accept":
        return _accept_all(p, lengths, rs, draws, g_acc if rs.n_greedy else None, g_next if rs.n_greedy else None)
    pi = p if target is None else Laws(None, rs, probs=target)
    if target is not None and method != "token":
        raise ValueError(f"GenSpecSample verifies token by token, not by {method!r}")
    px = pi.at(draft)                                                               # [B, K]
    qx = torch.ones_like(px) if q is None else q.at(draft)
    if q is not None and det is not None:
        qx = torch.where(det[:, None], 1.0, qx)
    live = valid & ~rs.greedy[:, None]
    if method == "token":
        ratio = torch.where(qx > 0, px / torch.where(qx > 0, qx, 1.0), (px > 0).to(px.dtype))
        ok = draws.bernoulli(ratio.clamp(max=1.0), live, until_false=True)
        acc = (ok & valid).long().cumprod(-1).sum(-1)                               # [B]
        scale = None
    elif method == "block":
        det_b = torch.zeros(B, dtype=torch.bool, device=px.device) if det is None else det
        acc, scale = _block_tau(p.full(), px, qx, draft, lengths, valid, det_b, None if q is None else q.full(),
                                draws, live)
    else:
        raise ValueError(f"unknown verification method {method!r}")
    bonus = acc == lengths
    p_row = p.row(acc)                                                              # [B, V]
    at = acc.clamp(max=max(K - 1, 0))
    t_row = p_row if target is None else pi.row(at) if K else p_row                 # the law to recover
    x_at = draft[rows, at] if K else torch.zeros_like(acc)
    sampled = ~rs.greedy
    law = t_row if scale is None else scale[:, None] * t_row
    hit = None
    if q is None or not K:                                    # one-hot q: the law less the drafted token,
        hit = law[rows, x_at]                                 # in place (put back below: t_row may be law)
        law[rows, x_at] = (hit - 1.0).clamp(min=0.0)
        res = law
    else:
        q_row = q.row(at)                                     # a fresh [B, V]: one-hot rows written in place
        if det is not None:
            q_row.masked_fill_(det[:, None], 0.0)
            q_row[rows, x_at] = torch.where(det, 1.0, q_row[rows, x_at])
        res = torch.sub(law, q_row, out=q_row if q_row.dtype == law.dtype else None).clamp_(min=0.0)
    # left unnormalised: the draws normalise.  A row with no residual mass draws from t itself (then t == q), a
    # bonus row from p: one draw per row, each from its own law by the row's one uniform (no [B, V] select)
    keep = (res.sum(-1) > 0) & ~bonus
    tok = draws.categorical(res, keep & sampled)
    if hit is not None:
        law[rows, x_at] = hit
    tok = torch.where(keep, tok, draws.categorical(p_row, ~keep & sampled & (bonus | (target is None))))
    if target is not None:
        tok = torch.where(keep | bonus, tok, draws.categorical(t_row, ~keep & ~bonus & sampled))
    if rs.n_greedy:
        acc, tok = torch.where(rs.greedy, g_acc, acc), torch.where(rs.greedy, g_next, tok)
        bonus = acc == lengths
    return Verdicts(acc, tok, bonus)


def _accept_all(p: Laws, lengths, rs: RowSampling, draws: Draws, g_acc, g_next) -> Verdicts:
    """Method ``accept``: the whole draft kept, the next token drawn from p's row L (argmax for greedy rows)."""
    tok = draws.categorical(p.row(lengths), ~rs.greedy)
    if g_next is not None:
        tok = torch.where(rs.greedy, g_next, tok)
    return Verdicts(lengths, tok, torch.ones_like(lengths, dtype=torch.bool))


def _block_tau(p, px, qx, draft, lengths, valid, det, q, draws, live):
    """Block verification's stopping point tau [B] and the weight w_tau [B] of its correction row (Sun et al.,
    Alg. 3; :func:`cluster.core.block_verify.block_weights` is the per-row form): log w_i = min(log w_{i-1} +
    log p_i(x_i) - log q_i(x_i), 0), h_i = R_i / (R_i + 1 - w_i) with R_i = sum_x max(w_i p_i(x) - q_i(x), 0),
    h_L = w_L; eta_i ~ Bernoulli(h_i) for every i, tau the last success.  The recursion runs over the K
    positions (never the rows or the vocabulary)."""
    B, K = px.shape
    step = torch.where(px <= 0, float("-inf"),
                       torch.where(qx <= 0, float("inf"), torch.log(px) - torch.log(qx.clamp(min=1e-300))))
    logw = [torch.zeros(B, dtype=p.dtype, device=p.device)]                            # log w_0 = 0
    for i in range(K):
        prev = logw[-1]
        logw.append(torch.where(prev > float("-inf"), torch.clamp(prev + step[:, i], max=0.0), prev))
    w = torch.stack(logw, 1).exp()                                                       # [B, K+1]
    if K:
        wp = w[:, :K, None] * p[:, :K]                                                   # [B, K, V]
        if q is None:
            R = w[:, :K] * (1.0 - px)
        else:
            Rq = torch.clamp(wp - q, min=0.0).sum(-1)
            R = torch.where(det[:, None], w[:, :K] * (1.0 - px), Rq)                   # one-hot q: closed form
        denom = R + 1.0 - w[:, :K]
        hR = torch.where(denom > 0, R / torch.where(denom > 0, denom, 1.0), torch.ones_like(R))   # h from R_i
        idx = torch.arange(1, K + 1, device=p.device)[None]                             # i = 1..K
        wL = w.gather(1, lengths[:, None])                                               # [B, 1] w_{L_b}
        h_next = torch.cat([hR[:, 1:], torch.zeros_like(hR[:, :1])], 1)                 # R_i for h_i, i < L
        h = torch.where(idx < lengths[:, None], h_next, torch.where(idx == lengths[:, None], wL, 0.0))
        eta = draws.bernoulli(h.clamp(0.0, 1.0), live) & valid
        tau = (eta.long() * idx).max(-1).values
    else:
        tau = torch.zeros(B, dtype=torch.long, device=p.device)
    return tau, w.gather(1, tau[:, None])[:, 0]
