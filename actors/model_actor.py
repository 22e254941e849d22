"""A Ray actor hosting one model (a handle from :func:`cluster.models.build.build_handle`) behind the ModelHandle methods.

The coordinator talks to it through :class:`cluster.serving.remote.RemoteHandle`, which queues the calls that
return nothing (prefill, rollback, extend) and sends them with the next call that returns something,
so each decoding step costs one round trip per model:

    call(rid, ops, method, args) -> (result, compute seconds)

``ops`` is a list of ``(name, args)`` applied in order before ``method`` (``"propose"``, ``"score"``
or ``"noop"``).  Tensors travel as numpy arrays; the compute time lets the benchmark split a step's
wall time into RPC overhead and model compute.

Transport: Ray actor calls start, place and supervise the actor; the per-step ``call`` can also go
over a *direct* connection (:meth:`ModelHost.serve_direct`: a ``multiprocessing.connection`` socket
on the actor's node, authenticated with a per-actor key handed out through Ray), which costs a
fraction of a Ray task round trip -- the difference matters when one forward pass takes a few ms.
"""
from __future__ import annotations

import os
import threading
import time
from multiprocessing.connection import Listener

import torch

from actors.protocol import METHODS, OPS, pack, picklable, tcp_nodelay
from cluster.models.build import build_handle


class ModelHost:
    """The actor body (plain class: :mod:`actors.tp` reuses it for tensor-parallel ranks)."""

    def __init__(self, cfg, name: str, threads: int = 1, concurrency: int = 4):
        torch.set_num_threads(threads)
        self.worker = build_handle(cfg, name)
        self.name = name
        self.concurrency = concurrency          # calls served at once over direct sockets

    def info(self) -> dict:
        w = self.worker
        return dict(name=w.name, vocab_size=w.vocab_size, max_length=w.max_length, num_params=w.num_params,
                    specdec_head=picklable(getattr(w, "specdec_head", None)),
                    deterministic=bool(getattr(w, "deterministic", False)))

    def call(self, rid: str, ops: list, method: str, args: tuple = ()):
        t0 = time.perf_counter()
        for op, op_args in ops:
            if op not in OPS:
                raise ValueError(f"unknown op {op!r}")
            getattr(self.worker, op)(rid, *op_args)
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}")
        out = None if method == "noop" else getattr(self.worker, method)(rid, *args)
        return pack(out), time.perf_counter() - t0

    def release(self, rid: str) -> None:
        self.worker.release(rid)

    # -- direct transport -------------------------------------------------------------------------
    def serve_direct(self) -> tuple[str, int, bytes]:
        """Start (once) a socket server for :meth:`call`; returns (host, port, authkey)."""
        if getattr(self, "_direct", None) is None:

            import ray
            host, key = ray.util.get_node_ip_address(), os.urandom(16)
            listener = Listener((host, 0), authkey=key)
            self._slots = threading.BoundedSemaphore(getattr(self, "concurrency", 4))
            self._direct = (host, listener.address[1], key)
            threading.Thread(target=self._accept, args=(listener,), daemon=True, name="direct-accept").start()
        return self._direct

    def _accept(self, listener) -> None:
        while True:
            conn = listener.accept()
            tcp_nodelay(conn)
            threading.Thread(target=self._serve_conn, args=(conn,), daemon=True, name="direct-conn").start()

    def _serve_conn(self, conn) -> None:
        """One caller thread's connection: (method, args) in, ("ok", result) / ("err", exc) out."""
        try:
            while True:
                method, args = conn.recv()
                try:
                    if method not in ("call", "release"):
                        raise ValueError(f"unknown direct method {method!r}")
                    with self._slots:
                        reply = ("ok", getattr(self, method)(*args))
                except Exception as e:                 # noqa: BLE001 - handed to the caller
                    reply = ("err", e)
                try:
                    conn.send(reply)
                except Exception as e:                 # unpicklable exception
                    conn.send(("err", RuntimeError(f"{type(e).__name__}: {e}")))
        except (EOFError, OSError):
            conn.close()

    def active_requests(self) -> list[str]:
        return self.worker.active_requests()

    def health(self) -> dict:
        return dict(name=self.name, ok=True, active=len(self.worker.active_requests()))


def model_actor_class():
    """``ModelHost`` as a Ray actor class (imported lazily so this module loads without Ray)."""
    import ray
    return ray.remote(ModelHost)


def start_model_actor(cfg, name: str, *, num_cpus: float, num_gpus: float = 0.0, threads: int = 1,
                      concurrency: int = 4, **options):
    """Create the actor for model ``name``; returns the handle (not yet waited on)."""
    return model_actor_class().options(num_cpus=num_cpus, num_gpus=num_gpus, max_concurrency=concurrency,
                                       **options).remote(cfg, name, threads, concurrency)
