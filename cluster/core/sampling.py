"""Turning logits into the distributions speculative decoding verifies against, and drawing from them.

Every random draw of the algorithm core goes through an :class:`Rng` with three primitives
(``bernoulli``, ``uniform``, ``categorical``).  The default one wraps a seeded ``torch.Generator``;
the exact-enumeration tests substitute one that explores every branch with its probability, so the
*implementation itself* is proven lossless, not a re-derivation of it.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch

from cluster.errors import check_float, check_int

MAX_TEMPERATURE = 100.0


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings. ``temperature == 0`` means greedy (argmax) decoding.

    ``top_k == 0`` and ``top_p == 1`` disable those filters.  ``constraint``: the request's grammar state
    (:class:`cluster.core.constraint.Constraint`, None: unconstrained); it travels with the sampling settings
    to every model of the request, so each drafter samples from its own masked logits.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    constraint: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "temperature",
                           check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE))
        object.__setattr__(self, "top_p", check_float("top_p", self.top_p, 0.0, 1.0, low_open=True))
        object.__setattr__(self, "top_k", check_int("top_k", self.top_k, 0, None))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


UNSCALED = SamplingParams(1.0, 1.0, 0)


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Map logits ``[..., V]`` to the sampling distribution ``[..., V]`` (float64 for exact verification).

    Greedy gives a one-hot of the argmax, so greedy speculative decoding is the special case of
    speculative sampling with deterministic distributions (accept iff the draft is the target's argmax).
    """
    logits = logits.to(torch.float64)
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(torch.float64)
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]        # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last axis; falls back to ``p`` where p == q (never sampled then)."""
    r = torch.clamp(p - q, min=0.0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / torch.where(mass > 0, mass, 1.0), p)


def derive_seed(seed: int, *salt: str) -> int:
    """A 63-bit seed derived from ``seed`` and a salt (model name, role), stable across processes."""
    h = hashlib.sha256(("%d|" % seed + "|".join(salt)).encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


class Rng:
    """Seeded source of the algorithm core's random draws (CPU ``torch.Generator``)."""

    def __init__(self, seed: int):
        self.seed = int(seed)          # also the counter of the batched sampler's draws (core/rejection.py)
        self.generator = torch.Generator().manual_seed(self.seed)

    def uniform(self) -> float:
        return float(torch.rand((), generator=self.generator, dtype=torch.float64))

    def bernoulli(self, prob: float) -> bool:
        """True with probability ``prob`` (exactly: ``prob >= 1`` is always True, ``<= 0`` never)."""
        return self.uniform() < float(prob)

    def categorical(self, probs: torch.Tensor) -> int:
        """Draw an index from a probability vector ``[V]``."""
        return int(torch.multinomial(probs.to(torch.float64), 1, generator=self.generator))


def sample(probs: torch.Tensor, rng: Rng) -> int:
    """Draw one token from ``probs [V]``; one-hot (greedy) distributions consume no randomness."""
    top = int(probs.argmax())
    if float(probs[top]) >= 1.0:
        return top
    return rng.categorical(probs)


def onehot_logits(tokens: list[int], vocab_size: int) -> torch.Tensor:
    """Logits ``[n, V]`` of a deterministic drafter: 0 at each proposed token, -inf elsewhere (q one-hot)."""
    logits = torch.full((len(tokens), vocab_size), float("-inf"))
    if tokens:
        logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 0.0
    return logits
