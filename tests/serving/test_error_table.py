"""The one error table (cluster/serving/ops/error_table.py): every front answers an error the same way."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from cluster.errors import DeadlineExceededError, ModelUnavailableError, OverloadedError, ParamError
from cluster.serving.ops.auth import Unauthenticated
from cluster.serving.ops.error_table import COUNTED, UnknownModel, classify, message, param_of, refusal_outcome
from cluster.serving.ops.metrics import OUTCOMES


@pytest.mark.parametrize("exc,code,status,kind,outcome,headers", [
    (ParamError("top_p", "(0, 1]", 2), "INVALID_ARGUMENT", 400, "invalid_request_error", "invalid", None),
    (UnknownModel("gpt-4", "specserve"), "NOT_FOUND", 404, "not_found_error", "not_found", None),
    (Unauthenticated(), "UNAUTHENTICATED", 401, "authentication_error", "unauthenticated", None),
    (OverloadedError("full"), "RESOURCE_EXHAUSTED", 429, "server_overloaded", "overloaded", {"Retry-After": "1"}),
    (ModelUnavailableError("target"), "UNAVAILABLE", 503, "service_unavailable", "unavailable",
     {"Retry-After": "1"}),
    (DeadlineExceededError("late"), "DEADLINE_EXCEEDED", 504, "timeout", "deadline", {"x-should-retry": "false"}),
    (asyncio.CancelledError(), "CANCELLED", 499, "cancelled", "cancelled", None),
    (KeyError("secret"), "INTERNAL", 500, "internal_error", "error", {"x-should-retry": "false"}),
])
def test_each_error_has_one_row(exc, code, status, kind, outcome, headers):
    row = classify(exc)
    assert (row.grpc_code, row.http_status, row.openai_type, row.outcome, row.headers) == \
        (code, status, kind, outcome, headers)
    assert grpc.StatusCode[row.grpc_code].name == code and row.outcome in OUTCOMES
    assert refusal_outcome(exc) == outcome
    setattr(exc, COUNTED, True)                      # the coordinator counted it: the fronts do not again
    assert refusal_outcome(exc) is None
    assert ("secret" in message(exc)) is False


def test_param_and_message():
    e = ParamError("max_tokens", "an integer >= 0", -1)
    assert param_of(e) == "max_tokens" and message(e) == str(e) and "-1" in message(e)
    assert param_of(UnknownModel("m", "specserve")) == "model" and param_of(OverloadedError()) is None
