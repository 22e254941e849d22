"""Cost theory of speculative decoding and CS Drafting (Chen et al., *Cascade Speculative Drafting for Even
Faster LLM Inference*, section 4) and the standardized walltime improvement (SWI, Chen et al. 2024,
CS Drafting, section 5.1).  The same model priced with measured forward costs (``specserve tune``, the
production projection) is in :mod:`cluster.core.forward_cost`.

Units: time is measured in target forward passes; ``c`` is a drafter call's cost over a target
forward pass; acceptance is i.i.d. with probability ``alpha`` (the EWIF assumption).  EWIF = expected
tokens per step / expected time per step (the speedup over autoregressive decoding, which makes one
token per target pass).
"""
from __future__ import annotations

import itertools
from typing import Mapping


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
    return {n: float(latencies.get(n, m.num_params)) for n, m in models.items()}


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


def format_kmatrix(K) -> str:
    return ";".join(",".join(str(v) for v in row) for row in K)
