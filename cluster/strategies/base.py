"""What a decoding strategy is, the model calls its steps yield, and the typed options it declares.

A strategy is a small object with ``roles()`` (the models it needs) and ``step(ctx)``: a generator that
reads like per-request code but *yields* each model call (:class:`Draft` to the draft side,
:class:`Score`, :class:`Propose`, :class:`ProposeAdaptive` to one model) and receives its result, and
finally returns the tokens the step emits::

    block = yield Draft(DRAFTS, spec, k, budget)     # DraftBlock: tokens [k], q [k, V]
    p_logits = yield Score(target, block.tokens)     # [k+1, V]
    ...
    return accepted + [next_token]

The engine runs the steps of every live request together and groups their calls per model into one
batched call, so a strategy never sees the batch.  Bookkeeping that costs no forward pass (rollback,
extend) is called on the handles directly.  Options are declared once, as :class:`Option` objects; the
CLI flags, YAML defaults and the gRPC request's options map are all parsed and range-checked through them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Generator

import torch

from cluster.core.calls import Draft, ModelCall, Propose, ProposeAdaptive, Score, Verify  # noqa: F401 (re-exported)
from cluster.core.constraint import constrain_rows, row_masks
from cluster.core.draft.programs import DRAFTS
from cluster.core.interfaces import BatchedHandle
from cluster.core.logprobs import TokenLogprob, token_logprobs
from cluster.core.prediction import Prediction
from cluster.core.sampling import Rng, SamplingParams, logits_to_probs
from cluster.core.stats import RequestStats
from cluster.errors import ParamError, check_choice, check_float, check_int


@dataclass(frozen=True)
class Option:
    """A strategy parameter: its type, default, allowed range and help text."""

    name: str
    kind: type                      # int, float or str
    default: Any
    help: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple | Callable[[], tuple] | None = None
    parser: Callable[[Any], Any] | None = None   # custom parser for structured values (raises ParamError)

    def allowed_choices(self) -> tuple | None:
        return self.choices() if callable(self.choices) else self.choices

    def parse(self, value: Any) -> Any:
        if self.parser is not None:
            return self.parser(value)
        if self.kind is int:
            value = check_int(self.name, value, self.low, self.high)
        elif self.kind is float:
            value = check_float(self.name, value, self.low, self.high,
                                low_open=self.low_open, high_open=self.high_open)
        else:
            value = str(value)
        choices = self.allowed_choices()
        return check_choice(self.name, value, choices) if choices else value




@dataclass
class StepContext:
    """Everything a strategy's step may touch for one request."""

    rid: str
    models: dict[str, BatchedHandle]
    target_name: str
    sampling: SamplingParams
    rng: Rng
    stats: RequestStats
    tokens: list[int]          # committed sequence: prompt + tokens emitted so far
    budget: int                # the step may emit at most this many tokens (>= 1)
    plain: bool = False            # the engine's speculation policy has this step decode plainly (plain_steps)
    eos: int | None = None         # the token that ends this request (None: it ignores EOS)
    extras: dict = field(default_factory=dict)   # per-request scratch space of a strategy
    logprobs: int | None = None    # top-n of the target's logprobs per emitted token (None: not asked)
    step_logprobs: list[TokenLogprob] | None = None   # this step's, aligned with its emitted tokens
    prediction: Prediction | None = None   # the client's predicted output (drafting strategies draw from it)
    behind: dict[str, int] = field(default_factory=dict)   # handle -> tokens it holds: plain steps skipped it
    batched: bool = True           # verify through the batched sampler (Verify); False: the per-row reference

    @property
    def target(self) -> BatchedHandle:
        return self.models[self.target_name]

    def probs(self, logits: torch.Tensor, sampling: SamplingParams | None = None) -> torch.Tensor:
        return logits_to_probs(logits, sampling or self.sampling)

    def target_probs(self, logits: torch.Tensor, draft=()) -> torch.Tensor:
        """The target's law at rows ``[L+1, V]`` of a forward over ``draft``: masked by the request's grammar
        (row i after tokens + draft[:i]; :mod:`cluster.core.constraint`), then the request's sampling."""
        return logits_to_probs(constrain_rows(self.sampling.constraint, self.tokens, draft, logits), self.sampling)

    @property
    def batched_verify(self) -> bool:
        """Whether this step verifies through :class:`Verify` (the batched sampler on the target's device);
        False: the per-row reference (``engine.sampler: reference``)."""
        return self.batched

    def verify(self, draft, block, method: str = "token", law: tuple | None = None) -> Verify:
        """The step's :class:`Verify` call on the target: ``draft`` with q as ``block`` travels, and for a
        grammar's request its masks at each row instead of its state (the grammar lives with the engine);
        ``law``: a cascade's pi (:class:`cluster.core.verify_round.VerifyItem`)."""
        c, sampling, allowed = self.sampling.constraint, self.sampling, None
        if c is not None:
            allowed, sampling = row_masks(c, self.tokens, draft), dataclasses.replace(sampling, constraint=None)
        return Verify(self.target_name, tuple(draft), block, sampling, self.rng, len(self.tokens), method,
                      self.logprobs, allowed, law)

    def record_logprobs(self, target_logits: torch.Tensor, emitted: list[int]) -> None:
        """Every strategy calls this once per step with the target's raw logits ``[>= N, V]`` whose row i
        is the position of ``emitted[i]`` (N tokens): the target's logprobs of what the step emits, whatever
        produced the tokens.  Free when the request did not ask (``logprobs`` None)."""
        if self.logprobs is not None:
            self.step_logprobs = token_logprobs(target_logits, emitted, self.logprobs)

    def skip(self, name: str) -> None:
        """A plain step leaves handle ``name`` untouched (no bookkeeping call): it is told the tokens it missed
        by :meth:`catch_up` before its next use (the engine forgets this when it prefills the handle anew)."""
        self.behind.setdefault(name, len(self.tokens))

    def catch_up(self, name: str) -> None:
        """Append to handle ``name`` the committed tokens the plain steps since :meth:`skip` did not send it."""
        held = self.behind.pop(name, None)
        if held is not None and held < len(self.tokens):
            self.models[name].extend(self.rid, self.tokens[held:])

    def commit(self, handles, kept: int, new: list[int]) -> None:
        """Roll ``handles`` back to ``len(tokens) + kept`` tokens, then append ``new`` (pending)."""
        length = len(self.tokens) + kept
        for h in handles:
            h.rollback(self.rid, length)
            if new:
                h.extend(self.rid, new)


class Strategy:
    """Base class. Subclasses set ``name``, ``options``, and implement ``roles`` and ``step``."""

    name: ClassVar[str]
    help: ClassVar[str] = ""
    options: ClassVar[tuple[Option, ...]] = ()
    lossless: ClassVar[bool] = True
    constrained: ClassVar[bool] = False   # True: samples the grammar-constrained target law exactly (core/constraint.py)
    plain_steps: ClassVar[bool] = False   # True: a step with ctx.plain set is plain decoding (engine/policy.py)

    def __init__(self, opts: dict[str, Any], models: dict[str, BatchedHandle], target: str):
        self.opts, self.models, self.target_name = opts, models, target

    def roles(self) -> list[str]:
        raise NotImplementedError

    def step(self, ctx: StepContext) -> Generator[ModelCall, Any, list[int]]:
        """Yield model calls, receive their results, return the emitted tokens (at least one)."""
        raise NotImplementedError

    def draft_members(self) -> tuple[str, ...]:
        """The drafters this strategy asks the draft side (role DRAFTS) for; strategies that draft say which."""
        return self.spec.drafters

    def max_length(self) -> int:
        """The longest sequence a request may reach: the shortest limit of the models it uses (on the draft
        side only the drafters it names, not every drafter the draft side hosts)."""
        names = [n for role in self.roles() for n in (self.draft_members() if role == DRAFTS else (role,))]
        return min(self.models[n].max_length for n in names)

    # helpers shared by strategies
    def drafter_names(self) -> list[str]:
        return [n for n in self.models if n not in (self.target_name, DRAFTS)]

    def check_drafter(self, name: str, option: str = "drafter") -> str:
        drafters = [n for n in self.drafter_names() if self.models[n].proposes]
        if name not in drafters:
            raise ParamError(option, "one of " + ", ".join(drafters), name)
        return name


REGISTRY: dict[str, type[Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: make a strategy available by name to the engine, CLI, bench and servers."""
    REGISTRY[cls.name] = cls
    return cls


def all_options() -> dict[str, Option]:
    """The union of every registered strategy's options (same name => same declaration)."""
    out: dict[str, Option] = {}
    for cls in REGISTRY.values():
        for opt in cls.options:
            out.setdefault(opt.name, opt)
    return out


def check_option_name(strategy: str, name: Any) -> None:
    """THE option-name check (the engine's admission, the CLI and :func:`resolve_options` use it): ``name``
    must be an option ``strategy`` declares, else :class:`ParamError` naming those it accepts."""
    declared = [o.name for o in REGISTRY[strategy].options]
    if name not in declared:
        raise ParamError("option", f"options of strategy {strategy}: " + (", ".join(declared) or "none"), name)


def resolve_options(strategy: str, given: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """Validated options for ``strategy``: request values over config defaults over declared defaults.

    Unknown option names raise :class:`ParamError` naming the options the strategy accepts.
    """
    declared = {o.name: o for o in REGISTRY[strategy].options}
    for key in given:
        check_option_name(strategy, key)
    out = {}
    for name, opt in declared.items():
        value = given.get(name, defaults.get(name, opt.default))
        out[name] = None if value is None else opt.parse(value)
    return out
