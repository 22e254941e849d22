"""Bounded steady load for the fault tests: N clients, each sending greedy speculative ``Generate`` requests over
its own raw gRPC channel (no retry policy: every failure the server returns is counted), until ``stop``, a
request count or a time limit.  Traffic goes to the one address given (127.0.0.1 in the tests)."""
from __future__ import annotations

import threading
import time

import grpc

from cluster.serving.client.sdk import SpecServeClient
from protos import specserve_pb2_grpc as pbg


class Load:
    def __init__(self, address: str, prompts: list[str], max_new: int, *, clients: int = 4,
                 per_client: int = 1000, seconds: float = 240.0, app: str = "specserve"):
        self.address, self.prompts, self.max_new, self.app = address, prompts, max_new, app
        self.per_client, self.seconds = per_client, seconds
        self.results: list[tuple[float, str, list[int], int]] = []    # (time, prompt, token ids, drafted tokens)
        self.failures: list[tuple[float, str]] = []                   # (time, status code name)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,)) for i in range(clients)]

    def __enter__(self) -> Load:
        self._give_up = time.monotonic() + self.seconds
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)

    def after(self, t0: float, drafted: bool | None = None) -> list[float]:
        """Completion times after ``t0`` (only those that drafted, or did not, when ``drafted`` is given)."""
        return [t for t, _, _, d in self.results if t > t0 and (drafted is None or (d > 0) == drafted)]

    def _client(self, i: int) -> None:
        with grpc.insecure_channel(self.address) as ch:
            stub = pbg.SpecServeStub(ch)
            for n in range(self.per_client):
                if self._stop.is_set() or time.monotonic() > self._give_up:
                    return
                p = self.prompts[(i + n) % len(self.prompts)]
                req = SpecServeClient.request(p, max_new_tokens=self.max_new, temperature=0.0, strategy="speculative")
                try:
                    r = stub.Generate(req, metadata=(("application", self.app),), timeout=60)
                    self.results.append((time.monotonic(), p, list(r.token_ids), r.stats.drafted_tokens))
                except grpc.RpcError as e:
                    self.failures.append((time.monotonic(), e.code().name))
                    self._stop.wait(0.2)               # a client's back-off before its next request
