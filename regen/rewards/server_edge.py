"""The reward service's edge: what a request meets before the application sees it.

In order: the method and path (only the service's own routes; 404 / 405 at once, no byte of a
body read), the bearer token for everything under /v1/ (401 from the headers alone), and then,
only for an authenticated POST to a scoring path, the body: up to its cap (413, declared or
streamed) and within its deadline (408 and the connection closed: a body must be whole within
body_timeout_s and arrive at min_body_rate bytes/s or faster after a grace of BODY_GRACE_S). A
connection that does not send its request headers within header_timeout_s is closed (uvicorn's
h11 protocol, below), and uvicorn refuses connections past max_connections (503). Memory held
by request bodies is therefore at most max_connections x max_body_bytes."""

from __future__ import annotations

import asyncio
import hmac

from fastapi.responses import JSONResponse

BODY_GRACE_S = 5.0  # a body's first seconds are not rate-checked (a connection's slow start)
# the service's routes and their methods; a request for anything else is answered from its headers
ROUTES = {"/healthz": "GET", "/v1/info": "GET", "/v1/score": "POST", "/openapi.json": "GET", "/docs": "GET",
          "/docs/oauth2-redirect": "GET", "/redoc": "GET"}


class Guard:
    """ASGI middleware, outermost: the application only ever sees a request for one of its routes,
    authenticated where it must be, with its body (if any) read in full, bounded in size and time."""

    def __init__(self, app, limit: int, token: bytes | None, body_timeout_s: float, min_body_rate: float):
        self.app, self.limit, self.token = app, limit, token
        self.body_timeout_s, self.min_body_rate = body_timeout_s, min_body_rate

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, method = scope["path"], scope["method"]
        allowed = ROUTES.get(path)
        if allowed is None:
            return await _reply(send, 404, "not found")
        if method != allowed and not (allowed == "GET" and method == "HEAD"):
            return await _reply(send, 405, f"{path} takes {allowed} only", {"Allow": allowed})
        headers = dict(scope.get("headers", []))
        if self.token is not None and path.startswith("/v1/"):
            scheme, _, given = headers.get(b"authorization", b"").partition(b" ")
            if not (scheme.lower() == b"bearer" and hmac.compare_digest(given, self.token)):
                return await _reply(send, 401, "missing or invalid bearer token", {"WWW-Authenticate": "Bearer"})
        if method != "POST":  # no route of ours reads a GET's body: never buffer one
            return await self.app(scope, _replay(receive, b""), send)
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await _reply(send, 413, f"request body exceeds {self.limit} bytes (--max-body-mb)")
        body = await self._read_body(receive, send)
        if body is not None:
            await self.app(scope, _replay(receive, body), send)

    async def _read_body(self, receive, send) -> bytes | None:
        """The whole body, or None after answering (413 too large, 408 too slow) or a disconnect."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        chunks, size, more = [], 0, True
        while more:
            # the later of the rate's deadline for what arrived so far, capped by the total one
            due = min(start + self.body_timeout_s, start + BODY_GRACE_S + size / self.min_body_rate)
            try:
                msg = await asyncio.wait_for(receive(), max(due - loop.time(), 0.0))
            except TimeoutError:
                await _reply(send, 408, f"request body too slow: {size} bytes in {loop.time() - start:.1f} s (a body "
                             f"must arrive within {self.body_timeout_s:g} s, at {self.min_body_rate / 1024:g} KiB/s "
                             "or faster: --body-timeout-s, --min-body-kib-s)", {"Connection": "close"})
                return None
            if msg["type"] == "http.disconnect":
                return None
            chunk = msg.get("body", b"")
            chunks.append(chunk)
            size += len(chunk)
            more = msg.get("more_body", False)
            if size > self.limit:
                await _reply(send, 413, f"request body exceeds {self.limit} bytes (--max-body-mb)",
                             {"Connection": "close"})
                return None
        return b"".join(chunks)


def _replay(receive, body: bytes):
    """An ASGI receive that gives the body already read, then the client's disconnect when it comes."""
    sent = False

    async def once():
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return once


async def _reply(send, status: int, detail: str, headers: dict | None = None) -> None:
    await JSONResponse({"detail": detail}, status_code=status, headers=headers)({"type": "http"}, None, send)


def header_timeout(header_timeout_s: float):
    """uvicorn's h11 protocol, closing a connection that has not sent a whole request's headers
    within header_timeout_s of connecting or of its last response (a slow client would
    otherwise hold a connection open for ever)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeout(H11Protocol):
        _timer = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm()  # a request's headers are in: it is being served

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()  # the next request's headers, on a kept-alive connection

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._timer = self.loop.call_later(header_timeout_s, self._too_slow)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _too_slow(self) -> None:
            self._timer = None
            if self.cycle is None or self.cycle.response_complete:
                self.transport.close()

    return HeaderTimeout
