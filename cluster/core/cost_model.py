"""Cost theory of speculative decoding and CS Drafting (Chen et al., *Cascade Speculative Drafting for Even
Faster LLM Inference*, section 4) and the standardized walltime improvement (SWI, Chen et al. 2024,
CS Drafting, section 5.1).

Units: time is measured in target forward passes; ``c`` is a drafter call's cost over a target
forward pass; acceptance is i.i.d. with probability ``alpha`` (the EWIF assumption).  EWIF = expected
tokens per step / expected time per step (the speedup over autoregressive decoding, which makes one
token per target pass).
"""
from __future__ import annotations

import itertools
from typing import Mapping, Sequence


# -- closed forms of the paper ----------------------------------------------------------------------
def phi(alpha: float, k: int, x: float) -> float:
    """PGF of the tokens one speculative step generates (Theorem 4.1, eq. 1 in the form of eq. 5):
    phi_(alpha,k)(x) = x + (x - 1) sum_{i=1}^k alpha^i x^i."""
    return x + (x - 1.0) * sum((alpha * x) ** i for i in range(1, k + 1))


def expected_tokens(alpha, k: int) -> float:
    """phi'(1) = (1 - alpha^{k+1}) / (1 - alpha): expected tokens per step with k drafted tokens; for a list
    of per-position alphas (see :class:`CascadeModel`) 1 + sum_{t<=k} prod_{i<=t} alpha_i."""
    if isinstance(alpha, (list, tuple)):
        total, prod = 1.0, 1.0
        for t in range(k):
            prod *= alpha[min(t, len(alpha) - 1)]
            total += prod
        return total
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def ewif_speculative(alpha: float, k: int, c: float) -> float:
    """Corollary 4.2: (1 - alpha^{k+1}) / ((1 - alpha)(c k + 1))."""
    return expected_tokens(alpha, k) / (c * k + 1.0)


def ewif_vertical(alpha: float, alpha_d: float, k: int, n: int, c1: float, c2: float) -> float:
    """Theorem 4.3: the target reviews n steps of d1, each reviewing k tokens of d2:
    (1 - alpha phi^n(alpha)) / ((1 - alpha)(1 + n c1 + n k c2)), phi = phi_(alpha(d1, d2), k);
    alpha = alpha(target, d1), alpha_d = alpha(d1, d2)."""
    f = phi(alpha_d, k, alpha) ** n
    tokens = float(n * (k + 1) + 1) if alpha >= 1.0 else (1.0 - alpha * f) / (1.0 - alpha)
    return tokens / (1.0 + n * c1 + n * k * c2)


def ewif_horizontal(alphas: Sequence[float], costs: Sequence[float]) -> float:
    """Theorem 4.5: draft token i made by model i (acceptance alpha_i, cost c_i):
    sum_{i=0}^k prod_{j<=i} alpha_j / (1 + sum_i c_i)."""
    num, prod = 1.0, 1.0
    for a in alphas:
        prod *= a
        num += prod
    return num / (1.0 + sum(costs))


# -- any K-matrix ---------------------------------------------------------------------------------
class CascadeModel:
    """EWIF of a CS Drafting K-matrix (semantics of :mod:`cluster.strategies.cs_drafting`) under i.i.d.
    acceptance, generalising Theorems 4.3 and 4.5 by the same generating-function argument.

    ``alpha[r][j]``: probability that reviewer r (0 = target, r = drafter r) accepts a token handed up
    by drafter j+1 (a token it proposed, or one it vouched for as a reviewer); for the bottom drafter also
    a list, alpha_t = P(its t-th proposed token accepted | the ones before it were), the last entry
    repeating (a Max-Gram proposal copies a matched run: its tokens are not independent); ``cost[j]``: cost of one
    call of drafter j+1 (a forward pass; for the last drafter one ``propose`` of a token if neural, one
    call if statistical: set ``bottom_per_token``), in target passes.

    ``vouched[r][j]`` (optional): the rate at which reviewer r accepts the *accepted* draft tokens a review
    step of drafter j+1 hands up (tokens two models agreed on), ``alpha[r][j]`` then only for its own last token:
    a review step adds P * (S_m(u) + E[u^A] a x) to S and multiplies P by E[u^A] a x (u = v x,
    E[u^A] = 1 + (u - 1) S_m(u) / u); with v = a this is the formula below.

    Costs by length (``specserve tune``): ``cost[j]`` may be a function of the tokens one forward feeds, and
    ``target_cost`` one for the target (default: 1 per verification, whatever the draft length).  A review
    step of a draft of L tokens then costs cost(L + 1), the verification target_cost(L + 1), a neural bottom
    drafter cost(1) per token, all at the expected draft lengths (:meth:`draft_len`).

    A draft is a sequence of *segments* (one bottom proposal, or one review step of a drafter) with
    independent random lengths N; with a = alpha[r][j] and G_N the PGF of N, a segment multiplies the
    running acceptance product P by G_N(a x) and adds P * (a x - a x G_N(a x)) / (1 - a x) to
    S(x) = sum_i x^i prod_{j<=i} a_j; the reviewer then emits A + 1 tokens with PGF x + (x - 1) S(x).
    """

    def __init__(self, K, alpha, cost, bottom_per_token: bool = False, target_cost=None, vouched=None):
        self.K, self.alpha, self.cost, self.per_token = K, alpha, cost, bottom_per_token
        self.target_cost, self.vouched = target_cost, vouched
        self.n = len(K)

    def _call(self, j: int, tokens: float) -> float:
        c = self.cost[j]
        return float(c(tokens)) if callable(c) else float(c)

    def _draft(self, r: int, x: float) -> float:
        """S(x) of reviewer r's draft.  A bottom segment of b tokens adds P * sum_{t<=b} y^t and
        multiplies P by y^b (y = a x); a review step of drafter m, whose own draft has S_m, emits N
        tokens with PGF G(y) = y + (y - 1) S_m(y), adding P * E[sum_{t<=N} y^t] = P * y (1 + S_m(y))."""
        S, P = 0.0, 1.0
        for j in range(r, self.n):
            b = self.K[r][j]
            if b <= 0:
                continue
            a = self.alpha[r][j]
            if j == self.n - 1:                      # a: one alpha, or one per position of the proposal
                for t in range(b):
                    P *= (a[min(t, len(a) - 1)] if isinstance(a, (list, tuple)) else a) * x
                    S += P
            elif self.vouched is None:
                y = a * x
                for _ in range(b):
                    s = self._draft(j + 1, y)
                    S += P * y * (1.0 + s)
                    P *= y + (y - 1.0) * s
            else:                                    # the A accepted tokens at v, the reviewer's own at a
                u = self.vouched[r][j] * x
                for _ in range(b):
                    s = self._draft(j + 1, u)
                    g = 1.0 + (u - 1.0) * s / u if u > 0 else 0.0        # E[u^A]
                    S += P * (s + g * a * x)
                    P *= g * a * x
        return S

    def pgf(self, m: int, x: float) -> float:
        """PGF of the tokens one review step of drafter m emits (accepted + 1)."""
        return x + (x - 1.0) * self._draft(m, x)

    def draft_len(self, r: int) -> float:
        """Expected length of reviewer r's draft: b per bottom segment, E[N] = 1 + S_m(1) per review step of
        drafter m (its accepted tokens plus one)."""
        total = 0.0
        for j in range(r, self.n):
            b = self.K[r][j]
            if b > 0:
                total += b if j == self.n - 1 else b * (1.0 + self._draft(j + 1, 1.0))
        return total

    def cost_of(self, r: int) -> float:
        """Expected cost of building reviewer r's draft, in target passes (per call: deterministic)."""
        total = 0.0
        for j in range(r, self.n):
            b = self.K[r][j]
            if b <= 0:
                continue
            if j == self.n - 1:
                total += self._call(j, 1) * b if self.per_token else self._call(j, b)
            else:
                total += b * (self._call(j, self.draft_len(j + 1) + 1.0) + self.cost_of(j + 1))
        return total

    def verify_cost(self) -> float:
        return 1.0 if self.target_cost is None else float(self.target_cost(self.draft_len(0) + 1.0))

    def tokens_per_step(self) -> float:
        return 1.0 + self._draft(0, 1.0)

    def ewif(self) -> float:
        return self.tokens_per_step() / (self.verify_cost() + self.cost_of(0))


def ewif_cascade(K, alpha, cost, bottom_per_token: bool = False) -> float:
    return CascadeModel(K, alpha, cost, bottom_per_token).ewif()


# -- standardized walltime improvement --------------------------------------------------------------
def model_costs(models: Mapping[str, object], latencies: Mapping[str, float] | None = None) -> dict[str, float]:
    """Cost of one call per model: the user's measured latencies where given, else parameter counts."""
    latencies = latencies or {}
    return {n: float(latencies.get(n, getattr(m, "num_params", 0))) for n, m in models.items()}


def swi(stats, costs: Mapping[str, float], target: str = "target") -> float:
    """Standardized walltime improvement (Chen et al. 2024, CS Drafting, section 5.1): with each forward pass of a
    model costing ``costs[model]``, the speedup over autoregressive decoding (one target pass per token):
    tokens * c_target / (target passes * c_target + sum_d drafter calls_d * c_d)."""
    ct = costs[target]
    spent = stats.target_forwards * ct + sum(n * costs.get(d, 0.0) for d, n in stats.drafter_forwards.items())
    return stats.generated_tokens * ct / spent if spent > 0 else 0.0


def kmatrix_grid(n: int):
    """Candidate K-matrices for n drafters (neural drafters review, the last is MaG)."""
    if n == 1:
        for k in range(1, 13):
            yield ((k,),)
        return
    diag = range(1, 5)
    tail = (0, 1, 2, 4, 6)
    bottom = (1, 2, 3, 4, 6, 8, 10)
    if n == 2:
        for a, b, c in itertools.product(diag, tail, bottom):
            yield ((a, b), (0, c))
        return
    if n == 3:
        for a, b, c, d, e, f in itertools.product((1, 2, 3), (0, 1, 2), (0, 2, 4), (1, 2, 3), (0, 2, 4),
                                                  (1, 2, 4, 6, 8)):
            yield ((a, b, c), (0, d, e), (0, 0, f))
        return
    raise ValueError("kmatrix_grid: at most 3 drafters")


def predict_cascade(K, names, target, alphas, costs, mags=("mag",), forward=None,
                    overhead: tuple[float, float] = (0.0, 0.0), vouched=None) -> float:
    """EWIF of CS Drafting with drafters ``names`` and K-matrix ``K`` from measured alphas/costs
    (a bottom MaG costs one call per proposal, a neural bottom one pass per token).

    ``costs``: seconds of one call per model.  ``forward`` (optional): ``{model: ForwardCost}`` for the
    neural models; then every forward is charged by its measured one-row cost at the tokens it feeds
    (a verification of L tokens: target(1, L + 1)), a model without a table (MaG) by ``costs``, and
    ``overhead`` = (seconds per step, seconds per draft token) adds the engine's own work (the step loop;
    distributions and verification per position) -- all relative to one plain decoding step,
    target(1, 1) + the step overhead.  ``vouched`` (optional): ``{(reviewer, drafter): v}``, see
    :class:`CascadeModel` (pairs it lacks: v = alpha)."""
    n = len(names)
    models = [target, *names]
    A = [[alphas[(models[r], names[j])] if j >= r else 0.0 for j in range(n)] for r in range(n)]
    Vm = None if vouched is None else [[vouched.get((models[r], names[j]), A[r][j]) if j >= r else 0.0
                                        for j in range(n)] for r in range(n)]
    if forward is None:
        c = [costs[d] / costs[target] for d in names]
        return ewif_cascade(K, A, c, bottom_per_token=names[-1] not in mags)
    o, eps = overhead
    unit = forward[target](1, 1) + o
    c = [(lambda t, f=forward[d]: (f(1, t) + eps * (t - 1)) / unit) if d in forward else costs[d] / unit
         for d in names]
    verify = lambda t: (forward[target](1, t) + o + eps * (t - 1)) / unit          # noqa: E731
    return CascadeModel(K, A, c, names[-1] not in mags, target_cost=verify, vouched=Vm).ewif()


def ranked_cascades(names, target, alphas, costs, mags=("mag",), forward=None, overhead=(0.0, 0.0), vouched=None):
    """[(K, predicted EWIF)] over :func:`kmatrix_grid`, best first."""
    return sorted(((K, predict_cascade(K, names, target, alphas, costs, mags, forward, overhead, vouched))
                   for K in kmatrix_grid(len(names))), key=lambda t: -t[1])


def best_k(drafter, target, alphas, costs, k_max: int = 12, forward=None, overhead=(0.0, 0.0)):
    """(k, predicted EWIF) for plain speculative decoding with ``drafter`` (Corollary 4.2); with ``forward``
    (``{model: ForwardCost}``) the step of k drafts costs k drafter(1, 1) + target(1, k + 1) (the load-aware
    planner's model, :func:`step_seconds`, at one row) plus ``overhead`` (per step, per draft token), over
    one plain decoding step."""
    a = alphas[(target, drafter)]
    if forward is None:
        c = costs[drafter] / costs[target]
        return max(((k, ewif_speculative(a, k, c)) for k in range(1, k_max + 1)), key=lambda t: t[1])
    T, D = forward[target], forward.get(drafter)
    o, eps = overhead
    return max(((k, expected_tokens(a, k) * (T(1, 1) + o) / (step_seconds(k, D, T, 1) + o + eps * k))
                for k in range(1, k_max + 1)), key=lambda t: t[1])


def format_kmatrix(K) -> str:
    return ";".join(",".join(str(v) for v in row) for row in K)


# -- load-aware draft length (measured batched forward costs) ---------------------------------------
class ForwardCost:
    """Measured wall seconds of one batched forward pass of one model, per (rows, tokens per row).

    Built from a full grid ``{(rows, tokens): seconds}`` -- what
    :func:`cluster.engine.measure.forward_cost_grid` returns.  ``cost(rows, tokens)`` interpolates
    piecewise linearly in rows and in tokens (bilinear on each grid cell), extrapolating linearly from the
    nearest cell beyond the grid; along an axis with a single measured value it is constant.  The result
    is never below zero.  Example: grid {(1, 1): 1.0, (1, 5): 2.0, (4, 1): 2.0, (4, 5): 6.0} gives
    cost(1, 3) = 1.5, cost(4, 3) = 4.0, cost(2, 3) = 1.5 + (4.0 - 1.5) / 3 = 2.333...
    """

    def __init__(self, table: Mapping[tuple[int, int], float]):
        if not table:
            raise ValueError("ForwardCost: empty table")
        self.rows = sorted({int(r) for r, _ in table})
        self.tokens = sorted({int(t) for _, t in table})
        missing = [(r, t) for r in self.rows for t in self.tokens if (r, t) not in table]
        if missing:
            raise ValueError(f"ForwardCost: the grid must be complete; missing {missing[:4]}")
        self.table = {(int(r), int(t)): float(s) for (r, t), s in table.items()}

    @classmethod
    def from_grid(cls, grid: Mapping[tuple[int, int], float]) -> "ForwardCost":
        return cls(grid)

    def __call__(self, rows: float, tokens: float) -> float:
        (r0, r1, wr), (t0, t1, wt) = _segment(self.rows, rows), _segment(self.tokens, tokens)
        g = self.table
        lo = g[(r0, t0)] + wt * (g[(r0, t1)] - g[(r0, t0)])
        hi = g[(r1, t0)] + wt * (g[(r1, t1)] - g[(r1, t0)])
        return max(0.0, lo + wr * (hi - lo))

    def monotone(self) -> "ForwardCost":
        """The table made non-decreasing in rows and in tokens (running maxima): timing noise must not
        make a larger forward look cheaper."""
        g = dict(self.table)
        for r in self.rows:
            for a, b in zip(self.tokens, self.tokens[1:]):
                g[(r, b)] = max(g[(r, b)], g[(r, a)])
        for t in self.tokens:
            for a, b in zip(self.rows, self.rows[1:]):
                g[(b, t)] = max(g[(b, t)], g[(a, t)])
        return ForwardCost(g)

    def __repr__(self) -> str:
        return f"ForwardCost(rows={self.rows}, tokens={self.tokens})"


def _segment(xs: list[int], x: float) -> tuple[int, int, float]:
    """(left, right, weight of right) of the grid segment holding ``x`` (the end segments beyond the grid,
    with weights outside [0, 1]: linear extrapolation)."""
    if len(xs) == 1:
        return xs[0], xs[0], 0.0
    i = 1
    while i < len(xs) - 1 and x > xs[i]:
        i += 1
    a, b = xs[i - 1], xs[i]
    return a, b, (x - a) / (b - a)


def step_seconds(k: int, drafter_cost: ForwardCost | None, target_cost: ForwardCost, rows: int,
                 target_rows: int | None = None, call_cost: ForwardCost | None = None) -> float:
    """Modelled seconds of one speculative step over ``rows`` rows: k sequential drafter forwards of one
    token (none for a deterministic drafter: ``drafter_cost=None``), one target forward of k + 1 tokens
    per row over ``target_rows`` (default ``rows``), and, when k > 0, one draft-side call ``call_cost(rows, 1)``
    (its round trip; None: drafting in-process).  Shared by the load-aware planner and ``specserve tune``."""
    per_draft = 0.0 if drafter_cost is None else drafter_cost(rows, 1)
    per_call = 0.0 if call_cost is None or k == 0 else call_cost(rows, 1)
    return per_call + k * per_draft + target_cost(rows if target_rows is None else target_rows, k + 1)


def plan_draft_length(alphas: Sequence[float], drafter_cost: ForwardCost | None, target_cost: ForwardCost,
                      k_max: int, deterministic_drafter: bool, *, target_rows: int | None = None,
                      scale: dict[int, float] | None = None, margin: float = 0.0) -> int:
    """One draft length k in 0..k_max for a batch of B = len(alphas) rows, maximizing expected generated
    tokens per second of one step (ties: the smaller k):

        k* = argmax_k  sum_i E(alpha_i, k) / (k * drafter_cost(B, 1) + target_cost(B_t, k + 1)),
        E(alpha, k) = (1 - alpha^(k+1)) / (1 - alpha)

    (Leviathan et al. 2023, Fast Inference from Transformers via Speculative Decoding, eq. for expected
    tokens (1 - a^(k+1))/(1 - a)): k sequential drafter forwards over the B rows (the first one also feeds
    the pending tokens -- ignored) and one target forward of k + 1 tokens per row.  A deterministic
    drafter (Max-Gram) costs ~0, so the denominator is target_cost(B_t, k + 1) alone.  k = 0 is plain
    decoding: target_cost(B_t, 1) for one token per row.  ``target_rows`` (B_t, default B) is the target
    forward's batch when it is shared with rows outside this group.  ``scale[k]`` (default 1) multiplies the
    modelled step time of draft length k: the measured ratio of real step time to this model (catch-up tokens,
    the engine's own work per round), learned online by the planner.  ``margin``: speculate only when the
    best k > 0 beats plain decoding by more than this fraction (the model is an estimate; near a tie plain
    decoding is the safe choice).

    Worked example: 16 rows at alpha = 0.8, deterministic drafter, target_cost(16, t) = 10 ms + 1 ms * t:
    k = 0 gives 16 * 1 / 11 ms = 1.45 tokens/ms, k = 4 gives 16 * 3.36 / 15 ms = 3.59, k = 6 gives
    16 * 3.95 / 17 ms = 3.72 (the best), k = 8 gives 16 * 4.33 / 19 ms = 3.65: k* = 6.  At a load where a
    token costs 10 ms per row (10 ms + 10 ms * t): k = 0 -> 16 / 20 = 0.80, k = 1 -> 16 * 1.8 / 30 = 0.96,
    k = 2 -> 16 * 2.44 / 40 = 0.98, k = 3 -> 16 * 2.95 / 50 = 0.94: k* = 2.
    """
    if not alphas or k_max <= 0:
        return 0
    b = len(alphas)
    bt = b if target_rows is None else max(int(target_rows), b)
    alphas = [min(1.0, max(0.0, float(a))) for a in alphas]
    drafter_cost = None if deterministic_drafter else drafter_cost
    rates = []
    for k in range(k_max + 1):
        seconds = max(step_seconds(k, drafter_cost, target_cost, b, bt) * (scale or {}).get(k, 1.0), 1e-12)
        rates.append(sum(expected_tokens(a, k) for a in alphas) / seconds)
    best_k = max(range(1, k_max + 1), key=lambda k: (rates[k], -k))    # ties: the smaller k
    return best_k if rates[best_k] > rates[0] * (1.0 + margin) * (1.0 + 1e-9) else 0
