"""Draft programs: everything a step does before the target verifies, run where the drafters are.

A strategy asks the draft side (:class:`cluster.core.draft.side.DraftSide`) for one block of drafts per
step with a :class:`cluster.core.calls.Draft` call carrying a :class:`DraftSpec`; the draft side runs the
matching program below for every request of the call, batching the programs' drafter calls per model, and
answers with one :class:`DraftBlock` per request.  However deep the drafting (a CS Drafting cascade makes
~8 drafter calls), the coordinator pays one call: one round trip when the draft side is an actor.

Programs are generators over the drafters (they yield :class:`Propose` / :class:`ProposeAdaptive` /
:class:`Score` on member names) and read a :class:`DraftCtx`: the request's committed tokens, its sampling
parameters, the draft side's random source for it, and ``sync`` (bring a drafter to a working sequence).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from cluster.core.calls import Propose, ProposeAdaptive, Review, Score
from cluster.core.cascade_targets import lossy_target
from cluster.core.constraint import constrain_rows, row_masks, valid_prefix
from cluster.core.sampling import UNSCALED, Rng, SamplingParams, logits_to_probs
from cluster.core.verify import gen_spec_verify

DRAFTS = "@drafts"      # the draft side's name among an engine's models (not a drafter: never a strategy option)


@dataclass(frozen=True)
class DraftSpec:
    """How to draft for one request (the same every step of a request, so a pre-drafted block can be
    matched to the next step's ask; the step's length limit travels beside it in the call).

    kind ``propose``: ``drafters[0]`` samples the block autoregressively (Leviathan et al.; Chen et al.);
    ``adaptive``: SpecDec++ drafting (Huang et al., Algorithm 1) with ``head`` and ``threshold``, stopping
    after ``eos``; ``cascade``: CS Drafting (Chen et al., Algorithm "CascadeSpeculativeDraftingStep") over
    ``drafters`` (largest first) with K-matrix ``kmatrix`` and ``lenience``."""

    kind: str
    drafters: tuple[str, ...]
    head: Any = field(default=None, compare=False)
    threshold: float = 0.0
    eos: int | None = None
    kmatrix: tuple = ()
    lenience: float = 1.0
    token_budgets: bool = True        # cascade: K counts tokens (the paper's loop) or review steps
    mag_lenience: bool = False        # cascade: lenience also where a drafter reviews Max-Gram tokens
    batched: bool = True              # cascade: reviews through the batched sampler on the drafters' devices
                                      # (False: row by row on the host in float64, its test oracle)


@dataclass
class DraftBlock:
    """One request's drafts for one step, in the fewest bytes that keep verification exact.

    tokens    [L]      the draft x_1..x_L
    q         [L, S]   how the distribution each x_i was drawn from travels, by ``form``:
                       ``onehot``: None (greedy or deterministic drafting: q_i is the one-hot of x_i);
                       ``sparse``: float64 probabilities on ``support`` [L, S] (top-k / top-p: S << V);
                       ``logits``: raw logits [L, V] as the model gave them (the receiver applies the request's sampling,
                       as the drafter did); ``dense``: probabilities [L, V] (a cascade's pi rows in float64,
                       or the laws a batched drafter drew from, in its dtype on its device)
    support   [L, S]   int64 token ids of the sparse rows (None otherwise)
    forwards           drafter name -> forward passes spent on this block (the request's statistics)
    """

    tokens: list[int]
    form: str = "onehot"
    q: torch.Tensor | None = None
    support: torch.Tensor | None = None
    forwards: dict[str, int] = field(default_factory=dict)
    alts: list[list[int]] | None = None    # [L][W] the drafter's next-best tokens per position (a speculator's bets)

    def probs(self, vocab_size: int, sampling: SamplingParams) -> torch.Tensor:
        """q as float64 rows ``[L, V]``: exactly the distributions the tokens were drawn from."""
        L = len(self.tokens)
        if self.form == "onehot":
            return torch.nn.functional.one_hot(torch.tensor(self.tokens, dtype=torch.long).reshape(L),
                                               vocab_size).to(torch.float64)
        if self.form == "sparse":
            return torch.zeros(L, vocab_size, dtype=torch.float64).scatter(1, self.support, self.q)
        if self.form == "logits":
            return logits_to_probs(self.q, sampling)
        return self.q.to(torch.float64)

    def __getstate__(self) -> dict:
        """Pickled (to another process) with each tensor's own elements: in process, ``q`` is often a view of a
        batch's ``[B, k, V]`` laws (the verifier reads the batch as one tensor, no copy), and a pickled view
        carries its whole storage."""
        state = dict(self.__dict__)
        for name in ("q", "support"):
            t = state[name]
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > t.numel() * t.element_size():
                state[name] = t.clone(memory_format=torch.contiguous_format)
        return state

    def nbytes(self) -> int:
        """Payload bytes on the wire (8 per token id)."""
        arrays = [t for t in (self.q, self.support) if t is not None]
        return 8 * len(self.tokens) + sum(t.numel() * t.element_size() for t in arrays)

    def tail(self, start: int, limit: int) -> "DraftBlock":
        """Tokens ``start .. start+limit`` (a pre-drafted block past its bonus guess, cut to the ask)."""
        end = start + limit
        cut = (lambda t: None if t is None else t[start:end])
        return DraftBlock(self.tokens[start:end], self.form, cut(self.q), cut(self.support), dict(self.forwards),
                          cut(self.alts))


def pack_block(tokens: list[int], q: torch.Tensor | None, sampling: SamplingParams, *,
               logits: torch.Tensor | None = None, onehot: bool = False, forwards=None) -> DraftBlock:
    """The smallest exact form of a block: tokens alone for greedy or deterministic drafting; where the law has
    full support (temperature alone), the raw logits (the verifier computes q in its batched call), or q as the
    drafter drew from it when only q is given; the truncated support where top-k / top-p leave few tokens; else
    the raw logits (when q came from them, computed from ``logits`` when not given) or q."""
    forwards = dict(forwards or {})
    if not tokens or onehot or sampling.greedy or (q is None and logits is None):
        return DraftBlock(list(tokens), "onehot", forwards=forwards)
    full = not sampling.top_k and sampling.top_p >= 1.0
    if logits is not None and full:                         # full support: the raw logits
        return DraftBlock(list(tokens), "logits", logits, None, forwards)
    if full:                                                # the drafter's own law (a batch's rows: views kept)
        return DraftBlock(list(tokens), "dense", q, None, forwards)
    if q is None:
        q = logits_to_probs(logits, sampling)
    V = q.shape[-1]
    width = int((q > 0).sum(-1).max())
    if width * 16 < V * 4:                                 # ids + float64 values beat V float32 logits
        vals, ids = torch.topk(q, width, dim=-1)           # every nonzero entry (and zeros to fill)
        return DraftBlock(list(tokens), "sparse", vals.contiguous(), ids.contiguous(), forwards)
    if logits is not None:
        return DraftBlock(list(tokens), "logits", logits, None, forwards)   # as computed (float32 models)
    return DraftBlock(list(tokens), "dense", q, None, forwards)


@dataclass
class DraftCtx:
    """What a draft program may touch for one request (built by the draft side)."""

    rid: str
    members: dict                    # drafter name -> handle (capabilities: ``deterministic``)
    sampling: SamplingParams
    new_rng: Callable[[], Rng]       # the block's random source, built on first use (only a cascade's reviews draw)
    sync: Callable[[str, list[int]], None]    # (drafter, work): it now holds committed + work
    held: Callable[[str, list[int]], None]    # (drafter, work): it holds committed + work after a call
    forwards: dict[str, int] = field(default_factory=dict)
    committed: list[int] = field(default_factory=list)   # the request's committed tokens (prompt included)
    alts: int = 0                    # record this many next-best tokens per position on the block (DraftBlock.alts)
    # the tokens drafted so far while they are a prefix of the block to come (one token per call); None once a call
    # was answered whose draws are not (a cascade's proposals and reviews): read between rounds (DraftSide's race)
    partial: list[int] | None = field(default_factory=list)
    reviews: int = 0                 # a cascade's reviews so far in this block (the counter of each one's draws)
    _rng: Rng | None = field(default=None, init=False, repr=False)

    @property
    def rng(self) -> Rng:
        if self._rng is None:
            self._rng = self.new_rng()
        return self._rng

    def grammar_cut(self, work: list[int], toks: list[int]) -> list[int]:
        """A deterministic (Max-Gram) draft cut at its first token the request's grammar forbids: exact, as
        the draft is a function of the prefix (:mod:`cluster.core.constraint`)."""
        return toks[:valid_prefix(self.sampling.constraint, self.committed + work, toks)]

    def masked(self, work: list[int], draft: list[int], logits: torch.Tensor) -> torch.Tensor:
        """A drafter's scoring rows ``[L+1, V]`` over ``draft`` masked by the request's grammar."""
        return constrain_rows(self.sampling.constraint, self.committed + work, draft, logits)

    def count(self, name: str, n: int) -> None:
        self.forwards[name] = self.forwards.get(name, 0) + n

    def deterministic(self, name: str) -> bool:
        return self.members[name].deterministic

    def laws(self, name: str) -> bool:
        return self.members[name].laws


def run_program(spec: DraftSpec, dc: DraftCtx, work: list[int], limit: int, stoppable: bool = False):
    """The program for ``spec`` continuing committed + ``work``, at most ``limit`` tokens -> DraftBlock.
    ``stoppable``: a neural drafter's block is proposed one token per call, so that a caller driving it with
    ``stop`` (a pre-draft, :meth:`cluster.core.draft.side.DraftSide.predraft`) can give up between tokens; the
    tokens and rows are those of one call of ``limit`` (a drafter continues what it holds)."""
    if spec.kind == "cascade":
        toks, qs, _ = yield from CSDraftProgram(dc, spec).draft(0, list(work), limit)
        q = _stack_laws(qs, toks) if qs else None
        return _with_alts(pack_block(toks, q, dc.sampling, forwards=dc.forwards), q, dc.alts)
    name = spec.drafters[0]
    # a greedy block travels as tokens, its bets need the rows; a deterministic drafter's q is its tokens
    want = (not dc.sampling.greedy or dc.alts > 0) and not dc.deterministic(name)
    law = spec.kind == "propose" and not dc.sampling.greedy and dc.laws(name)   # q as drawn: no softmax to verify
    if spec.kind == "propose" and stoppable and not dc.deterministic(name):
        toks, rows = [], []
        while len(toks) < limit:
            dc.sync(name, work + toks)
            got, lg = yield Propose(name, 1, want, law)                   # [1], [1, V] or None
            got = [int(t) for t in got]
            dc.held(name, work + toks + got)
            toks, rows = toks + got, rows + [lg]
            dc.partial = list(toks)
            if not got:
                break
        logits = torch.cat(rows) if want and rows else None
    else:
        dc.sync(name, work)
        call = Propose(name, limit, want, law) if spec.kind == "propose" else \
            ProposeAdaptive(name, limit, spec.head, spec.threshold, spec.eos)
        toks, logits = yield call                                         # [L], [L, V]
    toks = list(toks)
    dc.held(name, work + toks)       # (already recorded when proposed one by one)
    dc.count(name, len(toks))
    onehot = dc.deterministic(name)
    if onehot:
        toks = dc.grammar_cut(work, toks)                                 # neural drafters sampled masked
        logits = None if logits is None else logits[:len(toks)]
    block = pack_block(toks, logits if law else None, dc.sampling, logits=None if law else logits, onehot=onehot,
                       forwards=dc.forwards)
    return block if onehot else _with_alts(block, logits, dc.alts)


def _stack_laws(qs: list, toks: list[int]) -> torch.Tensor | None:
    """A cascade's laws per token ``[L, V]``: the rows handed up, a one-hot where None (Max-Gram's, from
    batched reviews: written only when some row is not one, on the rows' device); None when every row is."""
    at = [i for i, r in enumerate(qs) if r is not None]
    if not at:
        return None
    rows = torch.stack([qs[i] for i in at])
    if len(at) == len(qs):
        return rows
    out = rows.new_zeros(len(qs), rows.shape[-1]).index_copy_(0, torch.tensor(at, device=rows.device), rows)
    one = [i for i, r in enumerate(qs) if r is None]
    out[one, [toks[i] for i in one]] = 1.0
    return out


def _with_alts(block: DraftBlock, rows: torch.Tensor | None, width: int) -> DraftBlock:
    """``block`` with the ``width`` best tokens per position other than its own, by ``rows`` [>= L, V]."""
    if width and rows is not None and block.tokens:
        order = rows[:len(block.tokens)].topk(min(width + 1, rows.shape[-1]), dim=-1).indices.tolist()
        block.alts = [[t for t in o if t != x][:width] for o, x in zip(order, block.tokens)]
    return block


class CSDraftProgram:
    """One CS Drafting draft (Chen et al. 2024, *Cascade Speculative Drafting*, Algorithm
    "CascadeSpeculativeDraftingStep"), below the target: row r of the K-matrix walked left to right
    (horizontal cascade), drafters reviewing the drafts of the ones below them (vertical cascade), with
    lenience where a drafter reviews.  See :mod:`cluster.strategies.cs_drafting` for the K-matrix and the
    exactness argument; drafts travel as (tokens, the distributions they were drawn from, Max-Gram flags).
    """

    def __init__(self, dc: DraftCtx, spec: DraftSpec):
        self.dc, self.names, self.K, self.lenience = dc, spec.drafters, spec.kmatrix, spec.lenience
        self.token_budgets, self.mag_lenience = spec.token_budgets, spec.mag_lenience
        self.greedy, self.batched = dc.sampling.greedy, spec.batched

    def dist(self, logits: torch.Tensor) -> torch.Tensor:
        """Distributions handed up: processed for sampling; temperature-1 softmax for greedy lenience."""
        return logits_to_probs(logits, UNSCALED if self.greedy else self.dc.sampling)

    def draft(self, r: int, work: list[int], limit: int):
        """The draft that model r (0: the target) reviews, continuing ``work``: tokens, their distributions
        ``[V]`` and Max-Gram flags; at most ``limit`` tokens."""
        toks: list[int] = []
        qs: list[torch.Tensor] = []
        mag: list[bool] = []
        n = len(self.names)
        for j in range(r, n):
            budget = self.K[r][j]
            if budget <= 0 or len(toks) >= limit:
                continue
            if j == n - 1:                                            # the bottom drafter proposes
                t, q, m = yield from self.propose(self.names[j], work + toks, min(budget, limit - len(toks)))
                toks, qs, mag = toks + t, qs + q, mag + m
                continue
            steps = made = 0                                          # vertical cascade: d_{j+1} reviews
            while len(toks) < limit and (made < budget if self.token_budgets else steps < budget):
                t, q, m = yield from self.review(j + 1, work + toks, limit - len(toks))
                toks, qs, mag = toks + t, qs + q, mag + m
                steps, made = steps + 1, made + len(t)
        return toks, qs, mag

    def propose(self, name: str, work: list[int], k: int):
        """The bottom drafter's tokens with their laws: a Max-Gram's as None (one-hot) when batched, its one-hot
        rows otherwise; a neural drafter's rows of :meth:`dist`."""
        dc = self.dc
        dc.sync(name, work)
        is_mag = dc.deterministic(name)
        toks, logits = yield Propose(name, k, rows=not (is_mag and self.batched))    # [k], [k, V] or None
        toks, dc.partial = list(toks), None
        dc.held(name, work + toks)
        dc.count(name, 1 if is_mag else len(toks))
        if is_mag:
            toks = dc.grammar_cut(work, toks)
        if is_mag and self.batched:
            return toks, [None] * len(toks), [True] * len(toks)
        q = self.dist(logits)
        return toks, [q[i] for i in range(len(toks))], [is_mag] * len(toks)

    def review(self, m: int, work: list[int], limit: int):
        """Drafter m (1-based) reviews the draft of the drafters below it in one forward pass and emits
        the accepted tokens plus one, each with the distribution it was drawn from (none from MaG)."""
        dc, name = self.dc, self.names[m - 1]
        d, dq, dm = yield from self.draft(m, work, limit - 1)              # [L], L x [V], L x bool
        dc.sync(name, work)
        lens = [1.0 if (mg and not self.mag_lenience) else self.lenience for mg in dm]   # l per position
        if self.batched:                              # the round's reviews by ``name``: one batched call
            c = dc.sampling.constraint
            allowed = row_masks(c, dc.committed + work, d) if c is not None else None
            v = yield Review(name, tuple(d), tuple(dq), tuple(lens), dc.sampling, None if self.greedy else dc.rng,
                             dc.reviews, allowed)
            dc.reviews += 1
            dc.partial = None
            dc.held(name, work + d)
            dc.count(name, 1)
            return d[:v.accepted] + [v.next_token], list(v.laws), [False] * (v.accepted + 1)
        logits = dc.masked(work, d, (yield Score(name, tuple(d))))          # [L+1, V]
        dc.partial = None
        dc.held(name, work + d)
        dc.count(name, 1)
        L = len(d)
        if self.greedy:
            pu = logits_to_probs(logits, UNSCALED)                          # [L+1, V]
            arg = logits.argmax(-1).tolist()
            for i, x in enumerate(d):
                if not (arg[i] == x or float(dq[i][x]) <= lens[i] * float(pu[i, x])):
                    return d[:i] + [arg[i]], [pu[j] for j in range(i + 1)], [False] * (i + 1)
            return d + [arg[L]], [pu[j] for j in range(L + 1)], [False] * (L + 1)
        p = logits_to_probs(logits, dc.sampling)                            # [L+1, V]
        q = torch.stack(dq) if dq else p[:0]                               # [L, V]
        pi = p[:L]
        if self.lenience > 1.0 and L:
            lossy = lossy_target(q, p[:L], 1.0 - 1.0 / self.lenience)
            keep = torch.tensor([v > 1.0 for v in lens])
            pi = torch.where(keep[:, None], lossy, p[:L])
        v = gen_spec_verify(d, q, pi, p[L], dc.rng)
        hand = [pi[i] for i in range(v.accepted)] + [p[L] if v.bonus else pi[v.accepted]]
        return d[:v.accepted] + [v.next_token], hand, [False] * (v.accepted + 1)
