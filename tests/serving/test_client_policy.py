"""The client's gRPC policy (cluster/serving/client/policy.py) against real gRPC servers on loopback: UNAVAILABLE
is retried only while the call has delivered nothing, other codes never; readiness follows health ``Watch``.
The served cluster's part is in test_client.py."""
from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.serving.client.policy import MAX_ATTEMPTS, channel_options, wait_serving
from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc as pbg


class FlakyServer(pbg.SpecServeServicer):
    """Fails the first ``fail`` calls of each method with ``code`` (a stream after ``chunks_first`` chunks)."""

    def __init__(self, fail: int, code=grpc.StatusCode.UNAVAILABLE, chunks_first: int = 0, trailers=()):
        self.fail, self.code, self.chunks_first, self.calls = fail, code, chunks_first, []
        self.trailers = trailers

    def Generate(self, request, context):
        self.calls.append("Generate")
        if len(self.calls) <= self.fail:
            context.set_trailing_metadata(self.trailers)
            context.abort(self.code, "unit restarting")
        return pb.GenerateResponse(text="ok")

    def GenerateStream(self, request, context):
        self.calls.append("GenerateStream")
        failing = len(self.calls) <= self.fail
        for i in range(self.chunks_first if failing else 2):
            yield pb.GenerateChunk(text=f"t{i}")
        if failing:
            context.abort(self.code, "target down")


@pytest.fixture
def serve():
    servers = []

    def start(*servicers):
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        for s in servicers:
            (pbg.add_SpecServeServicer_to_server if isinstance(s, pbg.SpecServeServicer)
             else health_pb2_grpc.add_HealthServicer_to_server)(s, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return grpc.insecure_channel(f"127.0.0.1:{port}", options=channel_options())
    yield start
    for s in servers:
        s.stop(None)


def test_unavailable_is_retried_until_it_answers(serve):
    srv = FlakyServer(fail=2)
    stub = pbg.SpecServeStub(serve(srv))
    assert stub.Generate(pb.GenerateRequest(prompt="x"), timeout=30).text == "ok"
    assert srv.calls == ["Generate"] * 3


def test_a_stream_that_failed_before_its_first_token_is_retried(serve):
    srv = FlakyServer(fail=1)
    stub = pbg.SpecServeStub(serve(srv))
    assert [c.text for c in stub.GenerateStream(pb.GenerateRequest(prompt="x"), timeout=30)] == ["t0", "t1"]
    assert srv.calls == ["GenerateStream"] * 2


def test_a_stream_that_delivered_a_token_is_never_resent(serve):
    srv = FlakyServer(fail=1, chunks_first=1)
    stub = pbg.SpecServeStub(serve(srv))
    got = []
    with pytest.raises(grpc.RpcError) as e:
        for c in stub.GenerateStream(pb.GenerateRequest(prompt="x"), timeout=30):
            got.append(c.text)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and got == ["t0"] and srv.calls == ["GenerateStream"]


@pytest.mark.parametrize("code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED])
def test_other_codes_are_not_retried(serve, code):
    srv = FlakyServer(fail=1, code=code)
    with pytest.raises(grpc.RpcError) as e:
        pbg.SpecServeStub(serve(srv)).Generate(pb.GenerateRequest(prompt="x"), timeout=30)
    assert e.value.code() == code and srv.calls == ["Generate"]


def test_retries_stop_after_max_attempts(serve):
    srv = FlakyServer(fail=100)
    with pytest.raises(grpc.RpcError) as e:
        pbg.SpecServeStub(serve(srv)).Generate(pb.GenerateRequest(prompt="x"), timeout=60)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and len(srv.calls) == MAX_ATTEMPTS


class GatedHealth(health_pb2_grpc.HealthServicer):
    """Watch: NOT_SERVING, then SERVING once the test opens the gate."""

    def __init__(self):
        self.watching, self.gate = threading.Event(), threading.Event()

    def Watch(self, request, context):
        yield health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.NOT_SERVING)
        self.watching.set()
        if self.gate.wait(30):
            yield health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def test_wait_serving_returns_when_watch_reports_serving(serve):
    health = GatedHealth()
    channel = serve(health)
    done, errors = threading.Event(), []

    def wait():
        try:
            wait_serving(channel, (), timeout=30)
        except Exception as e:          # noqa: BLE001 - reported below
            errors.append(e)
        done.set()
    t = threading.Thread(target=wait)
    t.start()
    assert health.watching.wait(30)           # the client follows Watch and has seen NOT_SERVING ...
    assert not done.is_set()                  # ... and does not return on it
    health.gate.set()
    t.join(30)
    assert done.is_set() and errors == []


def test_wait_serving_times_out_naming_the_last_status(serve):
    health = GatedHealth()                    # never opens: NOT_SERVING for good
    with pytest.raises(TimeoutError, match="NOT_SERVING"):
        wait_serving(serve(health), (), timeout=1.0, address="gated")
    nothing = grpc.insecure_channel("127.0.0.1:1", options=channel_options())     # nothing listens there
    with pytest.raises(TimeoutError, match="not connected"):
        wait_serving(nothing, (), timeout=0.5)


def test_a_replica_lost_answer_is_never_resent(serve):
    """What the proxy guard answers when a request's replica died (UNAVAILABLE with a negative
    grpc-retry-pushback-ms, protos/guard.py): even a unary call, uncommitted until it ends, is not re-sent."""
    from protos.guard import PUSHBACK
    srv = FlakyServer(fail=3, trailers=((PUSHBACK, "-1"),))
    with pytest.raises(grpc.RpcError) as e:
        pbg.SpecServeStub(serve(srv)).Generate(pb.GenerateRequest(prompt="x"), timeout=30)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and srv.calls == ["Generate"]
