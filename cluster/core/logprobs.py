"""The target's log-probabilities of emitted (or prompt) tokens, read off logits a step already holds.

Every strategy's verification receives the target's raw logits at the positions it verifies
(``Score`` -> ``[L+1, V]``); the emitted tokens are a prefix of those positions (accepted drafts, then
the corrected or bonus token).  :func:`token_logprobs` turns the rows of the emitted tokens into
:class:`TokenLogprob` records: ``log_softmax`` of the raw logits, before the request's temperature,
top-k or top-p (vLLM's default "raw logprobs"; OpenAI's ``logprobs`` / ``top_logprobs``).  Only
requests that ask pay for it, and only for the rows they emit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of one token and its top-n alternatives (most likely first).

    Log-probabilities are ``log_softmax`` of the target's raw logits at that position, before the
    request's temperature / top-k / top-p ("raw logprobs", what vLLM reports by default).  For lossy
    strategies (speculative cascades, lossy speculative sampling) they are still the target's, not the
    distribution the token was drawn from."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()     # [n] (token id, logprob), n = the request's top count


def token_logprobs(logits: torch.Tensor, tokens: list[int], top_n: int) -> list[TokenLogprob]:
    """``logits`` ``[>= N, V]``: the target's raw logits, row i at the position of ``tokens[i]`` (N tokens;
    rows past N are ignored).  Returns N records, each with the token's logprob and the ``top_n`` most
    likely tokens there, sorted by logprob (descending).

    >>> lp = token_logprobs(torch.tensor([[0.0, 0.0], [0.0, 5.0]]), [1], top_n=1)
    >>> lp[0].token_id, round(lp[0].logprob, 4), lp[0].top[0][0]
    (1, -0.6931, 0)
    """
    n = len(tokens)
    if n == 0:
        return []
    if logits.shape[0] < n:
        raise ValueError(f"{n} tokens but only {logits.shape[0]} rows of target logits")
    lp = torch.log_softmax(torch.as_tensor(logits[:n]).to(torch.float32), dim=-1)          # [N, V]
    own = lp.gather(1, torch.tensor(tokens, dtype=torch.long).unsqueeze(1)).squeeze(1).tolist()
    if top_n:
        vals, ids = lp.topk(min(top_n, lp.shape[-1]), dim=-1)                             # [N, n] sorted
        tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    else:
        tops = [()] * n
    return [TokenLogprob(t, o, top) for t, o, top in zip(tokens, own, tops)]
