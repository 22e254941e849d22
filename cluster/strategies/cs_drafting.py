"""Cascade Speculative Drafting (Chen et al., *Cascade Speculative Drafting for Even Faster LLM Inference*):
vertical + horizontal cascades, exact under sampling.

Models: the target (index 0) and an ordered drafter list ``drafters`` = [d_1, ..., d_n] (largest first;
normally ending with the Max-Gram drafter ``mag``, or with the suffix drafter ``suffix`` (:mod:`cluster.core.suffix`:
continuations of recent requests, at most K tokens per proposal, fewer where its counts say so), which only
proposes and so is a bottom drafter only).  Only the last drafter ever *proposes*; every other
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

import dataclasses
import json

from cluster.core.draft.programs import DRAFTS, DraftSpec
from cluster.core.verifiers import VERIFIERS
from cluster.errors import ParamError, check_float
from cluster.strategies.base import Option, StepContext, Strategy, register
from cluster.strategies.speculative import VERIFY, speculative_step

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


DRAFTERS = Option("drafters", str, None, "cascade drafters, largest first, ending with a statistical "
                  "drafter, mag or suffix (default: the neural drafters by size, then mag, else suffix)",
                  parser=parse_drafters)
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
    plain_steps = True             # ctx.plain: a plain step (step)
    constrained = True

    def __init__(self, opts, models, target):
        super().__init__(opts, models, target)
        names = opts["drafters"] or self._default_drafters()
        for n in names:
            self.check_drafter(n, "drafters")
        for n in names[:-1]:               # above the bottom a drafter reviews: it must score
            if getattr(models[n], "statistical", None) == "suffix":
                raise ParamError("drafters", "the suffix drafter last only (it proposes, it never reviews)",
                                 ",".join(names))
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
        self.spec = DraftSpec("cascade", self.names, kmatrix=K, lenience=self.lenience,
                              token_budgets=opts["kmatrix_unit"] == "tokens", mag_lenience=opts["mag_lenience"] == "on")

    def _default_drafters(self) -> tuple[str, ...]:
        neural = sorted((n for n in self.drafter_names() if not _is_mag(self.models[n])),
                        key=lambda n: -self.models[n].num_params)
        mags = sorted((n for n in self.drafter_names() if _is_mag(self.models[n])),     # Max-Gram first
                      key=lambda n: getattr(self.models[n], "statistical", None) == "suffix")
        return tuple(neural + mags[:1])

    def roles(self) -> list[str]:
        return [self.target_name, DRAFTS]

    def step(self, ctx: StepContext):
        """The whole cascade below the target runs on the draft side (:class:`cluster.core.draft.programs.CSDraftProgram`),
        in one call; the target verifies its block as any draft.  A step the engine's speculation policy makes
        plain (``ctx.plain``) is plain decoding."""
        spec = self.spec if ctx.batched else dataclasses.replace(self.spec, batched=False)   # the oracle
        return speculative_step(ctx, spec, 0 if ctx.plain else ctx.budget - 1, self.verify)


def _is_mag(handle) -> bool:
    """A deterministic drafter (Max-Gram or the suffix drafter: one-hot q), by its declared capability."""
    return handle.deterministic
