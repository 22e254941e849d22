"""Exact enumeration of randomized algorithms, and tabular models to run them on.

:class:`EnumRng` replaces the engine's random source: every ``bernoulli``/``categorical`` draw is a
branch point, and :func:`enumerate_outcomes` re-runs the *real* code once per branch path (DFS by
replay), weighting each leaf by the product of its branch probabilities.  The result is the exact
output distribution of the implementation, to floating-point rounding.
"""
from __future__ import annotations

import hashlib
from collections import defaultdict

import numpy as np
import torch

from cluster.core.interfaces import PerRequestHandle
from cluster.core.model_set import ModelSet
from cluster.core.sampling import Rng
from cluster.engine.engine import Engine


class EnumRng:
    """An Rng that follows a fixed branch path, then takes branch 0 and records the alternatives."""

    def __init__(self, path: tuple[int, ...] = ()):
        self.path, self.taken, self.weight, self.pending = path, [], 1.0, []

    def _choose(self, options: list[tuple[object, float]]):
        options = [(v, float(p)) for v, p in options if float(p) > 0.0]
        assert options, "a draw with no positive-probability outcome"
        i = len(self.taken)
        if i < len(self.path):
            j = self.path[i]
        else:
            j = 0
            prefix = tuple(self.taken)
            self.pending.extend(prefix + (alt,) for alt in range(1, len(options)))
        self.taken.append(j)
        value, prob = options[j]
        self.weight *= prob
        return value

    def bernoulli(self, prob: float) -> bool:
        prob = min(max(float(prob), 0.0), 1.0)
        return self._choose([(True, prob), (False, 1.0 - prob)])

    def categorical(self, probs: torch.Tensor) -> int:
        return self._choose([(i, p) for i, p in enumerate(probs.tolist())])

    def uniform(self) -> float:  # pragma: no cover - the core must not use continuous draws here
        raise AssertionError("exact enumeration needs bernoulli/categorical draws, not uniform()")


def enumerate_outcomes(run) -> dict:
    """``run(rng) -> hashable outcome``; returns {outcome: exact probability}."""
    dist: dict = defaultdict(float)
    stack = [()]
    leaves = 0
    while stack:
        rng = EnumRng(stack.pop())
        dist[run(rng)] += rng.weight
        stack.extend(rng.pending)
        leaves += 1
    total = sum(dist.values())
    assert abs(total - 1.0) < 1e-9, f"branch weights sum to {total} over {leaves} leaves"
    return dict(dist)


def random_dist(rng: np.random.Generator, vocab: int, zeros: bool) -> np.ndarray:
    p = rng.dirichlet(np.full(vocab, 0.7))
    if zeros:
        mask = rng.random(vocab) < 0.4
        mask[rng.integers(vocab)] = False      # keep at least one token
        p = np.where(mask, 0.0, p)
        p = p / p.sum()
    return p


class TabularModel(PerRequestHandle):
    """A model handle whose next-token distribution is a seeded random table of the whole prefix (per-request
    forms, batched by :class:`cluster.core.interfaces.PerRequestHandle` as every test double is).

    ``propose`` draws from the shared ``rng`` the test gives it (an :class:`EnumRng` when
    enumerating), so the drafter's randomness is enumerated too.  ``laws``: it answers ``law`` proposals with
    the probabilities it drew from, as the batched worker does.
    """

    proposes = True

    def __init__(self, name: str, vocab: int, seed: int, zeros: bool = False, rng=None, laws: bool = False):
        self.name, self.vocab_size, self.max_length, self.num_params = name, vocab, 64, 1
        self.seed, self.zeros, self.rng, self.laws = seed, zeros, rng, laws
        self.seqs: dict[str, list[int]] = {}
        self.sampling = {}
        self.forwards = 0

    def dist(self, prefix) -> np.ndarray:
        h = hashlib.sha256(f"{self.seed}|{tuple(prefix)}".encode()).digest()
        return random_dist(np.random.default_rng(int.from_bytes(h[:8], "little")), self.vocab_size, self.zeros)

    def logits(self, prefix) -> torch.Tensor:
        with np.errstate(divide="ignore"):
            return torch.tensor(np.log(self.dist(prefix)), dtype=torch.float64)

    def prefill(self, rid, ids, sampling, seed):
        self.seqs[rid], self.sampling[rid] = list(ids), sampling

    def propose(self, rid, k):
        from cluster.core.constraint import mask_logits
        from cluster.core.sampling import logits_to_probs, sample
        seq, out, logits = self.seqs[rid], [], []
        constraint = getattr(self.sampling[rid], "constraint", None)
        for _ in range(k):
            lg = self.logits(seq)
            if constraint is not None:          # a grammar's law, as the worker samples it (core/constraint.py)
                lg = mask_logits(lg, constraint.allowed(seq))
            tok = sample(logits_to_probs(lg, self.sampling[rid]), self.rng)
            seq.append(tok)
            out.append(tok)
            logits.append(lg)
        self.forwards += k
        return out, torch.stack(logits) if logits else torch.empty(0, self.vocab_size)

    def propose_batch(self, items):
        from cluster.core.sampling import logits_to_probs
        out = []
        for rid, k, *rest in items:
            toks, lg = self.propose(rid, k)
            law = self.laws and len(rest) > 1 and rest[1] and len(toks)
            out.append((toks, logits_to_probs(lg, self.sampling[rid]) if law else lg))
        return out

    def score(self, rid, draft):
        seq = self.seqs[rid]
        n = len(seq)
        seq.extend(draft)
        self.forwards += 1
        return torch.stack([self.logits(seq[:n + i]) for i in range(len(draft) + 1)])

    def rollback(self, rid, length):
        del self.seqs[rid][length:]

    def extend(self, rid, ids):
        self.seqs[rid].extend(ids)

    def release(self, rid):
        self.seqs.pop(rid, None)


class VocabTokenizer:
    """Letters for a tiny vocabulary; no EOS."""

    eos_token_id = None

    def __init__(self, vocab: int):
        self.vocab_size = vocab

    def encode(self, text):
        return [ord(c) - 65 for c in text]

    def decode(self, ids):
        return "".join(chr(65 + i) for i in ids)

    def stream(self):
        """One letter per token, so a token's text never waits for the next (the TextStream protocol)."""
        return _LetterStream()


class _LetterStream:
    def step(self, token_id):
        return chr(65 + token_id)

    def flush(self):
        return ""


def target_joint(model: TabularModel, prompt: list[int], n: int, sampling=None) -> dict:
    """Exact distribution of the first ``n`` tokens sampled autoregressively from ``model``."""
    from cluster.core.sampling import UNSCALED, logits_to_probs
    sampling = sampling or UNSCALED
    out = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for seq, w in out.items():
            p = logits_to_probs(model.logits(prompt + list(seq)), sampling).tolist()
            for tok, pt in enumerate(p):
                if pt > 0:
                    nxt[seq + (tok,)] = w * pt
        out = nxt
    return out


def local_engine(models: dict, tokenizer, *, target: str = "target", overlap: bool = False, rng_factory=Rng,
                 **kw) -> Engine:
    """An engine over test doubles, its model set assembled as the in-process root does (the draft side over
    the drafters, drawing from the same ``rng_factory`` as the engine)."""
    return Engine(ModelSet.assemble(models, target, overlap=overlap, rng_factory=rng_factory), tokenizer,
                  rng_factory=rng_factory, **kw)


def join_and_leave(engine, a: dict, b: dict, steps_before: int) -> tuple:
    """Request ``a`` (:class:`GenerationRequest` fields, sampled at temperature 1 from seed 0) runs alone for
    ``steps_before`` engine steps, then ``b`` (seed 1) joins, and both run to their ends; -> (a's tokens, b's)."""
    from cluster.engine.request import GenerationRequest
    from cluster.core.sampling import SamplingParams
    ra = engine.add(GenerationRequest(sampling=SamplingParams(1.0), seed=0, **a))
    for _ in range(steps_before):
        engine.step()
    rb = engine.add(GenerationRequest(sampling=SamplingParams(1.0), seed=1, **b))
    while engine.has_work:
        engine.step()
    return tuple(ra.generated), tuple(rb.generated)


def joint_of_two(target, a: tuple[list[int], int], b: tuple[list[int], int]) -> dict:
    """The product of the target's laws for two requests ``(prompt, tokens)``: their joint when independent."""
    want_a, want_b = target_joint(target, *a), target_joint(target, *b)
    return {(x, y): wa * wb for x, wa in want_a.items() for y, wb in want_b.items()}


def max_abs_diff(a: dict, b: dict) -> float:
    return max(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


def engine_vs_target(vocab: int, k: int, n: int, seed: int, sampling, verify: str = "token"):
    """(exact distribution of the engine's first ``n`` tokens under strategy speculative with a
    tabular drafter that has zeros, exact target joint) for one random target/drafter pair."""
    from cluster.engine.request import GenerationRequest
    target = TabularModel("target", vocab, seed=seed)
    drafter = TabularModel("drafter", vocab, seed=seed + 1000, zeros=True)
    holder = {}
    engine = local_engine({"target": target, "drafter": drafter}, VocabTokenizer(vocab),
                          rng_factory=lambda s: holder["rng"])

    def run(rng):
        holder["rng"] = drafter.rng = rng
        res = engine.generate(GenerationRequest(prompt_ids=[0], max_new_tokens=n, sampling=sampling, seed=0,
                                                strategy="speculative",
                                                options={"drafter": "drafter", "k": k, "verify": verify}))
        return tuple(res.token_ids)

    return enumerate_outcomes(run), target_joint(target, [0], n, sampling)


def run_step(step, models: dict, rid: str):
    """Drive one strategy step (a generator of model calls) directly against ``models``, unbatched."""
    from cluster.core.calls import run_group
    value = None
    while True:
        try:
            call = step.send(value)
        except StopIteration as stop:
            return stop.value
        value = run_group(models[call.model], type(call), [(rid, call)])[0]
        if isinstance(value, BaseException):           # the draft side hands back a request's error
            raise value


def pi_joint(target: TabularModel, drafter: TabularModel, prompt: list[int], n: int, sampling, fn) -> dict:
    """Exact law of ``n`` tokens drawn one by one from pi = fn(q, p, q_raw, p_raw) at every prefix of
    ``prompt`` (q: ``drafter``, p: ``target``; scaled by ``sampling``, raw = temperature-1 softmax)."""
    from cluster.core.sampling import UNSCALED, logits_to_probs
    out = {(): 1.0}
    for _ in range(n):
        nxt: dict = {}
        for seq, w in out.items():
            ql, pl = drafter.logits(list(prompt) + list(seq)), target.logits(list(prompt) + list(seq))
            pi = fn(logits_to_probs(ql, sampling), logits_to_probs(pl, sampling),
                    logits_to_probs(ql, UNSCALED), logits_to_probs(pl, UNSCALED))
            for tok, pt in enumerate(pi.tolist()):
                if pt > 0:
                    nxt[seq + (tok,)] = nxt.get(seq + (tok,), 0.0) + w * pt
        out = nxt
    return out


def marginal(joint: dict, i: int) -> dict:
    """The law of component ``i`` of a joint law over tuples."""
    out: dict = defaultdict(float)
    for outcome, w in joint.items():
        out[outcome[i]] += w
    return dict(out)


def product(laws: list[dict]) -> dict:
    """The joint law of independent components with the given laws (outcomes: tuples of their outcomes)."""
    out = {(): 1.0}
    for law in laws:
        out = {o + (x,): w * v for o, w in out.items() for x, v in law.items()}
    return out


def steps_law(name: str, opts, models: dict, target: str, prompt: list[int], sampling, n: int, budget: int,
              overlap: bool = False, side=None, batched: bool = True) -> dict:
    """The exact law of the first ``n`` tokens from repeated steps of strategy ``name`` (each step planned with
    ``budget``), enumerating every random draw (the draft side's too; ``overlap``: it pre-drafts every next
    block, see :mod:`cluster.core.draft.side`; ``side(drafters, rng)``: builds the draft side instead; ``batched``
    off: the per-row reference sampler, StepContext.batched)."""
    from cluster.core.draft.side import DraftSide
    from cluster.core.draft.programs import DRAFTS
    from cluster.core.stats import RequestStats
    from cluster.strategies import REGISTRY
    from cluster.strategies.base import StepContext

    def run(rng):
        drafters = {k: v for k, v in models.items() if k != target}
        for m in drafters.values():
            if isinstance(m, TabularModel):
                m.rng = rng
        make = side or (lambda ds, r: DraftSide(ds, overlap=overlap, rng_factory=lambda s: r, sampled=True))
        side_ = {DRAFTS: make(drafters, rng)} if drafters else {}
        every = {**models, **side_}
        strategy = REGISTRY[name](opts, every, target)
        for h in every.values():
            h.prefill_batch([("r", prompt, sampling, 0)])
        ctx = StepContext("r", every, target, sampling, rng, RequestStats(), list(prompt), budget, batched=batched)
        out = []
        while len(out) < n:
            new = run_step(strategy.step(ctx), every, "r")
            ctx.tokens.extend(new)
            out.extend(new)
        return tuple(out[:n])
    return enumerate_outcomes(run)


def mixed_batch(engine, sampling, want_greedy: dict, max_new: int = 5, k: int = 1) -> tuple:
    """One batch of a ``sampling`` request (prompt [0]) and a greedy one (prompt [2, 1]), speculative ``k`` with
    drafter ``d``: asserts the greedy one's first 3 tokens are in ``want_greedy``; returns the sampled one's."""
    from cluster.core.sampling import SamplingParams
    from cluster.engine.request import GenerationRequest
    reqs = [GenerationRequest(prompt_ids=p, max_new_tokens=max_new, sampling=sp, seed=1, strategy="speculative",
                              options={"drafter": "d", "k": k}, request_id=f"r{i}")
            for i, (p, sp) in enumerate((([0], sampling), ([2, 1], SamplingParams(0.0))))]
    out = [tuple(r.token_ids[:3]) for r in engine.generate_many(reqs)]
    assert out[1] in want_greedy
    return out[0]


def greedy_vs_plain(engine, plain, reqs: list[dict], options: dict) -> tuple[list, list]:
    """(token ids of ``reqs`` -- dicts of :class:`GenerationRequest` fields -- through ``engine`` with strategy
    speculative and ``options``, the same through ``plain`` autoregressive), batched in each."""
    from cluster.engine.request import GenerationRequest
    got = engine.generate_many([GenerationRequest(strategy="speculative", options=options, **q) for q in reqs])
    want = plain.generate_many([GenerationRequest(strategy="autoregressive", **q) for q in reqs])
    return [r.token_ids for r in got], [r.token_ids for r in want]
