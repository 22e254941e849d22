"""A serving unit on Ray: start its actors and connect remote handles (the cluster's composition root).

Counterpart of :mod:`cluster.local`: the drafters and the Max-Gram drafter (together in ONE draft-group actor
behind the draft side in the ``separated`` topology, :mod:`actors.draft_actor`; in-process in ``colocated``; in
``speculator`` in-process as the near drafter, with the draft-group actor as the far speculator filling its
speculation cache, :mod:`cluster.core.draft.near_far`), and the target (in the coordinator's process by default, so verification runs where its logits
are; an actor with ``target_placement: actor``; a tensor-parallel group of rank actors when ``tp_size > 1``),
every one built by :func:`cluster.models.build.build_handle`.  Separated, the engine's models are the target,
the draft side (:data:`cluster.core.draft.programs.DRAFTS`, one round trip per step) and each drafter as a member of
the draft-group actor (for strategies that drive one drafter directly).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from actors.draft_actor import start_draft_actor
from actors.model_actor import start_model_actor
from actors.tp import start_tp_group
from cluster.config.schema import Config
from cluster.core.draft.near_far import NearFarSide
from cluster.core.draft.programs import DRAFTS
from cluster.core.draft.side import DraftSide
from cluster.core.model_set import ModelSet
from cluster.models.build import build_handle, load_tokenizer, model_vocab_size
from cluster.serving.control.ray_channel import RayChannel
from cluster.serving.control.remote import RemoteHandle
from cluster.serving.control.socket_channel import SocketChannel
from cluster.serving.control.speculator_link import SocketSpeculatorLink

STARTUP_TIMEOUT_S = 900.0     # loading a model (or a TP group's shards) may take minutes; calls have their own


@dataclass
class ModelEntry:
    name: str
    role: str                       # target | drafter | draft-side
    placement: str                  # local | actor | tp-group
    handle: Any


def _channel(cl, name: str) -> type:
    """The transport of ``name``'s actor: the draft group's per-step calls as ``cluster.draft_channel`` says."""
    return SocketChannel if name == DRAFTS and cl.draft_channel == "socket" else RayChannel


def build_unit(cfg: Config, topology: str | None = None):
    """Start the actors of one unit; returns (entries by name, the engine's :class:`ModelSet`, tokenizer,
    channels to close)."""
    cl = cfg.cluster
    topology = topology or cl.placement()[0]
    separated, speculator = topology == "separated", topology == "speculator"
    entries: dict[str, ModelEntry] = {}
    # start every actor first (they load in parallel), then connect: name -> (actors, pg, placement)
    started: dict[str, tuple] = {}
    rebuild = None
    if cl.tp_size > 1:                           # the target: a TP group (loads while it starts) ...
        def rebuild():
            actors, pg, _ = start_tp_group(cfg, cfg.target, tp_size=cl.tp_size, threads=cl.target.threads,
                                           backend=cl.tp_backend(), device=cfg.models[cfg.target].device,
                                           collective_timeout_s=cl.call_timeout_s, strategy=cl.tp_placement(),
                                           **cl.target.ray_options())
            return actors, pg
        started[cfg.target] = (*rebuild(), "tp-group")
    elif cl.target_placement == "actor":        # ... or one actor
        actor = start_model_actor(cfg, cfg.target, threads=cl.target.threads, **cl.target.ray_options())
        started[cfg.target] = ([actor], None, "actor")

    far = None                                   # speculator: the draft-group actor hosting it
    if (separated or speculator) and (cfg.drafters or cfg.statistical):       # every drafter in one draft-group actor
        vocab = model_vocab_size(cfg, cfg.target)     # the Max-Gram table's, from the config alone
        actor = start_draft_actor(cfg, list(cfg.drafters), vocab, threads=cl.drafters.threads,
                                  overlap=separated and cfg.engine.overlap_on(draft_side_remote=True),
                                  **cl.drafters.ray_options())
        if separated:
            started[DRAFTS] = ([actor], None, "actor")
        else:
            far = RayChannel([actor], name="speculator", timeout_s=cl.call_timeout_s)
    if not separated:
        for name in cfg.drafters:
            entries[name] = ModelEntry(name, "drafter", "local", build_handle(cfg, name))
    if cfg.target not in started:                # ... or in this (the coordinator's) process, while actors load
        entries[cfg.target] = ModelEntry(cfg.target, "target", "local", build_handle(cfg, cfg.target))
    channels = {name: _channel(cl, name)(actors, name=name, timeout_s=cl.call_timeout_s, placement_group=pg,
                                         restart=rebuild if placement == "tp-group" else None)
                for name, (actors, pg, placement) in started.items()}
    asked = {name: ch.ask("info") for name, ch in {**channels, **({"": far} if far else {})}.items()}   # all load
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    for name, ch in channels.items():
        info, placement = asked[name].wait(max(0.0, deadline - time.monotonic()))[0], started[name][2]
        role = "target" if name == cfg.target else "draft-side" if name == DRAFTS else "drafter"
        entries[name] = ModelEntry(name, role, placement, RemoteHandle(ch, info, placement=placement))
        for member, minfo in info.get("members", {}).items():       # the draft group's drafters, one by one
            entries[member] = ModelEntry(member, "drafter", placement,
                                         RemoteHandle(ch, minfo, placement=placement, member=member))
    for name in cfg.statistical if not separated else ():                      # MaG, the suffix drafter in-process too
        vocab = entries[cfg.target].handle.vocab_size
        entries[name] = ModelEntry(name, "drafter", "local", build_handle(cfg, name, vocab_size=vocab))
    ordered = {cfg.target: entries[cfg.target], **{n: e for n, e in entries.items() if n != cfg.target}}
    handles = {n: e.handle for n, e in ordered.items()}
    if far is not None:                          # the near draft side over this process's drafters, and the far one
        asked[""].wait(max(0.0, deadline - time.monotonic()))
        link = SocketSpeculatorLink(far.actors[0])
        link.open(max(1.0, deadline - time.monotonic()))
        drafters = {n: h for n, h in handles.items() if n != cfg.target}
        handles[DRAFTS] = NearFarSide(DraftSide(drafters), link)
    models = ModelSet.assemble(handles, cfg.target, overlap=cfg.engine.overlap_on(draft_side_remote=False))
    if DRAFTS not in ordered and models.draft_side is not None:          # colocated: the draft side in-process
        ordered[DRAFTS] = ModelEntry(DRAFTS, "draft-side", "local", models.draft_side)
    return ordered, models, load_tokenizer(cfg), list(channels.values()) + ([far] if far is not None else [])
