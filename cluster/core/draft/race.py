"""Race, never wait: a miss step's near drafting against the speculator's answer that is just late (issue 32).

When a step starts before the speculator's answer to the last fill has arrived (:mod:`cluster.core.draft.near_far`),
the near side drafts, and before each of its drafting rounds (one token per round for a neural drafter) this race
polls the link.  Once the answer arrives, the request takes the far block drafted from exactly its committed sequence
``s`` for its draft spec (:meth:`cluster.core.draft.cache.SpeculationCache.take`) and stops drafting near when

* the request is greedy (any block is exact there: greedy verification emits the target's argmax path whatever
  the draft), or
* near has drawn ``x_1..x_j`` so far, a prefix of the block to come (the token-by-token drafter:
  :attr:`cluster.core.draft.programs.DraftCtx.partial`; ``j = 0`` before the first round, for any program), and the
  far block ``y`` begins with exactly those tokens: ``y[:j] == x[:j]``.

Otherwise near's block is used.  The answer is looked at once, at the round it arrived.

**Why the second rule is exact** (Leviathan et al., *Fast Inference from Transformers via Speculative Decoding*,
Theorem 1 needs only that the block be a draw of the draft program q at ``s``, made independently of the target's
draws, and verified with the distributions it was drawn from).  Near and far run the same draft program at the same
``s`` (the far copy's drafters are the same models) with independent random streams; the program draws one token at
a time and stops as a function of the prefix (its length limit, EOS, SpecDec++'s rule).  Let the answer arrive at
round J (a time that depends on the clock and the speculator, and on near's draws only through ``x[:J]``).  For a
block z that is longer than J, with a = q(z[:J]) and r = q(z[J:] | z[:J]),

    P(out = z) = P(x[:J] = z[:J]) * [ P(y = z) + P(y[:J] != z[:J]) * r ] = a * [ a*r + (1 - a) * r ] = a*r = q(z),

as near's continuation after ``x[:J]`` is drawn from q(. | z[:J]) whatever y was; a block that ended by round J is
near's own draw.  So the block is a draw of q at ``s``; its tokens past j were drawn by the far copy from q given
the same prefix and its first j tokens equal near's, so the far block's rows are the distributions each token was
drawn from, and it is verified with them.  None of this reads the target.  A cascade's rounds draw tokens that its
reviews may replace (no prefix of its block): a sampled cascade stops only before its first round.  The exact
enumeration in tests/core/draft/test_race.py runs every round of arrival, alone and in a mixed batch.
"""
from __future__ import annotations

from cluster.core.draft.cache import Entry


class Race:
    """One miss step's race (see the module docstring), passed to :meth:`cluster.core.draft.side.DraftSide.draft_batch`
    as ``race``: called before each drafting round with {item index: the tokens drafted so far, or None} for the
    items still drafting, it returns the items to stop.  ``side``: the :class:`cluster.core.draft.near_far.NearFarSide`
    (its link, cache and near side); ``items``: the miss items ``(rid, spec, limit, budget)``."""

    def __init__(self, side, items: list[tuple]):
        self.side, self.items = side, items
        self.rounds = 0                             # drafting rounds near had done when the answer came
        self.chosen: dict[int, Entry] = {}
        self.arrived = False

    def __call__(self, drafting: dict[int, list[int] | None]) -> list[int]:
        if self.arrived:
            return []
        if not self.side.poll():                    # (the answer to an older fill is only counted there)
            self.rounds += 1
            return []
        self.arrived = True
        for k, (rid, spec, _, _) in enumerate(self.items):
            used = self.side.take(rid, spec)
            if used is None:
                continue
            drawn = drafting.get(k)
            if k in drafting and (self.side.near.request(rid).sampling.greedy or
                                  (drawn is not None and used.block.tokens[:len(drawn)] == drawn)):
                self.chosen[k] = used
            else:                                   # near had finished, or its draws differ: near's block
                self.side.counters.wasted += len(used.block.tokens)
        return list(self.chosen)

    def settle(self, blocks: list) -> list:
        """``blocks`` (near's answers, in item order) with the far blocks the race chose in place."""
        c = self.side.counters
        for k, used in self.chosen.items():
            rid, _, limit, _ = self.items[k]
            blocks[k] = used.block.tail(0, limit)
            self.side.near.adopt(rid, blocks[k].tokens)
            c.hits[used.key[0]] += 1
            c.raced += 1
            c.raced_rounds += self.rounds
        return blocks
