"""One verification round: every request's draft of an engine step verified against the target in one call.

A strategy's step yields :class:`cluster.core.calls.Verify`; the engine groups the round's calls into one
``verify_batch`` on the target, which runs its forward and hands the logits rows to :func:`verify_round` on its
own device: the batched sampler (:mod:`cluster.core.rejection`) over all rows, then one read of token ids.
Only requests that asked for logprobs have rows of the target's logits read for them.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from cluster.core.logprobs import TokenLogprob, token_logprobs
from cluster.core.rejection import CounterDraws, Laws, RngDraws, RowSampling, probs_batch, verify_batch
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


class Verified(NamedTuple):
    accepted: int
    next_token: int
    bonus: bool
    logprobs: list[TokenLogprob] | None


def stack_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """Per-request logits ``[L_b + 1, V]`` -> ``[B, K + 1, V]`` (zero padding past a row's own)."""
    return torch.nn.utils.rnn.pad_sequence(list(rows), batch_first=True)


def _dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _q_rows(items, rs: RowSampling, K: int, V: int, device, dtype):
    """(q, det [B]): the draft laws of rows that sample from a neural drafter, as :class:`Laws` over the
    drafters' raw logits when every such row sent them (read only where the verifier needs them), else as
    probabilities ``[B, K, V]``; None when no row needs one."""
    det = [it.block is None or it.block.form == "onehot" or it.sampling.greedy or not it.draft for it in items]
    need = [b for b, d in enumerate(det) if not d]
    det_t = torch.tensor(det, dtype=torch.bool, device=device) if any(det) else None
    if not need:
        return None, det_t
    if all(items[b].block.form == "logits" for b in need):
        empty = torch.empty(0, V, dtype=dtype, device=device)
        raw = stack_rows([empty if d else it.block.q[:len(it.draft)].to(device, dtype) for it, d in zip(items, det)])
        if raw.shape[1] < K:
            raw = torch.cat([raw, raw.new_zeros(len(items), K - raw.shape[1], V)], 1)
        return Laws(raw, rs), det_t
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


def verify_round(logits: torch.Tensor, items: list[VerifyItem]) -> list[Verified]:
    """``logits [B, K+1, V]``: row b's first ``len(draft_b) + 1`` positions are its verification rows, on the
    device the sampler runs on -> one :class:`Verified` per item."""
    methods = sorted({it.method for it in items})
    if len(methods) > 1:                              # requests with different verifiers: one call per verifier
        out: list = [None] * len(items)
        for m in methods:
            idx = [b for b, it in enumerate(items) if it.method == m]
            for b, v in zip(idx, verify_round(logits[idx], [items[b] for b in idx])):
                out[b] = v
        return out
    device, dtype = logits.device, _dtype(logits)
    B, K1, V = logits.shape
    K = max(len(it.draft) for it in items)
    logits = logits[:, :K + 1]
    rs = RowSampling.of([it.sampling for it in items], V, device, dtype)
    draft = torch.tensor([it.draft + [0] * (K - len(it.draft)) for it in items], dtype=torch.long,
                         device=device).reshape(B, K)
    lengths = torch.tensor([len(it.draft) for it in items], dtype=torch.long, device=device)
    q, det = (None, None) if rs.all_greedy else _q_rows(items, rs, K, V, device, dtype)
    if all(type(it.rng) is Rng or type(it.rng) is int for it in items):
        draws = CounterDraws.of([getattr(it.rng, "seed", it.rng) for it in items], [it.start for it in items], device)
    else:
        draws = RngDraws([it.rng for it in items])
    verdicts = verify_batch(logits, draft, lengths, rs, draws, q=q, det=det, method=methods[0]).tolist()
    out = []
    for b, (it, (acc, tok, bonus)) in enumerate(zip(items, verdicts)):
        lp = None
        if it.logprobs is not None:
            lp = token_logprobs(logits[b, :acc + 1].cpu(), it.draft[:acc] + [tok], it.logprobs)
        out.append(Verified(acc, tok, bonus, lp))
    return out
