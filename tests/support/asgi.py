"""Drive an ASGI app in-process (no server, no HTTP client library): one request, the whole response."""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body)

    def events(self) -> list[str]:
        """The ``data:`` payloads of a server-sent-event stream."""
        return [line[len("data: "):] for line in self.body.decode().split("\n") if line.startswith("data: ")]

    def sse_chunks(self) -> list[dict]:
        """The JSON chunks of a successful server-sent-event stream (checked: 200, event-stream, ``[DONE]`` last)."""
        assert self.status == 200 and self.headers["content-type"].startswith("text/event-stream"), self.status
        events = self.events()
        assert events[-1] == "[DONE]", events[-1:]
        return [json.loads(e) for e in events[:-1]]


async def acall(app, method: str, path: str, *, body: bytes = b"", headers: dict | None = None) -> Reply:
    hdrs = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "", "scheme": "http",
             "server": ("test", 80), "client": ("127.0.0.1", 50000), "headers": hdrs}
    delivered = asyncio.Event()
    messages: list[dict] = []

    async def receive():
        if not delivered.is_set():
            delivered.set()
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()                   # the client stays connected until the app is done

    async def send(message):
        messages.append(message)

    await app(scope, receive, send)
    start = next(m for m in messages if m["type"] == "http.response.start")
    return Reply(start["status"], {k.decode().lower(): v.decode() for k, v in start.get("headers", [])},
                 b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body"))


def call(app, method: str, path: str, **kw) -> Reply:
    return asyncio.run(acall(app, method, path, **kw))
