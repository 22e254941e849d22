"""``specserve bench --suite transport``: what a per-step call to another process costs, as a plain Ray actor call
(:class:`cluster.serving.control.ray_channel.RayChannel`), over a blocking socket the actor opened through Ray
(:class:`cluster.serving.control.socket_channel.SocketChannel`) and as a Ray Compiled Graph
(``experimental_compile``, shared-memory channels; what vLLM's Ray executor uses between pipeline stages).

Per transport and payload (32 B: a greedy draft block of 4; 64 KiB: one row of k = 4 float32 logits at
V = 4,096): the round trip's median and p90 over ``--prompts`` x 100 calls to an actor that echoes, and the CPU
each side burns -- per wall second while no call is in flight (idle), and per second the caller waits on a
call that takes 20 ms (a drafting step) -- read from /proc for the actor and from the caller's own clock.

This is the measurement behind the choice of transports: a
compiled graph answers much faster than an actor call, but both of its ends poll a full core while they wait,
which a machine whose coordinator, draft actor, Serve proxy and clients share two cores cannot give; a blocking
socket (``cluster.draft_channel: socket``) answers fast and burns nothing while it waits.

Then, where the config has drafters, the real thing (:mod:`cluster.bench.hops`): the per-step draft call's hops
in a separated unit on the config's family, per draft channel (``--channels``, default ray,socket), and in a
``speculator`` unit (its speculation cache's columns: hit share by branch kind, late answers, wasted draft tokens,
fan-out, the speculator's compute per fill against the time its answer has), against the same step in-process.
"""
from __future__ import annotations

import os
import statistics
import time
import tempfile
import threading
from multiprocessing.connection import Client, Listener
from pathlib import Path

from cluster.bench.hops import unit_hops
from cluster.bench.report import print_table, write_results
from cluster.errors import check_int

PAYLOADS = {"32 B": 32, "64 KiB": 64 << 10}
WAIT_S = 0.02


class Echo:
    """The far side: returns its argument, after ``sleep_s`` (a stand-in for drafting)."""

    def call(self, args):
        payload, sleep_s = args
        if sleep_s:
            time.sleep(sleep_s)
        return payload

    def pid(self) -> int:
        return os.getpid()

    def open_socket(self, authkey: bytes):
        """Answer calls on a Unix socket, as :mod:`actors.socket_link` does (the same stdlib framing: a pickle
        per message each way, both ends blocking), in a thread; returns its address."""
        listener = Listener(os.path.join(tempfile.mkdtemp(prefix="specserve-bench-"), "echo.sock"), "AF_UNIX",
                            authkey=authkey)

        def serve():
            with listener.accept() as conn:
                while True:
                    try:
                        conn.send(self.call(conn.recv()))
                    except EOFError:
                        return
        threading.Thread(target=serve, daemon=True).start()
        return listener.address


def _cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _measure(send, pid: int, n: int) -> dict:
    """Round trips of every payload, then idle and waiting CPU, through ``send(args) -> result``."""
    out = {}
    for label, size in PAYLOADS.items():
        payload = b"x" * size
        send((payload, 0.0))                                  # warm-up
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            send((payload, 0.0))
            times.append(time.perf_counter() - t0)
        times.sort()
        out[f"{label} p50 ms"] = statistics.median(times) * 1e3
        out[f"{label} p90 ms"] = times[int(0.9 * (len(times) - 1))] * 1e3
    a0, c0, w0 = _cpu_seconds(pid), time.process_time(), time.perf_counter()
    time.sleep(1.0)
    wall = time.perf_counter() - w0
    out["idle: actor CPU s/s"] = (_cpu_seconds(pid) - a0) / wall
    out["idle: caller CPU s/s"] = (time.process_time() - c0) / wall
    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(10):
        send((b"x", WAIT_S))
    out["waiting: caller CPU s/s"] = (time.process_time() - c0) / (time.perf_counter() - w0)
    return out


def run(args, cfg) -> int:
    import ray
    from ray.dag import InputNode

    n = check_int("prompts", args.prompts, 1, 256) * 100
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="specserve-bench")
    rows = []
    try:
        actor = ray.remote(Echo).options(num_cpus=0, max_concurrency=2).remote()
        pid = ray.get(actor.pid.remote())
        rows.append({"transport": "actor call", **_measure(lambda a: ray.get(actor.call.remote(a)), pid, n)})
        key = os.urandom(32)
        conn = Client(ray.get(actor.open_socket.remote(key)), "AF_UNIX", authkey=key)

        def over_socket(a):
            conn.send(a)
            return conn.recv()
        rows.append({"transport": "blocking socket", **_measure(over_socket, pid, n)})
        conn.close()
        with InputNode() as inp:
            dag = actor.call.bind(inp)
        compiled = dag.experimental_compile()
        try:
            rows.append({"transport": "compiled graph",
                         **_measure(lambda a: ray.get(compiled.execute(a)), pid, n)})
        finally:
            compiled.teardown()
        ray.kill(actor)
        print_table(rows, f"per-step call to another process through Ray ({n} calls per payload)")
        write_results(rows, Path(args.out or "bench_out"), "bench_transport")
        if cfg.drafters or cfg.mag is not None:
            hops = unit_hops(args, cfg)
            print_table(hops, f"the draft call's hops: {cfg.source}, separated and speculator units vs in-process, "
                              f"c = 1, greedy, "
                              f"{args.prompts} held-out prompts x {args.max_new_tokens} tokens; ms per draft call "
                              f"(step_ms per target forward)")
            write_results(hops, Path(args.out or "bench_out"), "bench_transport_hops")
            bad = sum(r["mismatches"] for r in hops)
            print(f"lossless (greedy): {'every output equals autoregressive' if not bad else f'{bad} MISMATCHES'}")
            if bad:
                return 1
    finally:
        if started:
            ray.shutdown()
    return 0
