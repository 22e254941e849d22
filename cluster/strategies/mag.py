"""Speculative decoding with the Max-Gram (MaG) drafter alone (Chen et al., *Cascade Speculative Drafting
for Even Faster LLM Inference*, section 3.3).

MaG's proposals are deterministic (one-hot q), so token verification accepts x w.p. p(x) and
recovers from p with x removed: exact, at the cost of nothing but the target's forward passes.
"""
from __future__ import annotations

from cluster.core.draft.programs import DRAFTS
from cluster.errors import ParamError
from cluster.strategies.base import Option, register
from cluster.strategies.speculative import VERIFY, Speculative

# Max-Gram drafts cost nothing, so its k is what verifying k + 1 positions costs against what they accept: on the
# embedded family at one row, 2.01 tokens per verification at k = 3 (1.09x a plain forward) against 2.07 at k = 4
# (1.18x); in-process 1.48x autoregressive against 1.39x (docs/cluster.md, "Max-Gram's draft length")
K = Option("k", int, 3, "draft tokens per step", low=1, high=64)


def find_mag(models) -> str:
    """The name of the served MaG drafter (config section ``mag``), by its declared capabilities only: the
    deterministic drafter that is not another statistical drafter (the suffix drafter)."""
    return find_statistical(models, "maxgram", "mag", "the Max-Gram drafter")


def find_statistical(models, kind: str, section: str, what: str) -> str:
    """The name of the served deterministic drafter of ``kind`` (its ``statistical`` capability; a deterministic
    drafter that names none counts as Max-Gram), else a ParamError naming the config ``section`` to add."""
    for name, m in models.items():
        if m.deterministic and (getattr(m, "statistical", None) or "maxgram") == kind:
            return name
    raise ParamError("strategy", f"a config with a `{section}:` section ({what} is not served)",
                     ", ".join(n for n in models if n != DRAFTS))


@register
class Mag(Speculative):
    """:class:`Speculative` with the Max-Gram drafter: the same step, another drafter and no drafter option."""

    name = "mag"
    help = "speculative decoding with the Max-Gram drafter (longest earlier match + bigram)"
    options = (K, VERIFY)
    constrained = True

    def choose_drafter(self, opts) -> str:
        return find_mag(self.models)
