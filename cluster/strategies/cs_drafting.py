"""Cascade Speculative Drafting (Chen et al., *Cascade Speculative Drafting for Even Faster LLM Inference*):
vertical + horizontal cascades, exact under sampling.

Models: the target (index 0) and an ordered drafter list ``drafters`` = [d_1, ..., d_n] (largest first;
normally ending with the Max-Gram drafter ``mag``).  Only the last drafter ever *proposes*; every other
drafter only *reviews* (one ``score`` forward pass over the draft of the drafters below it), so no
neural drafter decodes autoregressively (vertical cascade, section 3.1).

**K-matrix** (section 3.4, appendix B): an n x n upper-triangular integer matrix.  Row r holds the
budgets used when model r reviews (r = 0: the target; r >= 1: drafter d_r); column j (0-based) is
drafter d_{j+1}.  Entries left of the diagonal (j < r) must be 0: a model drafts only for larger ones.
When model r builds its draft it walks its row left to right (horizontal cascade, section 3.2: larger
drafters produce the earlier positions, smaller ones the later ones):

* K[r][j] for a drafter that is not the last one counts d_{j+1}'s *review steps* (each step recursively
  builds d_{j+1}'s own draft from row j+1, scores it in one forward pass and appends the accepted tokens
  plus one, so at least one token per step), read by option ``kmatrix_unit``:
  ``tokens`` (the paper's Algorithm "CascadeSpeculativeDraftingStep": "while curGen.length -
  curPrefix.length is less than k_i"; the default): review steps until this column has added at least
  K[r][j] tokens;
  ``reviews`` (ours): exactly K[r][j] review steps -- the unit of :class:`cluster.core.cost_model.CascadeModel`,
  so ``specserve tune`` picks K-matrices for it (an entry of 1 is one review step either way);
* K[r][n-1] for the last drafter = the number of tokens it proposes in one call (either reading).

Example (the paper's decoder-only setting): drafters ``[drafter-small, mag]`` with K = [[2, 10], [0, 10]]:
the target reviews a draft made of drafter-small's review steps (each over 10 MaG tokens) until they have
added at least 2 tokens (``kmatrix_unit=reviews``: exactly 2 steps), followed by 10 more MaG tokens.  Drafts
never exceed the tokens the request may still emit.

**Lenience** l >= 1 applies only where a drafter reviews, never the target (section 3.1); option
``mag_lenience``: ``off`` (the paper's setting, appendix B: "we also avoid lenience between MaG and its
reviewer"; the default) l = 1 where a neural drafter reviews Max-Gram tokens, ``on`` (ours) l there too:

* greedy (temperature 0): a draft token x with proposal probability q(x) is accepted if it is the
  reviewer's argmax or q(x) <= l * p(x) (p: the reviewer's temperature-1 softmax); on rejection the
  reviewer's argmax is emitted;
* sampling: GenSpecSample (Narasimhan et al., *Faster Cascades via Speculative Decoding*, Algorithm 4) with
  pi = lossy_target(q, p, alpha = 1 - 1/l) (:func:`cluster.core.cascade_targets.lossy_target`); l = 1 is
  plain speculative sampling (pi = p).

**Exactness.** Each level hands up, with every token it emits, the distribution that token was drawn
from given everything before it: the reviewer's pi_i for an accepted or resampled token, the reviewer's
own p_{L+1} for a bonus token, a one-hot for MaG (whose proposals are deterministic).  The level above
verifies against exactly those, so every draft it sees satisfies x_i | past ~ q_i, which is all
speculative sampling needs; the target (lenience 1, any verifier of ``--verify``) therefore emits exactly
its own distribution whatever the lenience below it.  (The paper's code is greedy only.)
"""
from __future__ import annotations

import json

import torch

from cluster.core.cascade_targets import lossy_target
from cluster.core.sampling import UNSCALED, logits_to_probs
from cluster.core.verifiers import VERIFIERS
from cluster.core.verify import gen_spec_verify
from cluster.errors import ParamError, check_float
from cluster.strategies.base import (
    Option,
    Propose,
    Score,
    StepContext,
    Strategy,
    register,
)
from cluster.strategies.speculative import VERIFY

MAX_BUDGET = 64


def parse_drafters(value) -> tuple[str, ...]:
    """A drafter list from YAML (a list) or a flag (``"drafter-small,mag"``)."""
    if isinstance(value, str):
        names = [s.strip() for s in value.split(",") if s.strip()]
    elif isinstance(value, (list, tuple)) and all(isinstance(s, str) for s in value):
        names = [s.strip() for s in value]
    else:
        names = []
    if not names or len(set(names)) != len(names):
        raise ParamError("drafters", "a non-empty list of distinct drafter names, largest first "
                         "(e.g. drafter-small,mag)", value)
    return tuple(names)


def parse_kmatrix(value) -> tuple[tuple[int, ...], ...]:
    """A K-matrix from YAML (list of lists), JSON text, or a flag (rows ``;``-separated: ``"2,10;0,10"``)."""
    allowed = (f"a square upper-triangular matrix of integers in [0, {MAX_BUDGET}], rows separated by ';' "
               "(e.g. 2,10;0,10)")
    rows = value
    try:
        if isinstance(value, str):
            text = value.strip()
            rows = json.loads(text) if text.startswith("[") else \
                [[c for c in r.split(",")] for r in text.split(";") if r.strip()]
        out = []
        for row in rows:
            cells = []
            for c in row:
                if isinstance(c, bool) or isinstance(c, float) and not c.is_integer():
                    raise ValueError
                cells.append(int(str(c).strip()) if isinstance(c, str) else int(c))
            out.append(tuple(cells))
    except (TypeError, ValueError, json.JSONDecodeError):
        raise ParamError("kmatrix", allowed, value) from None
    if not out or any(len(r) != len(out) for r in out) or \
            any(not 0 <= c <= MAX_BUDGET for r in out for c in r) or \
            any(out[r][j] for r in range(len(out)) for j in range(r)):
        raise ParamError("kmatrix", allowed, value)
    return tuple(out)


def default_kmatrix(n: int, neural_bottom: bool = False) -> tuple[tuple[int, ...], ...]:
    """Each reviewer takes 2 review steps of the next drafter plus a tail from the bottom drafter
    (4 tokens; 1 when the bottom is a neural drafter, which would decode autoregressively)."""
    tail = 1 if neural_bottom else 4
    rows = []
    for r in range(n):
        row = [0] * n
        if r < n - 1:
            row[r] = 2
        row[n - 1] = tail if r < n - 1 else (2 if neural_bottom else 4)
        rows.append(tuple(row))
    return tuple(rows)


DRAFTERS = Option("drafters", str, None, "cascade drafters, largest first, ending with the statistical "
                  "drafter (default: the neural drafters by size, then mag)", parser=parse_drafters)
KMATRIX = Option("kmatrix", str, None, "K-matrix: row r = budgets when model r reviews (r = 0 the target), "
                 "column j = drafter j+1; rows ';'-separated, e.g. 2,10;0,10", parser=parse_kmatrix)
LENIENCE = Option("lenience", float, 1.0, "lenience l >= 1 where a drafter reviews (never the target)",
                  low=1.0, high=1000.0)
KMATRIX_UNIT = Option("kmatrix_unit", str, "tokens", "what K[r][j] of a reviewing drafter counts: tokens (review "
                      "until the column added K[r][j] tokens: the paper's loop) or reviews (review steps: the unit "
                      "specserve tune picks K for)", choices=("tokens", "reviews"))
MAG_LENIENCE = Option("mag_lenience", str, "off", "apply lenience where a drafter reviews Max-Gram tokens: off (the "
                      "paper's setting) or on", choices=("off", "on"))


@register
class CSDrafting(Strategy):
    name = "cs_drafting"
    help = "Cascade Speculative Drafting: drafters review smaller drafters' drafts (vertical) and share " \
           "draft positions by size (horizontal); lossless at the target"
    options = (DRAFTERS, KMATRIX, LENIENCE, VERIFY, KMATRIX_UNIT, MAG_LENIENCE)

    def __init__(self, opts, models, target):
        super().__init__(opts, models, target)
        names = opts["drafters"] or self._default_drafters()
        for n in names:
            self.check_drafter(n, "drafters")
        self.names = tuple(names)
        n = len(self.names)
        neural_bottom = not _is_mag(models[self.names[-1]])
        K = opts["kmatrix"] or default_kmatrix(n, neural_bottom)
        if len(K) != n:
            raise ParamError("kmatrix", f"a {n}x{n} upper-triangular matrix for drafters {','.join(self.names)} "
                             "(row r: budgets when model r reviews, r = 0 the target; column j: drafter j+1)",
                             ";".join(",".join(map(str, r)) for r in K))
        for r, row in enumerate(K):
            if not any(row):
                who = "the target" if r == 0 else self.names[r - 1]
                raise ParamError("kmatrix", f"row {r} ({who} reviewing) with at least one positive budget",
                                 ",".join(map(str, row)))
        self.K = K
        self.lenience = check_float("lenience", opts["lenience"], 1.0, 1000.0)
        self.verify = VERIFIERS[opts["verify"]]

    def _default_drafters(self) -> tuple[str, ...]:
        neural = sorted((n for n in self.drafter_names() if not _is_mag(self.models[n])),
                        key=lambda n: -getattr(self.models[n], "num_params", 0))
        mags = [n for n in self.drafter_names() if _is_mag(self.models[n])]
        return tuple(neural + mags[:1])

    def roles(self) -> list[str]:
        return [self.target_name, *self.names]

    def step(self, ctx: StepContext):
        run = _Cascade(ctx, self.names, self.K, self.lenience, self.opts["kmatrix_unit"] == "tokens",
                       self.opts["mag_lenience"] == "on")
        draft, qs, _ = yield from run.draft(0, [], ctx.budget - 1)         # [L], L x [V]
        run.sync(self.target_name, [])
        p = ctx.probs((yield Score(self.target_name, tuple(draft))))       # [L+1, V]
        ctx.stats.forward(self.target_name, target=True)
        q = torch.stack(qs) if qs else p[:0]                               # [L, V]
        verdict = self.verify(draft, q, p, ctx.rng)
        run.tails[self.target_name] = list(draft)
        if draft:
            ctx.stats.verification(len(draft), verdict.accepted)
        new = draft[:verdict.accepted] + [verdict.next_token]
        for name in self.roles():
            run.sync(name, new)
        return new


def _is_mag(handle) -> bool:
    """A deterministic drafter (the Max-Gram drafter), by its declared capability."""
    return bool(getattr(handle, "deterministic", False))


class _Cascade:
    """One CS Drafting step's recursion (Chen et al. 2024, CS Drafting, Algorithm "CascadeSpeculativeDraftingStep").

    ``tails[name]`` mirrors each handle's tokens beyond the committed sequence, so a model is brought
    to any working sequence with one rollback + extend (:meth:`sync`) before it is used.  Drafts travel
    as (tokens, their distributions, whether each came straight from the Max-Gram drafter).
    """

    def __init__(self, ctx: StepContext, names, K, lenience: float, token_budgets: bool = False,
                 mag_lenience: bool = True):
        self.ctx, self.names, self.K, self.lenience = ctx, names, K, lenience
        self.token_budgets, self.mag_lenience = token_budgets, mag_lenience
        self.base = len(ctx.tokens)
        self.tails: dict[str, list[int]] = {n: [] for n in (ctx.target_name, *names)}
        self.greedy = ctx.sampling.greedy

    def dist(self, logits: torch.Tensor) -> torch.Tensor:
        """Distributions handed up: processed for sampling; temperature-1 softmax for greedy lenience."""
        return logits_to_probs(logits, UNSCALED if self.greedy else self.ctx.sampling)

    def sync(self, name: str, work: list[int]) -> None:
        """Make handle ``name`` hold committed + ``work`` (common prefix kept, no forward pass)."""
        tail, h = self.tails[name], self.ctx.models[name]
        c = 0
        for a, b in zip(tail, work):
            if a != b:
                break
            c += 1
        if c < len(tail):
            h.rollback(self.ctx.rid, self.base + c)
        if c < len(work):
            h.extend(self.ctx.rid, list(work[c:]))
        self.tails[name] = list(work)

    def draft(self, r: int, work: list[int], limit: int):
        """The draft that model r reviews, continuing ``work``: tokens, their distributions ``[V]`` and
        Max-Gram flags; row r of K walked left to right (horizontal cascade), at most ``limit`` tokens."""
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
        h = self.ctx.models[name]
        self.sync(name, work)
        toks, logits = yield Propose(name, k)                              # [k], [k, V]
        self.tails[name] = work + list(toks)
        self.ctx.stats.forward(name, 1 if _is_mag(h) else len(toks))
        q = self.dist(logits)
        return list(toks), [q[i] for i in range(len(toks))], [_is_mag(h)] * len(toks)

    def review(self, m: int, work: list[int], limit: int):
        """Drafter m (1-based) reviews the draft of the drafters below it in one forward pass and emits
        the accepted tokens plus one, each with the distribution it was drawn from (none from MaG)."""
        name = self.names[m - 1]
        d, dq, dm = yield from self.draft(m, work, limit - 1)              # [L], L x [V], L x bool
        self.sync(name, work)
        logits = yield Score(name, tuple(d))                                # [L+1, V]
        self.tails[name] = work + d
        self.ctx.stats.forward(name, 1)
        L = len(d)
        lens = [1.0 if (mg and not self.mag_lenience) else self.lenience for mg in dm]   # l per position
        if self.greedy:
            pu = logits_to_probs(logits, UNSCALED)                          # [L+1, V]
            arg = logits.argmax(-1).tolist()
            for i, x in enumerate(d):
                if not (arg[i] == x or float(dq[i][x]) <= lens[i] * float(pu[i, x])):
                    return d[:i] + [arg[i]], [pu[j] for j in range(i + 1)], [False] * (i + 1)
            return d + [arg[L]], [pu[j] for j in range(L + 1)], [False] * (L + 1)
        p = self.ctx.probs(logits)                                          # [L+1, V]
        q = torch.stack(dq) if dq else p[:0]                               # [L, V]
        pi = p[:L]
        if self.lenience > 1.0 and L:
            lossy = lossy_target(q, p[:L], 1.0 - 1.0 / self.lenience)
            keep = torch.tensor([v > 1.0 for v in lens])
            pi = torch.where(keep[:, None], lossy, p[:L])
        v = gen_spec_verify(d, q, pi, p[L], self.ctx.rng)
        hand = [pi[i] for i in range(v.accepted)] + [p[L] if v.bonus else pi[v.accepted]]
        return d[:v.accepted] + [v.next_token], hand, [False] * (v.accepted + 1)
