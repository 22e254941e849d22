"""A small gRPC client for the cluster (``specserve client`` uses it; programs can too).

    from cluster.serving.client.sdk import SpecServeClient
    with SpecServeClient("127.0.0.1:9000") as c:
        c.wait_ready()
        r = c.generate("def fib(n):", max_new_tokens=32, strategy="speculative", options={"k": 4})
        print(r.text, r.stats.tokens_per_s)
        chat = c.generate(messages=[{"role": "user", "content": "a fib function"}], logprobs=2)
        print(chat.text, [(t.token_id, t.logprob) for t in chat.logprobs])
        for chunk in c.stream("import os", max_new_tokens=16):
            print(chunk.text, end="", flush=True)

A stream whose serving unit is lost after it delivered tokens (``UNAVAILABLE``: a replica's node gone, a unit
drained) is resumed on another unit from the tokens it delivered (``resume_token_ids``, same seed): the chunks
go on exactly as the uninterrupted stream's would have, every token once, in order, at most ``resume`` times per
request and within its one deadline.  A unary request is sent again whole, with the same seed: the same answer.
A request without a seed gets one here, so either is exact for sampled requests too.
"""
from __future__ import annotations

import json
import os
import random
import sys
import time
from typing import Iterator

import grpc

from cluster.errors import ParamError
from cluster.serving.client.policy import DEFAULT_TIMEOUT_S, channel_options, wait_serving
from protos import specserve_pb2 as pb
from protos import specserve_pb2_grpc as pbg

API_KEY_ENV, OPERATOR_KEY_ENV = "SPECSERVE_API_KEY", "SPECSERVE_OPERATOR_KEY"
# a lost unit's requests wait for another (its replacement starting) with these pauses between tries that were
# refused before any token, at most MAX_IDLE_TRIES tries in a row (about half a minute, on top of the channel's
# own retries), and never past the request's deadline
BACKOFF_S = (0.5, 1.0, 2.0, 4.0)
MAX_IDLE_TRIES = 10


def _credentials(ca: str | None) -> grpc.ChannelCredentials:
    if ca is None:
        return grpc.ssl_channel_credentials()
    try:
        with open(ca, "rb") as f:
            return grpc.ssl_channel_credentials(root_certificates=f.read())
    except OSError as e:
        raise ParamError("ca", "a readable PEM file of CA certificates", ca) from e


class SpecServeClient:
    """``api_key``: sent as ``authorization: Bearer <key>`` metadata; None (default) reads $SPECSERVE_API_KEY,
    "" sends none.  ``tls``: connect over TLS (``specserve up --tls-cert``), trusting the PEM certificates in
    ``ca`` (e.g. the server's self-signed certificate), or the system's roots without it."""

    def __init__(self, address: str = "127.0.0.1:9000", *, app: str | None = "specserve",
                 timeout: float | None = DEFAULT_TIMEOUT_S, api_key: str | None = None, tls: bool = False,
                 ca: str | None = None, retry: bool = True, resume: int = 3):
        self.address, self.timeout, self.resume = address, timeout, resume
        self.options = channel_options(retry)     # UNAVAILABLE retried while uncommitted (client_policy)
        if ca is not None and not tls:
            raise ParamError("ca", "only with tls=True (--tls)", ca)
        self.channel = grpc.secure_channel(address, _credentials(ca), options=self.options) if tls else \
            grpc.insecure_channel(address, options=self.options)
        self.stub = pbg.SpecServeStub(self.channel)
        if api_key is None:
            api_key = os.environ.get(API_KEY_ENV, "").strip()
        self.metadata = ((("application", app),) if app else ()) + \
            ((("authorization", f"Bearer {api_key}"),) if api_key else ())

    # -- requests ---------------------------------------------------------------------------------
    @staticmethod
    def request(prompt: str | None = None, *, prompt_ids=None, max_new_tokens: int | None = None,
                temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                seed: int | None = None, stop=(), strategy: str | None = None, options: dict | None = None,
                ignore_eos: bool = False, request_id: str | None = None, messages=None,
                logprobs: int | None = None, prompt_logprobs: int | None = None, prediction: str | None = None,
                chat_template_kwargs: dict | None = None, tools=None, tool_choice: str = "",
                parallel_tool_calls: bool | None = None, response_format=None,
                cache_salt: str | None = None, resume_token_ids=None) -> pb.GenerateRequest:
        """A GenerateRequest; ``None`` leaves a field unset (the server's config default).  ``messages``: a
        chat, ``[{"role": ..., "content": ...}]`` (``tool_calls``: ``[{"id", "name", "arguments"}]``), rendered
        with the served model's chat template (with the extra variables ``chat_template_kwargs``); ``tools`` /
        ``response_format``: OpenAI's list / object; ``prediction``: the output text expected (predicted outputs);
        ``cache_salt``: what is cached for it is shared only with requests of the same salt."""
        m = pb.GenerateRequest(prompt=prompt or "", prompt_ids=list(prompt_ids or []), stop=list(stop),
                               strategy=strategy or "", options={k: str(v) for k, v in (options or {}).items()},
                               ignore_eos=ignore_eos, request_id=request_id or "",
                               messages=[pb.ChatMessage(**x) for x in messages or ()],
                               chat_template_kwargs=json.dumps(chat_template_kwargs) if chat_template_kwargs else "",
                               tools_json=json.dumps(tools) if tools else "", tool_choice=tool_choice,
                               response_format_json=json.dumps(response_format) if response_format else "",
                               resume_token_ids=list(resume_token_ids or []))
        if parallel_tool_calls is not None:
            m.parallel_tool_calls = parallel_tool_calls
        for name, value in (("max_new_tokens", max_new_tokens), ("temperature", temperature),
                            ("top_p", top_p), ("top_k", top_k), ("seed", seed), ("logprobs", logprobs),
                            ("prompt_logprobs", prompt_logprobs), ("prediction", prediction),
                            ("cache_salt", cache_salt)):
            if value is not None:
                setattr(m, name, value)
        return m

    def _seeded(self, prompt, kw) -> pb.GenerateRequest:
        m = self.request(prompt, **kw)
        if not m.HasField("seed"):              # the server's seed would be lost with the unit: choose it here
            m.seed = random.getrandbits(63)
        return m

    def generate(self, prompt: str | None = None, **kw) -> pb.GenerateResponse:
        """One request; sent again whole (same seed: the same answer) when its unit is lost while it runs."""
        m, end = self._seeded(prompt, kw), _deadline(self.timeout)
        attempt = 0
        while True:
            try:
                return self.stub.Generate(m, metadata=self.metadata, timeout=_left(end))
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or not self.resume or not _pause(attempt, end):
                    raise
                attempt += 1

    def stream(self, prompt: str | None = None, **kw) -> "ResumingStream":
        """Chunks as they are produced, resumed where a lost unit broke them (module docstring); call
        ``.cancel()`` on the returned iterator to stop early."""
        return ResumingStream(self, self._seeded(prompt, kw))

    def server_info(self) -> pb.ServerInfoResponse:
        return self.stub.ServerInfo(pb.ServerInfoRequest(), metadata=self.metadata, timeout=self.timeout)

    def health(self, service: str = "") -> str:
        """``SERVING`` / ``NOT_SERVING`` from the standard gRPC health service."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        stub = health_pb2_grpc.HealthStub(self.channel)
        r = stub.Check(health_pb2.HealthCheckRequest(service=service), metadata=self.metadata,
                       timeout=min(self.timeout or 10.0, 10.0))     # a health check answers at once
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Return once health is SERVING: the channel connects, then health ``Watch`` reports the status as it
        changes (no polling); raises TimeoutError with the last status."""
        wait_serving(self.channel, self.metadata, timeout, self.address)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class ResumingStream:
    """The chunks of one GenerateStream.  On ``UNAVAILABLE`` the request is sent again with the tokens delivered so
    far as ``resume_token_ids`` (none yet: as it was): at most ``client.resume`` times after a try that delivered
    tokens; a try refused before any token (no unit up yet: the lost one's replacement starting) is repeated with
    backoff until the request's deadline."""

    def __init__(self, client: SpecServeClient, m: pb.GenerateRequest):
        self.client, self.m, self.end = client, m, _deadline(client.timeout)
        self.ids: list[int] = list(m.resume_token_ids)
        self.resumed = 0                         # times the stream was resumed after delivering tokens
        self._call, self._since = self._start(), len(self.ids)

    def _start(self):
        m = pb.GenerateRequest()
        m.CopyFrom(self.m)
        m.resume_token_ids[:] = self.ids
        return self.client.stub.GenerateStream(m, metadata=self.client.metadata, timeout=_left(self.end))

    def __iter__(self):
        return self

    def __next__(self) -> pb.GenerateChunk:
        idle = 0                                 # tries in a row that delivered nothing
        while True:
            try:
                chunk = next(self._call)
            except grpc.RpcError as e:
                progressed = len(self.ids) > self._since
                if e.code() != grpc.StatusCode.UNAVAILABLE or self.client.resume == 0 or \
                        (progressed and self.resumed >= self.client.resume):
                    raise
                if progressed:
                    self.resumed += 1
                elif _pause(idle, self.end):     # waited for a unit, within the deadline
                    idle += 1
                else:
                    raise
                self._call, self._since = self._start(), len(self.ids)
                continue
            self.ids.extend(chunk.token_ids)
            return chunk

    def cancel(self) -> None:
        self._call.cancel()


def _pause(tries: int, end: float | None) -> bool:
    """After ``tries`` + 1 tries in a row refused before any token: wait the backoff and say to try again, or False
    when that would be the MAX_IDLE_TRIES-th try or pass the deadline ``end``."""
    wait = BACKOFF_S[min(tries, len(BACKOFF_S) - 1)]
    if tries + 1 >= MAX_IDLE_TRIES or (end is not None and time.monotonic() + wait >= end):
        return False
    time.sleep(wait)
    return True


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _left(end: float | None) -> float | None:
    """Seconds left before ``end`` (every try of a request within its one deadline)."""
    return None if end is None else max(0.001, end - time.monotonic())


def main_client(args) -> int:
    """``specserve client``: one request (or --info / --health) against a running cluster."""

    from google.protobuf.json_format import MessageToDict
    # --info with $SPECSERVE_OPERATOR_KEY set: the operator key (it also lists other clients' request ids)
    key = (os.environ.get(OPERATOR_KEY_ENV, "").strip() or None) if args.info else None
    timeout = float(args.timeout) if args.timeout else DEFAULT_TIMEOUT_S
    c = SpecServeClient(args.address, app=args.app, timeout=timeout,
                        tls=args.tls, ca=args.ca,
                        api_key=key)
    try:
        if args.health:
            print(c.health())
            return 0
        if args.info:
            print(json.dumps(MessageToDict(c.server_info()), indent=2))
            return 0
        opts = dict(kv.split("=", 1) for kv in args.option)
        kw = dict(max_new_tokens=_opt(args.max_new_tokens, int), temperature=_opt(args.temperature, float),
                  top_p=_opt(args.top_p, float), top_k=_opt(args.top_k, int), seed=_opt(args.seed, int),
                  stop=args.stop, strategy=args.strategy, options=opts, logprobs=_opt(args.logprobs, int),
                  messages=[{"role": "user", "content": args.chat}] if args.chat is not None else None)
        prompt = None if args.chat is not None else args.prompt
        if args.stream:
            last = None
            for chunk in c.stream(prompt, **kw):
                print(chunk.text, end="", flush=True)
                last = chunk
            print()
            r = last.result
        else:
            r = c.generate(prompt, **kw)
            if not args.json:
                print(r.text if prompt is None else prompt + r.text)
        if args.json:
            print(json.dumps(MessageToDict(r), indent=2))
        else:
            s = r.stats
            print(f"[{s.strategy}] {s.generated_tokens} tokens, {s.tokens_per_s:.1f} tok/s, target calls "
                  f"{s.target_forwards}, accepted/step {s.mean_accepted:.2f}, finish {r.finish_reason}",
                  file=sys.stderr)
        return 0
    except grpc.RpcError as e:
        print(f"specserve: {e.code().name}: {e.details()}", file=sys.stderr)
        return 2 if e.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
    finally:
        c.close()


def _opt(value, kind):
    """CLI strings to typed values; the server range-checks them (bad types fail here, naming the flag)."""
    if value is None:
        return None
    try:
        return kind(value)
    except ValueError:
        raise ParamError("value", kind.__name__, value) from None
