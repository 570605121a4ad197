"""Every response counted by route and status, and a bug's exception answered as an OpenAI-shaped 500.

A plain ASGI middleware rather than FastAPI's `@app.middleware("http")`: that one is starlette's
BaseHTTPMiddleware, which hands every chunk of a streamed response through an anyio memory stream and a task of
its own. At 64 concurrent streamed completions (one chunk per engine step per request) that hand-off was a fifth
of the gateway's busy time (py-spy, 2-core EPYC), the gateway being one event loop that every token passes
through. Here a response passes as it is; only its start is read, for the status.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.errors import internal_error

logger = logging.getLogger("specserve.gateway")


class RequestCounter:
    def __init__(self, app: ASGIApp, count: Callable[[str, int], None]) -> None:
        """`count(path, status)`: called once per HTTP response, a bug's 500 included."""
        self.app = app
        self.count = count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: list[int] = []

        async def send_and_note(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        except Exception:
            if status:  # the response had started: nothing else can be sent on it (the server logs it)
                raise
            logger.exception("unhandled error in %s %s", scope.get("method", ""), scope.get("path", ""))
            await internal_error().response()(scope, receive, send_and_note)
        finally:
            self.count(route_path(scope), status[0] if status else 500)


def route_path(scope: Scope) -> str:
    """The request's path as the routes see it: without the --root-path prefix, which uvicorn puts in front."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path
