"""The per-step wire contract between a serving unit and its model actors (both ends import it).

A call is ``call(rid, ops, method, args) -> (result, compute seconds)``: ``ops`` are the queued
calls that return nothing (:data:`OPS`), applied in order before ``method`` (:data:`METHODS`).
Tensors travel as numpy arrays (:func:`pack` / :func:`unpack`).
"""
from __future__ import annotations

import os
import pickle
import socket

import numpy as np
import torch


def tcp_nodelay(conn):
    """Disable Nagle's algorithm on a ``multiprocessing.connection`` socket and return it.

    Messages over 16 KiB (the logits of a 4096-token vocabulary already) go out as a header write
    plus a payload write; with Nagle on, the tail segment waits for the peer's delayed ACK, which
    stalled every such call by ~40 ms.
    """
    s = socket.socket(fileno=os.dup(conn.fileno()))      # same socket, own descriptor
    try:
        if s.family in (socket.AF_INET, socket.AF_INET6):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    finally:
        s.close()
    return conn


def unpack(out):
    """numpy arrays from the actor back to tensors (copied: Ray hands out read-only buffers)."""
    if isinstance(out, np.ndarray):
        return torch.from_numpy(out.copy())
    if isinstance(out, tuple):
        return tuple(unpack(x) for x in out)
    return out


OPS = ("prefill", "rollback", "extend")
METHODS = ("propose", "score", "propose_adaptive", "noop")     # propose_adaptive: SpecDec++ drafters


def picklable(x):
    try:
        pickle.dumps(x)
        return x
    except Exception:                                 # noqa: BLE001 - an attribute we cannot ship
        return None


def pack(out):
    """Tensors as numpy arrays: Ray serialises those out of band, cheaper than pickled tensors."""
    if isinstance(out, torch.Tensor):
        return out.numpy()
    if isinstance(out, tuple):
        return tuple(pack(x) for x in out)
    return out
