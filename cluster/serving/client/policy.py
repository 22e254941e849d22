"""What :class:`cluster.serving.client.sdk.SpecServeClient` asks of gRPC itself: a default deadline, a retry policy
in the channel's service config, and readiness from the standard health service's ``Watch``.

Retries (gRFC A6, "gRPC Retry Design", https://github.com/grpc/proposal/blob/master/A6-client-retries.md): the
channel retries a call that failed with ``UNAVAILABLE`` -- a unit restarting, a target actor down, a replica
not there yet -- up to :data:`MAX_ATTEMPTS` times with exponential backoff, and only while the call is not
*committed*.  gRPC commits a call once the client has received the server's response headers or a message, so
a stream that delivered a token is never re-sent (its tokens would repeat), and a request refused for a reason
that retrying cannot fix (``INVALID_ARGUMENT``, ``RESOURCE_EXHAUSTED``, ``DEADLINE_EXCEEDED``...) fails at
once.  A unary call stays uncommitted until it ends, so the server says when it must not be re-sent: a request
whose replica died after it arrived (it may have generated already) is answered ``UNAVAILABLE`` with a negative
``grpc-retry-pushback-ms`` (``protos/guard.py``), which stops the retries.  The retries stay inside the call's
one deadline.

Readiness: instead of polling ``Check``, :func:`wait_serving` waits for the channel to connect
(``grpc.channel_ready_future``) and then follows ``Watch``, which the server answers with the status now and
again whenever it changes (:meth:`cluster.serving.fronts.app.SpecServeDeployment.Watch`).
"""
from __future__ import annotations

import json
import time

import grpc

SERVICE = "specserve.v1.SpecServe"
HEALTH = "grpc.health.v1.Health"
DEFAULT_TIMEOUT_S = 630.0      # the server's default engine.request_timeout_s (600 s) and a margin for its answer
MAX_ATTEMPTS = 4               # the first try and three retries
RETRY_BACKOFF = {"initialBackoff": "0.2s", "maxBackoff": "5s", "backoffMultiplier": 2}


def service_config() -> str:
    """The channel's service config (gRPC's JSON form): UNAVAILABLE retried on every SpecServe method and on
    health ``Check``; ``Watch`` (a stream that lives as long as the caller wants) is not retried."""
    retry = {"maxAttempts": MAX_ATTEMPTS, **RETRY_BACKOFF, "retryableStatusCodes": ["UNAVAILABLE"]}
    return json.dumps({"methodConfig": [{
        "name": [{"service": SERVICE}, {"service": HEALTH, "method": "Check"}],
        "retryPolicy": retry}]})


def channel_options(retry: bool = True) -> list[tuple[str, object]]:
    """Options for ``grpc.insecure_channel`` / ``grpc.secure_channel`` (``retry=False``: no retries at all)."""
    if not retry:
        return [("grpc.enable_retries", 0)]
    return [("grpc.enable_retries", 1), ("grpc.service_config", service_config())]


def wait_serving(channel: grpc.Channel, metadata, timeout: float, address: str = "") -> None:
    """Return once the server's health is SERVING; raises TimeoutError naming the last status.  A failed
    ``Watch`` (no application deployed yet, a replica restarting) is followed again after a backoff."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    deadline, last, backoff = time.monotonic() + timeout, "no answer", 0.1
    stub = health_pb2_grpc.HealthStub(channel)
    while (left := deadline - time.monotonic()) > 0:
        try:
            grpc.channel_ready_future(channel).result(timeout=left)
            for r in stub.Watch(health_pb2.HealthCheckRequest(service=""), metadata=metadata,
                                timeout=max(0.01, deadline - time.monotonic())):
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
        except grpc.FutureTimeoutError:
            last = "not connected"
            break
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                break                                  # ``last`` keeps the last status Watch reported
            last = f"{e.code().name}: {e.details()}"
        # a retry backoff after an error (not a status poll: statuses arrive through Watch)
        time.sleep(min(backoff, max(0.0, deadline - time.monotonic())))
        backoff = min(2.0, backoff * 2)
    raise TimeoutError(f"{address or 'server'} not SERVING after {timeout:g}s (last: {last})")
