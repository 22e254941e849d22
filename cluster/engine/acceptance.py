"""Per-drafter acceptance estimates for the load-aware planner (:mod:`cluster.engine.planner`), read from the
requests' own counters.

Under the i.i.d. acceptance model of Leviathan et al., *Fast Inference from Transformers via Speculative
Decoding* (section 3.1), a step that drafted d tokens and accepted a < d of them saw a accepts and one
reject, so a request's estimate is Beta-style, alpha_i = (g * w + accepts_i) / (w + accepts_i + rejects_i),
shrunk toward the drafter's global g = (prior_alpha * w + A) / (w + A + R) over live and recently finished
requests (w = prior_weight).  accepted_tokens / drafted_tokens would understate alpha: at alpha = 0.8 and
k = 4 it reads 0.59.

w is 16 trials (about four steps of k = 4), not fewer: a request that decodes plainly drafts no more, so its
estimate cannot recover from its first steps, where drafts miss most (the first tokens after a prompt); with
a weight of a single step, a few such steps took requests to plain decoding for the rest of their life.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

PRIOR_ALPHA = 0.8      # a drafter's acceptance before any of its requests has drafted
PRIOR_WEIGHT = 16.0    # w: pseudo-trials shrinking a request's alpha toward its drafter's (module docstring)
SCALE_PRIOR = 4.0      # pseudo drafted tokens, measured = modelled, in Acceptance.scale (see there)


@dataclass
class Track:
    """What the planner has read of one request's stats: the raw counters and the derived trials."""

    drafter: str
    seq: object = None        # the sequence (held so its id stays unique while tracked)
    steps: int = 0
    accepted: int = 0
    drafted: int = 0
    accepts: int = 0          # tried positions accepted
    rejects: int = 0          # tried positions rejected (at most one per step)

    def update(self, stats) -> tuple[int, int]:
        """Fold the stats' growth since the last read in; returns the (accepts, rejects) it added."""
        ds, da, dd = stats.steps - self.steps, stats.accepted_tokens - self.accepted, \
            stats.drafted_tokens - self.drafted
        self.steps, self.accepted, self.drafted = stats.steps, stats.accepted_tokens, stats.drafted_tokens
        rej = min(max(ds, 0), max(dd - da, 0))     # exact for one step per plan (the engine's loop)
        self.accepts += max(da, 0)
        self.rejects += rej
        return max(da, 0), rej


class Acceptance:
    """The tracks of live requests and the folded counts of finished ones, per drafter (bounded memory:
    the finished counts are rescaled to ``memory`` trials, a recent average rather than the all-time one)."""

    def __init__(self, prior_alpha: float = PRIOR_ALPHA, prior_weight: float = PRIOR_WEIGHT, memory: int = 4096):
        if not 0.0 <= prior_alpha <= 1.0 or prior_weight <= 0:
            raise ValueError("Planner: prior_alpha in [0, 1] and prior_weight > 0")
        self.prior_alpha, self.prior_weight, self.memory = float(prior_alpha), float(prior_weight), memory
        self._tracks: dict[int, Track] = {}           # id(live sequence) -> what was read of its stats
        self._retired: dict[str, list[float]] = {}     # drafter -> [accepts, rejects] of finished requests
        self._drafted: dict[str, deque] = {}           # drafter -> (measured, modelled) drafted tokens per step

    def read(self, seq, drafter: str) -> Track:
        """The request's track, brought up to date with its stats (a new one if it changed drafter)."""
        track = self._tracks.get(id(seq))
        if track is None or track.drafter != drafter:
            track = self._tracks[id(seq)] = Track(drafter, seq)
        track.update(seq.ctx.stats)
        return track

    def alpha(self, drafter: str) -> float:
        """The drafter's global estimate g (prior + finished + live requests)."""
        a, r = self._retired.get(drafter, (0.0, 0.0))
        for t in self._tracks.values():
            if t.drafter == drafter:
                a, r = a + t.accepts, r + t.rejects
        w = self.prior_weight
        return (self.prior_alpha * w + a) / (w + a + r)

    def of(self, seq, g: float) -> float:
        """A tracked request's estimate alpha_i, shrunk toward the global ``g``."""
        t, w = self._tracks[id(seq)], self.prior_weight
        return (g * w + t.accepts) / (w + t.accepts + t.rejects)

    def retire(self, live: set[int]) -> None:
        """Fold the counts of requests no longer running (ids not in ``live``) into their drafter's totals."""
        for key in [k for k in self._tracks if k not in live]:
            t = self._tracks.pop(key)
            tot = self._retired.setdefault(t.drafter, [0.0, 0.0])
            tot[0] += t.accepts
            tot[1] += t.rejects
            n = tot[0] + tot[1]
            if self.memory and n > self.memory:
                tot[0], tot[1] = tot[0] * self.memory / n, tot[1] * self.memory / n

    def drafted(self, drafter: str, measured: float, modelled: float, keep: int = 256) -> None:
        """One drafting step's tokens beyond the target's own per row: measured, and as the model expected."""
        self._drafted.setdefault(drafter, deque(maxlen=keep)).append((measured, modelled))

    def scale(self, drafter: str) -> float:
        """The drafter's measured / modelled drafted tokens over its last drafting steps in every band (acceptance
        does not depend on the batch), shrunk toward 1 by ``SCALE_PRIOR`` pseudo-tokens.  The model counts a draft
        of k tokens; a CS Drafting cascade planned at k = 1 drafts a whole block, several times what the model
        counts, and its first steps must correct that: a band that decodes plainly on an uncalibrated model drafts
        again only through its probes (one probe run of a few steps must be enough).  One pseudo-token was too
        few the other way: a drafter's first step in a process, cold and at the hardest tokens, could read a
        scale low enough to send a fresh band to plain decoding for dozens of plans."""
        pairs = self._drafted.get(drafter, ())
        return (sum(m for m, _ in pairs) + SCALE_PRIOR) / (sum(e for _, e in pairs) + SCALE_PRIOR) if pairs else 1.0
