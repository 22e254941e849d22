"""Per-request statistics returned with every generation (and summed by the benchmark)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RequestStats:
    strategy: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0                               # of them, found in the target's prefix cache
    generated_tokens: int = 0
    steps: int = 0                                       # verification steps (target calls that verify)
    target_forwards: int = 0
    drafter_forwards: dict[str, int] = field(default_factory=dict)
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_hist: list[int] = field(default_factory=list)   # [n] = steps that accepted n draft tokens
    drafted_per_pos: list[int] = field(default_factory=list)  # [i] = steps that drafted position i+1
    accepted_per_pos: list[int] = field(default_factory=list) # [i] = steps that accepted position i+1
    wall_s: float = 0.0
    ttft_s: float = 0.0
    deferral_checks: int = 0                             # cascades: positions a deferral rule decided
    deferrals: float = 0.0                               # ... and deferred to the target (expected, token rules)
    prediction_drafted: int = 0                          # predicted outputs: draft tokens taken from the prediction
    prediction_accepted: int = 0                         # ... and kept by verification (OpenAI's accepted ones)

    # -- recording -------------------------------------------------------------------------------
    def forward(self, model: str, n: int = 1, *, target: bool = False) -> None:
        """Count ``n`` forward passes of ``model`` (the target's separately)."""
        if target:
            self.target_forwards += n
        elif n:
            self.drafter_forwards[model] = self.drafter_forwards.get(model, 0) + n

    def verification(self, drafted: int, accepted: int) -> None:
        """Record one draft-and-verify step: ``accepted`` of ``drafted`` tokens kept."""
        self.steps += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        _bump(self.accepted_hist, accepted)
        for i in range(drafted):
            _bump(self.drafted_per_pos, i)
        for i in range(accepted):
            _bump(self.accepted_per_pos, i)

    def prediction(self, drafted: int, accepted: int) -> None:
        """Record a prediction-backed draft (also counted by :meth:`verification`): ``accepted`` of ``drafted``."""
        self.prediction_drafted += drafted
        self.prediction_accepted += accepted

    def deferral(self, checks: int, deferred: float) -> None:
        """Record a cascade rule's decision over ``checks`` positions, ``deferred`` of them (in expectation
        for token-level rules) deferred to the target."""
        self.deferral_checks += checks
        self.deferrals += deferred

    def merge(self, other: "RequestStats") -> None:
        """Add ``other``'s counts into this one (for aggregate benchmark rows)."""
        for name in ("prompt_tokens", "cached_tokens", "generated_tokens", "steps", "target_forwards", "drafted_tokens",
                     "accepted_tokens", "wall_s", "ttft_s", "deferral_checks", "deferrals", "prediction_drafted",
                     "prediction_accepted"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for k, v in other.drafter_forwards.items():
            self.drafter_forwards[k] = self.drafter_forwards.get(k, 0) + v
        for mine, theirs in ((self.accepted_hist, other.accepted_hist),
                             (self.drafted_per_pos, other.drafted_per_pos),
                             (self.accepted_per_pos, other.accepted_per_pos)):
            for i, v in enumerate(theirs):
                _bump(mine, i, v)

    # -- derived ---------------------------------------------------------------------------------
    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def mean_accepted(self) -> float:
        """Mean accepted draft tokens per verification step."""
        return self.accepted_tokens / self.steps if self.steps else 0.0

    @property
    def tokens_per_target_call(self) -> float:
        return self.generated_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def target_calls_per_token(self) -> float:
        return self.target_forwards / self.generated_tokens if self.generated_tokens else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(tokens_per_s=self.tokens_per_s, mean_accepted=self.mean_accepted,
                 tokens_per_target_call=self.tokens_per_target_call,
                 target_calls_per_token=self.target_calls_per_token, acceptance_rate=self.acceptance_rate)
        return d


def _bump(counts: list[int], i: int, by: int = 1) -> None:
    while len(counts) <= i:
        counts.append(0)
    counts[i] += by
