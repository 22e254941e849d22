"""One verification round: every request's draft of an engine step verified against the target in one call.

A strategy's step yields :class:`cluster.core.calls.Verify`; the engine groups the round's calls into one
``verify_batch`` on the target, which runs its forward and hands the logits rows to :func:`verify_round` on its
own device: the batched sampler (:mod:`cluster.core.rejection`) over all rows, then one read of token ids.
Only requests that asked for logprobs have rows of the target's logits read for them.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch

from cluster.core.cascade_targets import cascade_target, deferral_rate, lossy_target
from cluster.core.constraint import mask_logits
from cluster.core.logprobs import TokenLogprob, token_logprobs
from cluster.core.draws import CounterDraws, RngDraws
from cluster.core.rejection import Laws, RowSampling, Verdicts, argmax, probs_batch, verify_batch
from cluster.core.sampling import Rng, SamplingParams


class VerifyItem(NamedTuple):
    """One request's part of a round."""

    rid: str
    draft: list[int]             # [L] the tokens to verify (empty: a plain decoding step)
    block: Any                   # how q travels (cluster.core.draft.programs.DraftBlock), None: deterministic
    sampling: SamplingParams
    rng: Any                     # the request's random source: an Rng or its seed (counter-based draws on the device)
    start: int                   # the request's sequence length where the step began (the draws' counter)
    method: str = "token"        # "token" (Leviathan et al.) or "block" (Sun et al.)
    logprobs: int | None = None  # top-n target logprobs of each emitted token (None: not asked)
    allowed: Any = None          # bool [L+1, V']: a grammar's mask at each row (None: no grammar)
    law: tuple | None = None     # GenSpecSample's pi = T(q, p) (None: p): ("cascade", rule, alpha, bonus) or
                                 # ("lossy", alpha, beta, bonus); bonus "pi": block.q has row L+1 for pi_{L+1}


class Verified(NamedTuple):
    accepted: int
    next_token: int
    bonus: bool
    logprobs: list[TokenLogprob] | None
    deferred: float = 0.0        # a cascade's expected deferrals over the positions its pi was used at


def stack_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """Per-request rows ``[L_b, V]`` -> ``[B, max L_b, V]``, without a copy where row b is row b of one batch's
    ``[B, n, V]`` tensor (a batched drafter hands its rows out so): positions past a row's own then hold that
    batch's later rows, finite values that the callers never read unmasked.  Otherwise a stack, zero-padded where
    the lengths differ (V-wide copies cost on the CPU what a softmax does: worth skipping)."""
    rows = list(rows)
    base = _common_base(rows)
    if base is not None:
        return base[:, :max(r.shape[0] for r in rows)]
    if len({r.shape[0] for r in rows}) == 1:
        return torch.stack(rows)
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)


def _common_base(rows: list[torch.Tensor]) -> torch.Tensor | None:
    """The ``[B, n, V]`` tensor (or ``[n, B, V]`` one, transposed) whose row b ``rows[b]`` is a leading slice
    of, else None."""
    base = rows[0]._base if rows else None
    if base is None or base.dim() != 3:
        return None
    for cand in (base, base.transpose(0, 1)):
        if cand.shape[0] == len(rows) and all(
                r._base is base and r.dim() == 2 and r.shape[0] <= cand.shape[1] and r.shape[1] == cand.shape[2]
                and r.stride() == cand.stride()[1:] and r.storage_offset() == cand.storage_offset() + b * cand.stride(0)
                for b, r in enumerate(rows)):
            return cand
    return None


def _dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _q_rows(items, rs: RowSampling, K: int, V: int, device, dtype):
    """(q, det [B]): the draft laws of rows that sample from a neural drafter, as :class:`Laws` over the
    drafters' raw logits (read only where the verifier needs them) or over the laws they drew from, when every
    such row sent the one form, else as probabilities ``[B, K, V]``; None when no row needs one."""
    det = [it.block is None or it.block.form == "onehot" or it.sampling.greedy or not it.draft for it in items]
    need = [b for b, d in enumerate(det) if not d]
    det_t = torch.tensor(det, dtype=torch.bool, device=device) if any(det) else None
    if not need:
        return None, det_t
    forms = {items[b].block.form for b in need}
    if forms == {"logits"} or forms == {"dense"}:     # one stack (none: a batched drafter's rows), q read lazily
        empty = torch.empty(0, V, dtype=dtype, device=device)
        rows = stack_rows([empty if d else it.block.q[:len(it.draft)].to(device, dtype) for it, d in zip(items, det)])
        if rows.shape[1] < K:
            rows = torch.cat([rows, rows.new_zeros(len(items), K - rows.shape[1], V)], 1)
        return (Laws(rows, rs) if forms == {"logits"} else Laws(None, rs, probs=rows)), det_t
    q = torch.zeros(len(items), K, V, dtype=dtype, device=device)
    for b in need:
        blk, L = items[b].block, len(items[b].draft)
        if blk.form == "logits":
            q[b, :L] = probs_batch(blk.q[:L].to(device, dtype)[None], RowSampling.of([items[b].sampling], V,
                                                                                    device, dtype))[0]
        elif blk.form == "sparse":
            q[b, :L].scatter_(1, blk.support[:L].to(device), blk.q[:L].to(device, dtype))
        else:
            q[b, :L] = blk.q[:L].to(device, dtype)
    return q, det_t


def _masked(logits: torch.Tensor, items: list[VerifyItem]) -> torch.Tensor:
    """The grammar rows' logits masked by their grammars (:func:`cluster.core.constraint.mask_logits`), in one
    batched call; the other rows as they are (a copy: the model's logits stay for logprobs)."""
    idx = [b for b, it in enumerate(items) if it.allowed is not None]
    keep = torch.ones(len(idx), logits.shape[1], items[idx[0]].allowed.shape[-1], dtype=torch.bool)
    for j, b in enumerate(idx):
        keep[j, :items[b].allowed.shape[0]] = items[b].allowed
    out = logits.clone()
    out[idx] = mask_logits(logits[idx], keep.to(logits.device))
    return out


def verify_round(logits: torch.Tensor, items: list[VerifyItem]) -> list[Verified]:
    """``logits [B, K+1, V]``: row b's first ``len(draft_b) + 1`` positions are its verification rows, on the
    device the sampler runs on -> one :class:`Verified` per item."""
    split = _per_group(verify_round, logits, items, lambda it: (it.method, it.law or ()))
    if split is not None:                             # requests with different verifiers: one call per verifier
        return split
    device, dtype = logits.device, _dtype(logits)
    B, K1, V = logits.shape
    K = max(len(it.draft) for it in items)
    raw = logits = logits[:, :K + 1]
    if any(it.allowed is not None for it in items):
        logits = _masked(logits, items)
    rs = RowSampling.of([it.sampling for it in items], V, device, dtype)
    draft, lengths = _drafts(items, K, device)
    draws = None if rs.all_greedy and items[0].law is None else \
        _draws(items, [it.start for it in items], device)            # (argmax comparisons draw nothing)
    deferred = None
    if items[0].law is not None:
        verdicts, deferred = _gen_spec(logits, items, rs, draft, lengths, draws, items[0].law)
    else:
        q, det = (None, None) if rs.all_greedy else _q_rows(items, rs, K, V, device, dtype)
        verdicts = verify_batch(logits, draft, lengths, rs, draws, q=q, det=det, method=items[0].method)
    verdicts = verdicts.tolist()
    deferred = [0.0] * B if deferred is None else deferred.tolist()
    out = []
    for b, (it, (acc, tok, bonus)) in enumerate(zip(items, verdicts)):
        lp = None
        if it.logprobs is not None:
            lp = token_logprobs(raw[b, :acc + 1].cpu(), it.draft[:acc] + [tok], it.logprobs)
        out.append(Verified(acc, tok, bonus, lp, deferred[b]))
    return out


def _drafts(items: list, K: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A round's drafts as tensors: tokens ``[B, K]`` (zero past each row's own) and lengths ``[B]``."""
    draft = torch.tensor([it.draft + [0] * (K - len(it.draft)) for it in items], dtype=torch.long,
                         device=device).reshape(len(items), K)
    return draft, torch.tensor([len(it.draft) for it in items], dtype=torch.long, device=device)


def _draws(items: list, counters: list[int], device):
    """The round's random source: counter-based draws keyed by each item's seed (an Rng's, or an int) and
    ``counters``, or the items' own sources where any is not an Rng (the enumeration tests' branching ones)."""
    if all(type(it.rng) is Rng or type(it.rng) is int for it in items):
        return CounterDraws.of([getattr(it.rng, "seed", it.rng) for it in items], counters, device)
    return RngDraws([it.rng for it in items])


def _per_group(fn, logits: torch.Tensor, items: list, key) -> list | None:
    """``fn(logits rows, items)`` once per group of items with one ``key``, the results in the items' order;
    None where every item has the same key (the caller goes on with one call)."""
    keys = [key(it) for it in items]
    if len(set(keys)) < 2:
        return None
    out: list = [None] * len(items)
    for k in dict.fromkeys(keys):
        idx = [b for b, kb in enumerate(keys) if kb == k]
        for b, v in zip(idx, fn(logits[idx], [items[b] for b in idx])):
            out[b] = v
    return out


def _laws(logits: torch.Tensor, rs: RowSampling) -> torch.Tensor:
    """Every row's sampling law, a greedy row's as the one-hot of its argmax (what a cascade mixes)."""
    probs = probs_batch(logits, rs)
    if not rs.n_greedy:
        return probs
    onehot = torch.zeros_like(probs).scatter(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(rs.greedy.view(-1, *[1] * (probs.dim() - 1)), onehot, probs)


def _gen_spec(logits, items, rs: RowSampling, draft, lengths, draws, law):
    """A cascade's or lossy sampling's round: pi = T(q, p) at each drafted position from the drafters' raw
    logits and the target's, on the device (:mod:`cluster.core.cascade_targets`; the rules read the unscaled
    laws, the mixture the scaled ones), then GenSpecSample through :func:`verify_batch`; with bonus ``pi`` the
    bonus is drawn from pi_{L+1} = T(q_{L+1}, p_{L+1}).  Greedy rows mix one-hot laws, so they draw as sampled
    rows (every draw is then 0 or 1).  -> (verdicts, expected deferrals per row [B] or None)."""
    kind, a, b, bonus = law
    B, K1, V = logits.shape
    K, n = K1 - 1, K1 - 1 + (bonus == "pi")
    empty = logits.new_empty(0, V)
    q_logits = stack_rows([it.block.q[:len(it.draft) + (bonus == "pi")].to(logits) if it.block is not None
                           else empty for it in items])
    q_logits = torch.cat([q_logits, q_logits.new_zeros(B, n - q_logits.shape[1], V)], 1) \
        if q_logits.shape[1] < n else q_logits[:, :n]                                    # [B, n, V]
    sampled = dataclasses.replace(rs, greedy=torch.zeros_like(rs.greedy), n_greedy=0)
    q, p = _laws(q_logits, rs), _laws(logits, rs)                                       # scaled [B, n | K+1, V]
    at = torch.arange(n, device=logits.device)[None]
    used = at < (lengths[:, None] + (bonus == "pi"))                                    # [B, n]
    if kind == "cascade":
        q_raw, p_raw = torch.softmax(q_logits, -1), torch.softmax(logits[:, :n], -1)
        pi = cascade_target(q, p[:, :n], a, b, q_raw, p_raw)
        rate = deferral_rate(q_raw, p_raw, q, a, b, p[:, :n]).to(logits.dtype)          # [B, n]
    else:
        pi, rate = lossy_target(q, p[:, :n], a, b), None
    if bonus == "pi":                      # the bonus row of p is pi_{L+1} (row L of pi)
        rows = torch.arange(B, device=logits.device)
        p = p.clone()
        p[rows, lengths] = pi[rows, lengths]
    verdicts = verify_batch(logits, draft, lengths, sampled, draws, q=q[:, :K], target=pi[:, :K], p=p)
    if rate is None:
        return verdicts, None
    counted = (at < lengths[:, None]) | ((at == lengths[:, None]) & used & verdicts.bonus[:, None])
    return verdicts, (rate * counted).sum(-1)


# -- CS Drafting's reviews ----------------------------------------------------------------------------------
class ReviewItem(NamedTuple):
    """One request's review of a CS Drafting round: a drafter verifies the draft of the drafters below it
    (Chen et al., *Cascade Speculative Drafting*, Algorithm "CascadeSpeculativeDraftingStep")."""

    rid: str
    draft: list[int]             # [L] the draft below
    q: tuple                     # [L] the law each x_i was drawn from: a [V] row, or None (one-hot: Max-Gram)
    lenience: tuple              # [L] l per position (1: exact; the reviewer's law made lossy where l > 1)
    sampling: SamplingParams     # the request's (greedy: the lenient argmax rule)
    rng: Any                     # the block's random source: an Rng (counter draws keyed by its seed), or a branching one
    index: int                   # the review's number within its block (the draws' counter)
    allowed: Any = None          # bool [L+1, V']: a grammar's mask at each row (None: no grammar)


class Reviewed(NamedTuple):
    accepted: int
    next_token: int
    bonus: bool
    laws: torch.Tensor           # [accepted + 1, V] the law each emitted token was drawn from (q for the level above)


def review_round(logits: torch.Tensor, items: list[ReviewItem]) -> list[Reviewed]:
    """Every request's review of a round in one batched call on the logits' device; ``logits [B, K+1, V]`` the
    reviewer's rows over each draft (row b's first ``len(draft_b) + 1``).

    Greedy rows: x_i is accepted if it is the reviewer's argmax or q_i(x_i) <= l_i p_i(x_i), p the reviewer's
    temperature-1 softmax; the first rejected position emits the argmax; laws handed up: p's rows.  Sampled rows:
    GenSpecSample (Narasimhan et al., *Faster Cascades via Speculative Decoding*, Alg. 4) towards pi_i =
    lossy_target(q_i, p_i, 1 - 1/l_i) where l_i > 1, p_i elsewhere, the bonus from p_{L+1}
    (:func:`cluster.core.rejection.verify_batch`); laws handed up: pi's rows, p_{L+1} for a bonus.  Max-Gram's
    one-hot q rows are written on the device, never as float64 host rows.  The per-row form is
    :meth:`cluster.core.draft.programs.CSDraftProgram.review` with ``batched`` off, this one's test oracle."""
    split = _per_group(review_round, logits, items, lambda it: it.sampling.greedy)
    if split is not None:                               # greedy and sampled rows: one call each
        return split
    device, dtype = logits.device, _dtype(logits)
    B, _, V = logits.shape
    K = max(len(it.draft) for it in items)
    logits = logits[:, :K + 1].to(dtype)
    if any(it.allowed is not None for it in items):
        logits = _masked(logits, items)
    draft, lengths = _drafts(items, K, device)
    lens = torch.tensor([list(it.lenience) + [1.0] * (K - len(it.draft)) for it in items], dtype=dtype,
                        device=device).reshape(B, K)
    rows = torch.arange(B, device=device)
    if items[0].sampling.greedy:                      # q read at the drafted tokens only: no [B, K, V] built
        laws = torch.softmax(logits, -1)                                                # [B, K+1, V]
        arg = argmax(logits)
        qx, px = _review_qx(items, draft, dtype), laws[:, :K].gather(-1, draft[..., None])[..., 0]
        ok = (arg[:, :K] == draft) | (qx <= lens * px)
        valid = torch.arange(K, device=device)[None] < lengths[:, None]
        acc = (ok & valid).long().cumprod(-1).sum(-1)
        verdicts = Verdicts(acc, arg[rows, acc], acc == lengths)
    else:
        q = _review_q(items, draft, K, V, device, dtype)                                # [B, K, V]
        rs = RowSampling.of([it.sampling for it in items], V, device, dtype)
        p = probs_batch(logits, rs)                                                     # [B, K+1, V]
        laws = p
        for l in sorted({x for it in items for x in it.lenience if x > 1.0}):          # lossy where l > 1
            at = (lens == l)[..., None]
            lossy = lossy_target(q, p[:, :K], 1.0 - 1.0 / l)
            laws = laws.clone() if laws is p else laws
            laws[:, :K] = torch.where(at, lossy, laws[:, :K])
        verdicts = verify_batch(logits, draft, lengths, rs, _draws(items, [it.index for it in items], device), q=q,
                                target=None if laws is p else laws[:, :K], p=p)
    out = []
    for b, (acc, tok, bonus) in enumerate(verdicts.tolist()):
        out.append(Reviewed(acc, tok, bonus, laws[b, :acc + 1]))       # row L of laws is p_{L+1}: the bonus law
    return out


def _review_qx(items: list[ReviewItem], draft: torch.Tensor, dtype) -> torch.Tensor:
    """q_i(x_i) ``[B, K]``: 1 where the row is a one-hot (None), the handed-up row at its token elsewhere (one
    gather over the stacked rows); 0 past each draft."""
    qx = torch.zeros(draft.shape, dtype=dtype, device=draft.device)
    one = [(b, i) for b, it in enumerate(items) for i, row in enumerate(it.q) if row is None]
    if one:
        qx[tuple(torch.tensor(one, device=draft.device).unbind(1))] = 1.0
    at = [(b, i) for b, it in enumerate(items) for i, row in enumerate(it.q) if row is not None]
    if at:
        b, i = torch.tensor(at, device=draft.device).unbind(1)
        rows = torch.stack([items[bb].q[ii] for bb, ii in at]).to(draft.device, dtype)          # [N, V]
        qx[b, i] = rows.gather(1, draft[b, i][:, None])[:, 0]
    return qx


def _review_q(items: list[ReviewItem], draft: torch.Tensor, K: int, V: int, device, dtype) -> torch.Tensor:
    """The reviews' q ``[B, K, V]``: each position's row as handed up, a one-hot where None (Max-Gram's)."""
    q = torch.zeros(len(items), K, V, dtype=dtype, device=device)
    at = [(b, i) for b, it in enumerate(items) for i, row in enumerate(it.q) if row is not None]
    if at:
        q.view(-1, V).index_copy_(0, torch.tensor([b * K + i for b, i in at], device=device),
                                  torch.stack([items[b].q[i] for b, i in at]).to(device, dtype))
    one = [(b, i) for b, it in enumerate(items) for i, row in enumerate(it.q) if row is None]
    if one:
        b, i = torch.tensor(one, device=device).unbind(1)
        q[b, i, draft[b, i]] = 1.0
    return q
