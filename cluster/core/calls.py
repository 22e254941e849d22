"""The model calls a step yields, and running a group of them as one batched call on a handle.

A strategy's step (and a draft program, :mod:`cluster.core.draft.programs`) is a generator that yields these
calls and receives their results.  :func:`drive` is the one loop that runs many of them (the engine's step,
the draft side's programs): it groups their calls per (model, kind) (:func:`group_calls`), runs each group as
ONE batched call (:func:`run_group`) and sends each result back into its generator (:func:`advance`).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Hashable, NamedTuple

from cluster.core.interfaces import BatchedHandle
from cluster.core.sampling import SamplingParams
from cluster.core.verify_round import ReviewItem, VerifyItem


class PrefillItem(NamedTuple):
    """One request's item of ``prefill_batch``.  Handles accept the first four fields alone too (a 4-tuple:
    no salt); :meth:`of` reads either form."""

    rid: str
    ids: list[int]               # [P >= 1] the context; all but ids[-1] are cached, ids[-1] stays pending
    sampling: SamplingParams
    seed: int
    salt: str = ""               # the request's cache_salt ("": none): what a handle keeps across requests
                                 # (prefix cache blocks, the suffix drafter's index) is shared within one salt

    @classmethod
    def of(cls, item: tuple) -> "PrefillItem":
        """``item`` (a PrefillItem, or a 4- or 5-tuple) as a PrefillItem."""
        return item if isinstance(item, cls) else cls(*item)


class ScoreItem(NamedTuple):
    rid: str
    draft: list[int]             # [L] appended, then one forward -> logits [L+1, V]


class ProposeItem(NamedTuple):
    rid: str
    k: int                       # tokens to sample -> (tokens [k], logits [k, V])
    rows: bool = True            # False: the caller reads the tokens only (logits None: nothing copied or sent)
    law: bool = False            # the rows as the probabilities the tokens were drawn from, not the raw logits
                                 # (asked of a handle that declares ``laws`` only)


class AdaptiveItem(NamedTuple):
    rid: str
    k_max: int                   # -> (tokens [K <= k_max], logits [K, V])
    head: Any                    # the acceptance head (a path, or the built head)
    threshold: float
    eos: int | None = None


class DraftItem(NamedTuple):
    rid: str
    spec: Any                    # cluster.core.draft.programs.DraftSpec
    limit: int                   # at most this many tokens -> DraftBlock (tokens [L <= limit], q [L, S])
    budget: int                  # tokens the request may still emit this step (bounds a pre-draft)


@dataclass(frozen=True)
class Propose:
    """Draft ``k`` tokens autoregressively with ``model`` -> ``(tokens [k], raw logits [k, V])``; with ``rows``
    False the logits come back as None (a greedy block travels as its tokens); with ``law`` the rows are the
    laws the tokens were drawn from (probabilities [k, V]: the verifier then computes no softmax over them)."""

    model: str
    k: int
    rows: bool = True
    law: bool = False

    def item(self, rid: str) -> ProposeItem:
        return ProposeItem(rid, self.k, self.rows, self.law)

    @staticmethod
    def run(handle: BatchedHandle, items: list[ProposeItem]) -> list:
        return handle.propose_batch(items)


@dataclass(frozen=True)
class ProposeAdaptive:
    """SpecDec++ drafting with ``model``: at most ``k_max`` tokens, stopping by the acceptance ``head``'s
    rule at ``threshold`` or right after an ``eos`` candidate (:class:`cluster.core.draft.stop.DraftStop`)
    -> ``(tokens [K], raw logits [K, V])``."""

    model: str
    k_max: int
    head: Any
    threshold: float
    eos: int | None = None

    def item(self, rid: str) -> AdaptiveItem:
        return AdaptiveItem(rid, self.k_max, self.head, self.threshold, self.eos)

    @staticmethod
    def run(handle: BatchedHandle, items: list[AdaptiveItem]) -> list:
        return handle.propose_adaptive_batch(items)


@dataclass(frozen=True)
class Score:
    """Append ``draft`` and run one forward pass of ``model`` -> raw logits ``[L+1, V]``."""

    model: str
    draft: tuple[int, ...]

    def item(self, rid: str) -> ScoreItem:
        return ScoreItem(rid, list(self.draft))

    @staticmethod
    def run(handle: BatchedHandle, items: list[ScoreItem]) -> list:
        return handle.score_batch(items)


@dataclass(frozen=True)
class Draft:
    """Ask the draft side ``model`` for one block of drafts -> :class:`cluster.core.draft.programs.DraftBlock`.

    ``spec`` (:class:`cluster.core.draft.programs.DraftSpec`) says how (one drafter, SpecDec++, or a CS Drafting
    cascade), ``limit`` how many tokens at most, ``budget`` how many the request may still emit this step
    (what the draft side may draft ahead for the next step).  However deep the drafting, it is one call (one
    round trip when the draft side is an actor)."""

    model: str
    spec: Any
    limit: int
    budget: int

    def item(self, rid: str) -> DraftItem:
        return DraftItem(rid, self.spec, self.limit, self.budget)

    @staticmethod
    def run(handle: BatchedHandle, items: list[DraftItem]) -> list:
        return handle.draft_batch(items)


@dataclass(frozen=True)
class Verify:
    """Score ``draft`` on the target ``model`` and verify it there -> :class:`cluster.core.verify_round.Verified`
    (accepted count, the recovered or bonus token, logprobs if asked).  The round's calls of every request
    run as ONE forward and ONE batched rejection sampler on the target's device; ``block`` says how q travels
    (None: deterministic drafts), ``start`` is the sequence length where the step began (the draws' counter)."""

    model: str
    draft: tuple[int, ...]
    block: Any
    sampling: SamplingParams
    rng: Any
    start: int
    method: str = "token"
    logprobs: int | None = None
    allowed: Any = None          # bool [L+1, V']: a grammar's mask at each row (None: no grammar)
    law: tuple | None = None     # GenSpecSample's pi = T(q, p) instead of p (VerifyItem.law)

    def item(self, rid: str) -> VerifyItem:
        return VerifyItem(rid, list(self.draft), self.block, self.sampling, self.rng, self.start, self.method,
                          self.logprobs, self.allowed, self.law)

    @staticmethod
    def run(handle: BatchedHandle, items: list[VerifyItem]) -> list:
        return handle.verify_batch(items)


@dataclass(frozen=True)
class Review:
    """CS Drafting's review: drafter ``model`` scores ``draft`` (the draft of the drafters below it) and verifies it
    against the laws ``q`` it was drawn from -> :class:`cluster.core.verify_round.Reviewed` (accepted count, the
    next token, and the laws of the emitted tokens, handed up).  The round's reviews by one drafter run as ONE
    forward and one batched call on its device (:func:`cluster.core.verify_round.review_round`)."""

    model: str
    draft: tuple[int, ...]
    q: tuple                     # [L] a [V] row per position, None for a one-hot (Max-Gram) one
    lenience: tuple              # [L] l per position
    sampling: SamplingParams
    rng: Any
    index: int                   # the review's number within its block (the draws' counter)
    allowed: Any = None          # bool [L+1, V']: a grammar's mask at each row (None: no grammar)

    def item(self, rid: str) -> ReviewItem:
        return ReviewItem(rid, list(self.draft), self.q, self.lenience, self.sampling, self.rng, self.index,
                          self.allowed)

    @staticmethod
    def run(handle: BatchedHandle, items: list[ReviewItem]) -> list:
        return handle.review_batch(items)


ModelCall = Propose | ProposeAdaptive | Score | Draft | Verify | Review


def run_group(handle: BatchedHandle, kind: type, items: list[tuple[str, ModelCall]]) -> list[Any]:
    """Results of ``items`` = [(request id, call)], all of ``kind`` on ``handle``, in order: one batched call."""
    return kind.run(handle, [call.item(rid) for rid, call in items])


def prefill_scored(handle: BatchedHandle, items: list[tuple]) -> list[Any]:
    """Start ``items`` (:class:`PrefillItem`: token ids [P >= 2]) on ``handle`` as ``prefill_batch`` does, and
    return each prompt's raw logits ``[P-1, V]`` (row i: the distribution of ``ids[i+1]``) from the same forward
    that fills the cache: the first token is prefilled alone, the rest but the last scored as a draft (one
    batched forward for all items), and the last token appended as prefill leaves it, pending."""
    items = [PrefillItem.of(it) for it in items]
    handle.prefill_batch([it._replace(ids=it.ids[:1]) for it in items])
    logits = run_group(handle, Score, [(it.rid, Score(handle.name, tuple(it.ids[1:-1]))) for it in items])
    for it in items:
        handle.extend(it.rid, [it.ids[-1]])
    return logits


def group_calls(pending: dict[Any, ModelCall], target: str | None = None) -> dict[tuple[str, type], list[Any]]:
    """The calls to run this round, keyed by (model, kind).  With a ``target``: every other model's calls
    first, the target's only once no request waits on a drafter, so all of a step's verifications share one
    target pass (the engine); without one, every pending call (the draft side)."""
    drafting = [key for key, call in pending.items() if call.model != target]
    groups: dict[tuple[str, type], list[Any]] = defaultdict(list)
    for key in drafting or list(pending):
        call = pending[key]
        groups[(call.model, type(call))].append(key)
    return groups


class Stopped(Exception):
    """The result of a generator :func:`drive` closed because its caller asked it to stop."""


def advance(key, gen, value, pending: dict, done: dict) -> None:
    """Send ``value`` into generator ``gen``: its next call goes to ``pending[key]``, its return value (or the
    exception it raised: it fails that request only) to ``done[key]``."""
    try:
        pending[key] = gen.send(value)
    except StopIteration as stop:
        done[key] = stop.value
    except Exception as e:                               # noqa: BLE001 - an error fails its own request
        done[key] = e


def drive(gens: dict[Hashable, Any], handles, rid_of: Callable[[Hashable], str], *, target: str | None = None,
          group_failed: Callable[[str, Exception], None] | None = None,
          redo: Callable[[Hashable, str, BaseException], Any] | None = None,
          stop: Callable[[], bool] | None = None,
          withdraw: Callable[[list], Any] | None = None) -> dict[Hashable, Any]:
    """Run the generators ``gens`` (key -> generator of model calls) to their end together; -> key -> the
    generator's return value, or the exception that failed it.  ``stop``: asked before each round; once true,
    every generator still pending is closed with :class:`Stopped` as its result (between rounds every generator
    waits at a call not yet made, so the models hold exactly what the generators recorded).  ``withdraw``: asked
    before each round with the keys still pending; the keys it returns are closed the same way, the others go on.

    Each round runs every pending call grouped per (model, kind) as one batched call on ``handles[model]``
    (``target``: see :func:`group_calls`).  A group whose call raises fails its generators; ``group_failed``
    (model, error) hears of it first, once per group, and may raise to stop everything.  A generator whose
    result is an exception is closed, and ``redo(key, model, error)`` may hand a fresh generator to run in its
    place (None: it fails with that error)."""
    pending: dict = {}
    done: dict = {}
    for key, gen in gens.items():
        advance(key, gen, None, pending, done)
    while pending:
        halt = stop is not None and stop()
        if halt:
            closing = list(pending)
        elif withdraw is not None:
            closing = [k for k in withdraw(list(pending)) if k in pending]
        else:
            closing = []
        for key in closing:                              # stopped or withdrawn: closed between rounds, one way
            gens[key].close()
            del pending[key]
            done[key] = Stopped()
        if halt or not pending:
            break
        for (model, kind), keys in group_calls(pending, target).items():
            try:
                results = run_group(handles[model], kind, [(rid_of(k), pending[k]) for k in keys])
            except Exception as e:                       # noqa: BLE001 - fails this group's generators only
                if group_failed is not None:
                    group_failed(model, e)
                results = [e] * len(keys)
            for key, result in zip(keys, results):
                del pending[key]
                if not isinstance(result, BaseException):
                    advance(key, gens[key], result, pending, done)
                    continue
                gens[key].close()
                again = redo(key, model, result) if redo is not None else None
                if again is None:
                    done[key] = result
                else:
                    gens[key] = again
                    advance(key, again, None, pending, done)
    return done
