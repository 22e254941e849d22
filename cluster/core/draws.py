"""The random draws of the batched sampler (:mod:`cluster.core.rejection`): Bernoulli and categorical draws
over tensors, from a counter-based source (each uniform a function of (seed, step start, offset, purpose), computed
on the device: a request is reproducible from any step, whatever its batch) or from per-row random sources (the
exact-enumeration tests' branching ones)."""
from __future__ import annotations

import torch

ACCEPT, FINAL, DRAFT = 1, 2, 3       # the purposes of a draw (part of its counter)

_MASK64 = (1 << 64) - 1


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _MIX1, _MIX2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def counter_hash(seed: torch.Tensor, start: torch.Tensor, offset: torch.Tensor, purpose: int) -> torch.Tensor:
    """A 64-bit hash of (seed, start, offset, purpose), elementwise over broadcast int64 tensors (SplitMix64's
    finaliser over a Weyl combination of the four).  Written here because torch's generators are stateful: no
    torch API draws a value keyed by a counter per element, which per-request reproducibility inside a batch
    needs (vLLM loops over seeded rows with a generator each instead)."""
    x = seed * _GOLDEN + start * _MIX1 + (offset * 8 + purpose) * _MIX2
    x = x + _GOLDEN
    x = (x ^ _srl(x, 30)) * _MIX1
    x = (x ^ _srl(x, 27)) * _MIX2
    return x ^ _srl(x, 31)


def counter_uniform(seed, start, offset, purpose: int, dtype=torch.float64) -> torch.Tensor:
    """Uniforms in [0, 1) from :func:`counter_hash`: the top 53 bits (24 in float32), exactly representable."""
    h = counter_hash(seed, start, offset, purpose)
    bits = 24 if dtype == torch.float32 else 53
    return _srl(h, 64 - bits).to(dtype) * (2.0 ** -bits)


BLOCK = 1024                 # entries per block of a two-level draw


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index drawn from each row of ``probs [B, V]`` (unnormalised is fine) by the uniform ``u [B]``: the first
    index whose cumulative mass exceeds u x the row's total, never past the row's last positive entry.

    Over a wide row in two levels, the same inverse CDF: the row's blocks of :data:`BLOCK` entries summed (a
    reduction, several times cheaper than a cumulative sum over V), the block drawn from their cumulative sums,
    then the entry inside it from the remainder of u x total.  Only the summation order differs from one cumulative
    sum over the row, so a boundary moves by rounding at most; a zero entry or block is never drawn."""
    B, V = probs.shape
    n = V // BLOCK
    if n < 4:
        cdf = probs.cumsum(-1)
        return _search(probs, u.to(cdf.dtype)[:, None] * cdf[:, -1:], cdf)[:, 0]
    sums = probs[:, :n * BLOCK].unflatten(-1, (n, BLOCK)).sum(-1)              # [B, n]
    if V > n * BLOCK:
        sums = torch.cat([sums, probs[:, n * BLOCK:].sum(-1, keepdim=True)], -1)
    cdf = sums.cumsum(-1)                                                      # [B, n(+1)]
    want = u.to(cdf.dtype)[:, None] * cdf[:, -1:]
    blk = _search(sums, want, cdf)                                             # [B, 1]
    rest = want - torch.where(blk > 0, cdf.gather(1, (blk - 1).clamp(min=0)), 0.0)
    at = blk * BLOCK + torch.arange(BLOCK, device=probs.device)                # [B, BLOCK]
    inside = probs.gather(1, at.clamp(max=V - 1)).masked_fill(at >= V, 0.0)
    return (blk * BLOCK + _search(inside, rest))[:, 0]


def _search(probs: torch.Tensor, want: torch.Tensor, cdf: torch.Tensor | None = None) -> torch.Tensor:
    """Per row of ``probs [B, W]``, the first index whose cumulative mass exceeds ``want [B, 1]``, never past the
    row's last positive entry -> ``[B, 1]``."""
    cdf = probs.cumsum(-1) if cdf is None else cdf
    idx = torch.searchsorted(cdf, want.contiguous(), right=True)
    last = torch.searchsorted(cdf, cdf[:, -1:].contiguous(), right=False)     # the last positive entry
    return torch.minimum(idx, last)


class Draws:
    """The random source of one batched call: Bernoulli and categorical draws over tensors, where ``live``
    [B] or [B, K] says which draws the outcome can depend on (the others may return anything)."""

    def bernoulli(self, prob: torch.Tensor, live: torch.Tensor, purpose: int = ACCEPT,
                  until_false: bool = False) -> torch.Tensor:
        """``until_false``: along each row only the draws up to its first failure can matter (token
        verification), so a source may leave the rest undrawn (False)."""
        raise NotImplementedError

    def categorical(self, probs: torch.Tensor, live: torch.Tensor, purpose: int = FINAL,
                    offset: int = 0) -> torch.Tensor:
        raise NotImplementedError


class CounterDraws(Draws):
    """Draws computed from (seed, start, offset, purpose): ``seeds [B]`` per request, ``starts [B]`` the
    sequence length where the row's step began (so no uniform is ever used twice by a request: every step
    starts further on)."""

    def __init__(self, seeds: torch.Tensor, starts: torch.Tensor):
        self.seeds, self.starts = seeds, starts

    @classmethod
    def of(cls, seeds: list[int], starts: list[int], device) -> "CounterDraws":
        return cls(torch.tensor(seeds, dtype=torch.long, device=device),
                   torch.tensor(starts, dtype=torch.long, device=device))

    def bernoulli(self, prob, live, purpose=ACCEPT, until_false=False):
        K = prob.shape[1]
        off = torch.arange(K, device=prob.device)[None]
        u = counter_uniform(self.seeds[:, None], self.starts[:, None], off, purpose, prob.dtype)
        return u < prob

    def categorical(self, probs, live, purpose=FINAL, offset=0):
        off = torch.full_like(self.seeds, offset)
        return inverse_cdf(probs, counter_uniform(self.seeds, self.starts, off, purpose, probs.dtype))


class RngDraws(Draws):
    """Each live draw handed to its row's random source (``bernoulli(p)``, ``categorical(probs [V])``): the
    exact-enumeration tests' branching sources, or any per-request :class:`cluster.core.sampling.Rng`."""

    def __init__(self, rngs: list):
        self.rngs = rngs

    def bernoulli(self, prob, live, purpose=ACCEPT, until_false=False):
        out = torch.zeros(prob.shape, dtype=torch.bool)
        failed = set()
        for b, j in live.nonzero().tolist():
            if b not in failed:
                out[b, j] = self.rngs[b].bernoulli(float(prob[b, j]))
                if until_false and not out[b, j]:
                    failed.add(b)
        return out.to(prob.device)

    def categorical(self, probs, live, purpose=FINAL, offset=0):
        out = torch.zeros(probs.shape[0], dtype=torch.long)
        for b in live.nonzero()[:, 0].tolist():
            p = probs[b].to(torch.float64)
            out[b] = self.rngs[b].categorical(p / p.sum())
        return out.to(probs.device)
