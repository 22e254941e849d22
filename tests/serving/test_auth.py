"""API keys (cluster/serving/ops/auth.py) and the deployment's handlers with auth on, without Ray: the handlers
are called directly on a SpecServeDeployment built with object.__new__ over a fake coordinator."""
from __future__ import annotations

import asyncio
import dataclasses
import json
from types import SimpleNamespace

import grpc
import pytest

from cluster.config.schema import config_from_dict, load_config
from cluster.errors import ConfigError, ModelUnavailableError, OverloadedError
from cluster.serving.fronts import app as app_mod
from cluster.serving.ops.auth import (
    OPERATOR,
    USER,
    Keys,
    bearer_token,
    key_matches,
    load_keys,
    metadata_token,
    read_key,
)
from cluster.serving.client.sdk import SpecServeClient
from protos import specserve_pb2 as pb

API, OP = "user-secret-key", "operator-secret-key"


# -- key loading -----------------------------------------------------------------------------------
def _cluster(**kw):
    return dataclasses.replace(load_config("configs/tiny.yaml").cluster, **kw)


def test_key_from_env():
    keys = load_keys(_cluster(), {"SPECSERVE_API_KEY": f" {API}\n", "SPECSERVE_OPERATOR_KEY": OP})
    assert keys == Keys(API, OP) and keys.enabled
    assert load_keys(_cluster(api_key_env="MY_KEY"), {"MY_KEY": API}) == Keys(API, None)


def test_key_file_wins_over_env(tmp_path):
    f = tmp_path / "key"
    f.write_text(API + "\n")
    assert load_keys(_cluster(api_key_file=str(f)), {"SPECSERVE_API_KEY": "other"}).api_key == API


def test_bad_key_file_fails_closed(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        read_key("SPECSERVE_API_KEY", str(tmp_path / "missing"), {"SPECSERVE_API_KEY": API})
    (tmp_path / "empty").write_text("  \n")
    with pytest.raises(ConfigError, match="empty"):
        read_key("SPECSERVE_API_KEY", str(tmp_path / "empty"), {})


def test_no_key_is_off_with_one_warning(caplog):
    with caplog.at_level("WARNING", logger="specserve.auth"):
        keys = load_keys(_cluster(), {"SPECSERVE_API_KEY": "  ", "SPECSERVE_OPERATOR_KEY": OP})
    assert not keys.enabled and keys.role(None) == OPERATOR       # off: today's behaviour
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "UNAUTHENTICATED" in caplog.text


def test_config_keys_parse_and_validate():
    base = _raw_tiny()
    base["cluster"] = {**base.get("cluster", {}), "api_key_file": "/run/secrets/key", "operator_key_env": "OPS"}
    cl = config_from_dict(base).cluster
    assert (cl.api_key_file, cl.api_key_env, cl.operator_key_env) == ("/run/secrets/key", "SPECSERVE_API_KEY", "OPS")
    with pytest.raises(ConfigError, match="api_key_env"):
        config_from_dict({**base, "cluster": {**base["cluster"], "api_key_env": "no-such name"}})


def _raw_tiny():
    import yaml
    with open("configs/tiny.yaml") as f:
        return yaml.safe_load(f)


def test_constant_time_check_and_token_parsing():
    assert key_matches(API, API) and not key_matches(API[:-1], API) and not key_matches(API, None)
    assert not key_matches("", "") and not key_matches(None, API)
    assert key_matches("ключ", "ключ")                    # non-ASCII keys compare as bytes
    assert bearer_token(f"Bearer {API}") == API and bearer_token(f"bearer  {API} ") == API
    assert bearer_token(f"Basic {API}") is None and bearer_token("Bearer") is None and bearer_token(None) is None
    assert metadata_token([("application", "x"), ("authorization", f"Bearer {API}")]) == API
    assert metadata_token([("application", "x")]) is None
    keys = Keys(API, OP)
    assert (keys.role(API), keys.role(OP), keys.role("nope"), keys.role(None)) == (USER, OPERATOR, None, None)


def test_client_sends_key(monkeypatch):
    monkeypatch.setenv("SPECSERVE_API_KEY", API)
    with SpecServeClient("127.0.0.1:1") as c:
        assert ("authorization", f"Bearer {API}") in c.metadata and ("application", "specserve") in c.metadata
    with SpecServeClient("127.0.0.1:1", api_key="") as c:
        assert all(k != "authorization" for k, _ in c.metadata)


# -- handlers ----------------------------------------------------------------------------------------
class FakeContext:
    def __init__(self, key: str | None = None):
        self.metadata = [("application", "specserve")] + ([("authorization", f"Bearer {key}")] if key else [])
        self.code, self.details = None, None

    def invocation_metadata(self):
        return self.metadata

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        self.details = details


class FakeMetrics:
    def __init__(self):
        self.records = []

    def record(self, strategy, outcome, *a, **kw):
        self.records.append(outcome)


class FakeCoordinator:
    def __init__(self, cfg):
        self.cfg, self.ready, self.metrics = cfg, True, FakeMetrics()
        self.entries = {"target": SimpleNamespace(name="target", role="target", placement="actor",
                                                  handle=SimpleNamespace(vocab_size=256))}
        self.max_batch, self.max_queue, self.topology = 4, 8, "separated"
        self.engine = SimpleNamespace(vocab_size=256)
        self.recent = [("old-request", "greedy", "ok", 3)]
        self.cache_tokens = [40, 16]         # prompt tokens of finished requests, of them from the prefix cache
        self.fail_with = None

    def active_requests(self):
        return {"target": ["live-request"]}

    def cache_info(self):
        return {"target": {"tokens": 32, "slots": 1}}

    def live_requests(self):
        return [SimpleNamespace(rid="live-request", status="running")]

    def prepare(self, req):
        if self.fail_with is not None:
            raise self.fail_with
        return req

    async def generate(self, req):
        if self.fail_with is not None:
            raise self.fail_with
        return "generated"


@pytest.fixture
def dep(monkeypatch):
    cfg = load_config("configs/tiny.yaml")
    d = object.__new__(app_mod.SpecServeDeployment)
    d.cfg, d.keys, d.coord = cfg, Keys(API, OP), FakeCoordinator(cfg)
    monkeypatch.setattr(app_mod, "result_to_proto", lambda r, *_: pb.GenerateResponse(text=r))
    return d


def _run(coro):
    return asyncio.run(coro)


def _stream(d, ctx):
    async def collect():
        return [c async for c in d.GenerateStream(pb.GenerateRequest(prompt="x"), ctx)]
    return _run(collect())


def test_grpc_refused_without_valid_key(dep):
    for ctx in (FakeContext(), FakeContext("wrong"), FakeContext(API[:-1])):
        r = _run(dep.Generate(pb.GenerateRequest(prompt="x"), ctx))
        assert ctx.code == grpc.StatusCode.UNAUTHENTICATED and r == pb.GenerateResponse()
        assert API not in ctx.details and OP not in ctx.details
    ctx = FakeContext()
    assert _stream(dep, ctx) == [pb.GenerateChunk()] and ctx.code == grpc.StatusCode.UNAUTHENTICATED
    ctx = FakeContext("wrong")
    assert _run(dep.ServerInfo(pb.ServerInfoRequest(), ctx)) == pb.ServerInfoResponse()
    assert ctx.code == grpc.StatusCode.UNAUTHENTICATED
    assert dep.coord.metrics.records == ["unauthenticated"] * 5


def test_grpc_accepted_with_key(dep):
    for key in (API, OP):
        ctx = FakeContext(key)
        assert _run(dep.Generate(pb.GenerateRequest(prompt="x"), ctx)).text == "generated" and ctx.code is None


def test_grpc_health_exempt(dep):
    from grpc_health.v1 import health_pb2
    ctx = FakeContext()
    r = _run(dep.Check(health_pb2.HealthCheckRequest(), ctx))
    assert r.status == health_pb2.HealthCheckResponse.SERVING and ctx.code is None

    async def first_watch():
        gen = dep.Watch(health_pb2.HealthCheckRequest(), ctx)
        try:
            return await gen.__anext__()
        finally:
            await gen.aclose()
    assert _run(first_watch()).status == health_pb2.HealthCheckResponse.SERVING


def test_server_info_request_ids_only_for_operator(dep):
    user = _run(dep.ServerInfo(pb.ServerInfoRequest(), FakeContext(API)))
    assert user.ready and user.running == 1 and [m.name for m in user.models] == ["target"]
    assert not user.live_requests and not user.recent and not user.models[0].active_requests
    assert (user.models[0].prefix_cache_tokens, user.models[0].prefix_cache_slots) == (32, 1)   # no request ids
    op = _run(dep.ServerInfo(pb.ServerInfoRequest(), FakeContext(OP)))
    assert list(op.live_requests) == ["live-request"] and [r.request_id for r in op.recent] == ["old-request"]
    assert list(op.models[0].active_requests) == ["live-request"]
    dep.keys = Keys()                                  # auth off: everyone sees them (documented)
    assert list(_run(dep.ServerInfo(pb.ServerInfoRequest(), FakeContext())).live_requests) == ["live-request"]


def _http(dep, path, *, key=None, method="GET", body=b""):
    """One request through the replica's FastAPI app (cluster/serving/fronts/http_app.py), in-process."""
    from cluster.serving.fronts.http_app import build_http_app
    from tests.support.asgi import call
    return call(build_http_app(dep), method, path, body=body,
                headers={"authorization": f"Bearer {key}"} if key else None)


_COMPLETION = json.dumps({"prompt": "def", "max_tokens": 4}).encode()


def test_http_401_without_key_health_exempt(dep):
    for key in (None, "wrong"):
        for path, method in (("/v1/models", "GET"), ("/v1/completions", "POST"), ("/nope", "GET")):
            r = _http(dep, path, key=key, method=method, body=_COMPLETION)
            assert r.status == 401 and r.headers["www-authenticate"] == "Bearer"
            assert API.encode() not in r.body and b"API key" in r.body
    assert set(dep.coord.metrics.records) == {"unauthenticated"}
    assert _http(dep, "/health").status == 200
    assert _http(dep, "/v1/models", key=API).status == 200


def test_http_retry_after_on_429_and_503(dep):
    dep.coord.fail_with = OverloadedError("queue full")
    r = _http(dep, "/v1/completions", key=API, method="POST", body=_COMPLETION)
    assert r.status == 429 and r.headers["retry-after"] == "1"
    dep.coord.fail_with = ModelUnavailableError("target")
    r = _http(dep, "/v1/completions", key=API, method="POST", body=_COMPLETION)
    assert r.status == 503 and r.headers["retry-after"] == "1"
    dep.coord.ready = False
    r = _http(dep, "/health")
    assert r.status == 503 and r.headers["retry-after"] == "1"
