"""The finished set of models an engine runs over: the target, the drafters (members) and the draft side.

Both composition roots hand the engine one :class:`ModelSet` (:mod:`cluster.local` in-process,
:mod:`cluster.serving.control.unit` on Ray); the engine builds nothing.  In-process the draft side wraps the local
drafters (:meth:`ModelSet.assemble`); served it is a remote handle on the draft-group actor, and the members
are remote handles addressing one drafter each inside it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from cluster.core.draft.side import DraftSide
from cluster.core.draft.programs import DRAFTS
from cluster.core.interfaces import BatchedHandle
from cluster.core.sampling import Rng


@dataclass(frozen=True)
class ModelSet:
    """``handles``: name -> handle, holding the ``target``, every drafter, and the draft side under
    :data:`cluster.core.draft.programs.DRAFTS` whenever there is a drafter."""

    target: str
    handles: Mapping[str, BatchedHandle]

    def __post_init__(self):
        if self.target not in self.handles:
            raise ValueError(f"models must include the target {self.target!r}")
        if undeclared := [n for n, h in self.handles.items() if not isinstance(h, BatchedHandle)]:
            raise TypeError(f"models {undeclared} are not BatchedHandles (cluster.core.interfaces; a per-request "
                            "handle goes through PerRequestHandle)")
        if self.members and DRAFTS not in self.handles:
            raise ValueError(f"drafters {sorted(self.members)} without a draft side (ModelSet.assemble builds one)")

    @property
    def members(self) -> dict[str, BatchedHandle]:
        """The drafters (the Max-Gram drafter among them), each addressable on its own."""
        return {n: h for n, h in self.handles.items() if n not in (self.target, DRAFTS)}

    @property
    def draft_side(self) -> BatchedHandle | None:
        return self.handles.get(DRAFTS)

    @classmethod
    def assemble(cls, handles: Mapping[str, BatchedHandle], target: str = "target", *, overlap: bool = False,
                 rng_factory=Rng) -> "ModelSet":
        """The set over in-process ``handles``: their draft side built over the drafters, unless given."""
        handles = dict(handles)
        drafters = {n: h for n, h in handles.items() if n not in (target, DRAFTS)}
        if drafters and DRAFTS not in handles:
            handles[DRAFTS] = DraftSide(drafters, overlap=overlap, rng_factory=rng_factory)
        return cls(target, handles)
