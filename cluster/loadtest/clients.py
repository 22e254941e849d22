"""One request over gRPC or HTTP, timed chunk by chunk: the calls the load generator makes.

A request is a completion of the prompt (``endpoint: completions``) or a chat of one user message with it
(``endpoint: chat``: ``/v1/chat/completions``, gRPC ``messages``).  With ``openai: true`` an HTTP request carries
plain OpenAI fields only (``model``, ``max_tokens``, sampling, ``seed``, ``stream_options.include_usage``; vLLM's
``ignore_eos`` only when asked), so the same load can be sent to any OpenAI-compatible server (vLLM, SGLang, ...)
and to specserve for an A/B comparison; token counts then come from ``usage.completion_tokens`` (no token ids:
no greedy check).

Plain blocking code: the locust worker runs it under gevent (``grpc.experimental.gevent.init_gevent()``
first, sockets monkey-patched), the parent process runs it as is for the preflight and the greedy
references.  A call never raises for a server's answer: it returns an :class:`Outcome` whose ``status``
is ``OK``, a gRPC status name (``RESOURCE_EXHAUSTED``), an HTTP code (``429``) or a client-side failure
(``TIMEOUT``, ``CONNECTION_ERROR``, ``INCOMPLETE_STREAM``).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

import grpc
import requests

from cluster.loadtest.spec import RequestSpec
from cluster.serving.client.sdk import API_KEY_ENV, SpecServeClient

ERROR_CHARS = 200


@dataclass(frozen=True)
class Target:
    """Where the load goes: a gRPC ``host:port`` and/or an HTTP base URL, and the Serve application
    (sent as the gRPC ``application`` metadata that Serve routes by)."""

    grpc: str | None = "127.0.0.1:9000"
    http: str | None = "http://127.0.0.1:8000"
    app: str = "specserve"

    def to_dict(self) -> dict:
        return {"grpc": self.grpc, "http": self.http, "app": self.app}


@dataclass
class Outcome:
    """``chunks``: seconds from the send to each chunk that carried output; ``e2e``: to the end."""

    status: str = "OK"
    e2e: float = 0.0
    chunks: list[float] = field(default_factory=list)
    out_tokens: int = 0
    token_ids: list[int] | None = None
    error: str = ""
    retry_after: str | None = None


def api_key() -> str:
    return os.environ.get(API_KEY_ENV, "").strip()


class Caller:
    """Sends requests of one :class:`RequestSpec` to a :class:`Target` (one channel / session, shared)."""

    def __init__(self, target: Target, req: RequestSpec, pool: int = 64):
        self.req, self.target = req, target
        if req.protocol == "grpc":
            if not target.grpc:
                raise ValueError("a gRPC stage needs a gRPC address")
            self.client = SpecServeClient(target.grpc, app=target.app, timeout=req.timeout_s, api_key=api_key())
        else:
            if not target.http:
                raise ValueError("an HTTP stage needs an HTTP URL")
            self.session = requests.Session()
            adapter = requests.adapters.HTTPAdapter(pool_connections=1, pool_maxsize=max(pool, 1))
            self.session.mount("http://", adapter)
            self.session.mount("https://", adapter)
            base = target.http.rstrip("/")            # OpenAI base URLs end with /v1; specserve's is the server's
            base = base if base.endswith("/v1") else base + "/v1"
            self.url = base + ("/chat/completions" if req.endpoint == "chat" else "/completions")
            key = api_key()
            self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    def call(self, prompt: str, seq: int = 0, *, max_new_tokens: int | None = None, strategy: str | None = None,
             temperature: float | None = None) -> Outcome:
        r = self.req
        kw = dict(max_new_tokens=max_new_tokens or r.max_new_tokens, temperature=r.temperature if temperature is None
                  else temperature, top_p=r.top_p, strategy=strategy or r.strategy, options=r.options,
                  ignore_eos=r.ignore_eos, seed=None if r.seed is None else r.seed + seq)
        t0 = time.monotonic()
        out = Outcome()
        try:
            if r.protocol == "grpc":
                self._grpc(prompt, kw, out, t0)
            else:
                self._http(prompt, kw, out, t0)
        except grpc.RpcError as e:
            out.status, out.error = e.code().name, (e.details() or "")[:ERROR_CHARS]
        except requests.exceptions.Timeout as e:
            out.status, out.error = "TIMEOUT", str(e)[:ERROR_CHARS]
        except requests.exceptions.RequestException as e:
            out.status, out.error = "CONNECTION_ERROR", str(e)[:ERROR_CHARS]
        out.e2e = round(time.monotonic() - t0, 6)
        return out

    def _grpc(self, prompt: str, kw: dict, out: Outcome, t0: float) -> None:
        if self.req.endpoint == "chat":
            prompt, kw = None, {**kw, "messages": [{"role": "user", "content": prompt}]}
        if not self.req.stream:
            res = self.client.generate(prompt, **kw)
            out.token_ids = list(res.token_ids)
            out.out_tokens = len(out.token_ids)
            return
        result = None
        for chunk in self.client.stream(prompt, **kw):
            if chunk.token_ids:
                out.chunks.append(round(time.monotonic() - t0, 6))
            if chunk.HasField("result"):
                result = chunk.result
        if result is None:
            out.status, out.error = "INCOMPLETE_STREAM", "the stream ended without its final chunk"
            return
        out.token_ids = list(result.token_ids)
        out.out_tokens = len(out.token_ids)

    def _body(self, prompt: str, kw: dict) -> dict:
        """The JSON body: OpenAI's fields, then ours unless ``openai`` (a request of plain OpenAI fields)."""
        r = self.req
        body = {"messages": [{"role": "user", "content": prompt}]} if r.endpoint == "chat" else {"prompt": prompt}
        body.update(max_tokens=kw["max_new_tokens"], stream=r.stream)
        if r.model is not None:
            body["model"] = r.model
        for name in ("temperature", "top_p", "seed"):
            if kw[name] is not None:
                body[name] = kw[name]
        if r.openai:
            if r.stream:
                body["stream_options"] = {"include_usage": True}     # the token count of a stream
            if kw["ignore_eos"]:
                body["ignore_eos"] = True                            # vLLM's and ours; only when asked
            return body
        body["ignore_eos"] = kw["ignore_eos"]
        if kw["strategy"] is not None:
            body["strategy"] = kw["strategy"]
        if kw["options"]:
            body["options"] = kw["options"]
        return body

    def _http(self, prompt: str, kw: dict, out: Outcome, t0: float) -> None:
        body = self._body(prompt, kw)
        timeout = self.req.timeout_s
        with self.session.post(self.url, json=body, headers=self.headers, stream=self.req.stream,
                               timeout=(min(timeout, 10.0), timeout)) as resp:
            if resp.status_code != 200:
                out.status, out.retry_after = str(resp.status_code), resp.headers.get("Retry-After")
                out.error = _error_message(resp.text)
                return
            if not self.req.stream:
                _read_counts(resp.json(), out)
                return
            done = False
            for line in resp.iter_lines():
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                payload = json.loads(data)
                choice = (payload.get("choices") or [{}])[0]
                if choice.get("text") or (choice.get("delta") or {}).get("content"):
                    out.chunks.append(round(time.monotonic() - t0, 6))
                _read_counts(payload, out)
            if not done or (out.token_ids is None and not self.req.openai):
                out.status, out.error = "INCOMPLETE_STREAM", "the event stream ended without its result / [DONE]"
            elif self.req.openai and not out.out_tokens:              # no usage sent: count the content chunks
                out.out_tokens = len(out.chunks)

    def close(self) -> None:
        if self.req.protocol == "grpc":
            self.client.close()
        else:
            self.session.close()


def _read_counts(payload: dict, out: Outcome) -> None:
    """Token ids from our ``specserve`` field, else the count from OpenAI's ``usage`` (any server)."""
    if "specserve" in payload:
        out.token_ids = list(payload["specserve"].get("token_ids") or [])
        out.out_tokens = len(out.token_ids)
    elif isinstance(payload.get("usage"), dict) and isinstance(payload["usage"].get("completion_tokens"), int):
        out.out_tokens = payload["usage"]["completion_tokens"]


def _error_message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])[:ERROR_CHARS]
    except (ValueError, KeyError, TypeError):
        return text[:ERROR_CHARS]
