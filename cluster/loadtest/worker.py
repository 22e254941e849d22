"""The load generator: locust, headless, as a library, in a process of its own.

    python -m gevent.monkey --module cluster.loadtest.worker JOB.json

``gevent.monkey`` patches the standard library before anything else is imported, then this module calls
``grpc.experimental.gevent.init_gevent()`` before any channel exists (as locust's gRPC example does), so
gRPC and HTTP calls yield to other greenlets.  :mod:`cluster.loadtest.run` starts it; nothing else may
import it (locust monkey-patches the process it is imported in: never a process that runs Ray or pytest).

Per stage a locust :class:`Environment` and local runner drive the users:

* ``concurrency`` c: c ``ClosedUser`` s, each sending its next request as soon as the last one ended;
* ``rate`` r: one ``ArrivalUser`` that draws Poisson arrivals (exponential gaps of mean 1/r, on an absolute
  schedule so lateness does not accumulate) and spawns each request in its own greenlet, open loop: a
  slow server does not slow the arrivals.  At most ``max_in_flight`` requests are outstanding; an arrival
  past that waits (counted as ``delayed``), so the offered rate drops visibly instead of the client
  growing without bound.

A stage stops sending at its duration or ``max_requests`` and then waits for what is still out (each
request has its own deadline).  Every finished request is one JSON line on the record stream (the
original stdout; everything else printed goes to stderr), fired as a locust ``request`` event too; the
stage's locust totals go out with its end so the parent can check both counts agree.
"""
from __future__ import annotations

import json
import logging
import os
import random
import sys
import time
from pathlib import Path

import gevent
import grpc.experimental.gevent as grpc_gevent
from gevent.event import Event
from gevent.lock import BoundedSemaphore
from gevent.pool import Group
from locust import User, constant, task
from locust.env import Environment
from locust.exception import StopUser

from cluster.loadtest.clients import Caller, Outcome, Target
from cluster.loadtest.spec import RequestSpec

TICK_S = 0.5
BACK_OFF = {"RESOURCE_EXHAUSTED", "UNAVAILABLE", "429", "503"}
ABORTED = "CLIENT_ABORTED"          # still running when the stage's hard bound passed (should not happen)


def _seconds(retry_after: str | None) -> float:
    """A Retry-After header's delay in seconds (1 when absent, as for gRPC, or not a number; at most 60)."""
    try:
        return min(60.0, max(0.0, float(retry_after)))
    except (TypeError, ValueError):
        return 1.0


class Plan:
    """One stage's schedule and bookkeeping, shared by its users (greenlets of one thread)."""

    def __init__(self, index: int, stage: dict, job: dict, emit):
        self.index, self.stage, self.emit = index, stage, emit
        self.req = RequestSpec(**stage["request"])
        self.prompts = job["prompts"]
        self.keep_tokens = job.get("keep_tokens", False)
        # seeded by the stage's shape, not its position: two stages alike send the same traffic (A/B runs)
        key = f'{job["spec"]["seed"]}:{stage["mode"]}:{stage["value"]}:{stage["duration_s"]}'
        self.arrivals, self.choice = random.Random(key + ":arrivals"), random.Random(key + ":prompts")
        self.closed = stage["mode"] == "concurrency"
        self.backoff = job["spec"].get("retry_after", True)
        cap = job["spec"]["max_in_flight"]
        self.caller = Caller(Target(**job["target"]), self.req, pool=int(stage["value"]) if self.closed else cap)
        self.sem = None if self.closed else BoundedSemaphore(cap)
        self.pool = Group()
        self.issued = self.in_flight = self.delayed = 0
        self.outstanding: dict[int, tuple[float, int]] = {}
        self.sending_over = False
        self.done = Event()
        self.events = None

    def start(self, events) -> float:
        self.events = events
        self.t0 = self.next_t = time.monotonic()
        self.deadline = self.t0 + self.stage["duration_s"]
        return self.t0

    def stop_sending(self) -> None:
        """No new requests (time is up, or the count); done once the last one out has ended."""
        self.sending_over = True
        if self.in_flight == 0:
            self.done.set()

    def _issue(self) -> int | None:
        cap = self.stage["max_requests"]
        if self.sending_over or time.monotonic() >= self.deadline or (cap is not None and self.issued >= cap):
            self.stop_sending()
            return None
        seq = self.issued
        self.issued += 1
        self.in_flight += 1
        self.outstanding[seq] = (time.monotonic(), self.choice.randrange(len(self.prompts)))
        return seq

    def take(self) -> int | None:
        """Closed loop: the next request's sequence number, or None once the stage stops sending."""
        return self._issue()

    def next_arrival(self) -> int | None:
        """Open loop: sleep until the next Poisson arrival; its sequence number, or None at the end."""
        self.next_t += self.arrivals.expovariate(self.stage["value"])
        if self.next_t >= self.deadline:
            self.stop_sending()
            return None
        gevent.sleep(max(0.0, self.next_t - time.monotonic()))
        if self.sem.locked():
            self.delayed += 1
        self.sem.acquire()
        seq = self._issue()
        if seq is None:
            self.sem.release()
        return seq

    def fire(self, seq: int) -> Outcome:
        start, prompt = self.outstanding[seq]
        try:
            out = self.caller.call(self.prompts[prompt], seq)
        except Exception as e:                  # noqa: BLE001 - a client-side bug must not lose the request
            out = Outcome(status="CLIENT_ERROR", e2e=time.monotonic() - start, error=repr(e)[:200])
        del self.outstanding[seq]
        self.in_flight -= 1
        if self.sem is not None:
            self.sem.release()
        self.record(seq, start, prompt, out.status, out.e2e, out.chunks, out.out_tokens, out.error,
                    out.retry_after, out.token_ids)
        if self.sending_over and self.in_flight == 0:
            self.done.set()
        return out

    def record(self, seq, start, prompt, status, e2e, chunks=(), out=0, error="", retry_after=None,
               token_ids=None) -> None:
        r = self.req
        self.emit({"t": "req", "stage": self.index, "seq": seq, "prompt": prompt, "protocol": r.protocol,
                   "start": start, "e2e": e2e, "chunks": list(chunks), "out": out, "status": status,
                   "error": error, "retry_after": retry_after, "max_new_tokens": r.max_new_tokens,
                   "ignore_eos": r.ignore_eos, "greedy": r.greedy,
                   "token_ids": token_ids if self.keep_tokens else None})
        self.events.request.fire(request_type=r.protocol, name=f"stage {self.index}", response_time=e2e * 1000.0,
                                 response_length=out, response=None, context={},
                                 exception=None if status == "OK" else RuntimeError(f"{status}: {error}"))


class StageEnvironment(Environment):
    """A locust environment that carries the stage's :class:`Plan` to its users."""

    def __init__(self, plan: Plan, **kw):
        super().__init__(**kw)
        self.plan = plan


class ClosedUser(User):
    """One closed-loop client: a request, then the next, until the stage stops sending."""

    wait_time = constant(0)

    @task
    def request(self):
        plan = self.environment.plan
        seq = plan.take()
        if seq is None:
            raise StopUser()
        out = plan.fire(seq)
        if plan.backoff and out.status in BACK_OFF:         # a polite client waits as it is asked to
            gevent.sleep(_seconds(out.retry_after))


class ArrivalUser(User):
    """The open-loop arrival process: spawns every request in a greenlet of its own."""

    wait_time = constant(0)

    @task
    def arrivals(self):
        plan = self.environment.plan
        while (seq := plan.next_arrival()) is not None:
            plan.pool.spawn(plan.fire, seq)
        raise StopUser()


def run_stage(index: int, stage: dict, job: dict, emit) -> None:
    plan = Plan(index, stage, job, emit)
    users = int(stage["value"]) if plan.closed else 1
    env = StageEnvironment(plan, user_classes=[ClosedUser if plan.closed else ArrivalUser])
    runner = env.create_local_runner()
    emit({"t": "stage", "stage": index, "start": plan.start(env.events)})
    runner.start(users, spawn_rate=users * 1000.0)      # all at once: the stage's load starts at its start

    def tick():
        while True:
            emit({"t": "tick", "stage": index, "sent": plan.issued, "in_flight": plan.in_flight})
            gevent.sleep(TICK_S)

    ticker = gevent.spawn(tick)
    plan.done.wait(timeout=stage["duration_s"])           # earlier only at max_requests
    plan.stop_sending()
    plan.done.wait(timeout=plan.req.timeout_s + 5.0)      # what is still out has its own deadline
    ticker.kill()
    runner.quit()
    plan.pool.kill()
    for seq, (start, prompt) in sorted(plan.outstanding.items()):
        plan.record(seq, start, prompt, ABORTED, time.monotonic() - start, error="past the stage's time bound")
    total = env.stats.total
    emit({"t": "stage_end", "stage": index, "end": time.monotonic(), "sent": plan.issued, "delayed": plan.delayed,
          "locust": {"requests": total.num_requests, "failures": total.num_failures}})
    plan.caller.close()


def main(argv: list[str]) -> int:
    grpc_gevent.init_gevent()                  # before any channel is made
    job = json.loads(Path(argv[0]).read_text())
    stream = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)                              # stray prints go to stderr, the records stay clean
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("locust").setLevel(logging.ERROR)       # e.g. its spawn-rate warning

    def emit(obj: dict) -> None:
        stream.write(json.dumps(obj) + "\n")

    for i, stage in enumerate(job["spec"]["stages"]):
        run_stage(i, stage, job, emit)
    emit({"t": "done"})
    stream.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
