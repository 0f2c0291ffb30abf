"""Every HTTP answer counted by route, method and status (conveyor:http_requests_total)."""

from __future__ import annotations

from http import HTTPStatus

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from frontend.state import ServerState

# Methods any client may send are label values: others count as "other", so the series stay few.
METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})


class HttpMetricsMiddleware:
    """Outermost (pure ASGI; streams pass through): counts each answer by its route's path
    template, method and status, refusals by the inner middlewares included (a path no route
    serves is "other"). An exception that escapes before any answer started counts as the 500
    Starlette's error handler then sends."""

    def __init__(self, app: ASGIApp, state: ServerState, route_paths: frozenset[str]) -> None:
        self.app = app
        self._state = state
        self._route_paths = route_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0

        async def send_counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        except Exception:
            status = status or HTTPStatus.INTERNAL_SERVER_ERROR
            raise
        finally:
            if status:  # else no answer started: the client left first
                method = scope["method"] if scope["method"] in METHODS else "other"
                self._state.metrics.record_http(self._handler(scope), method, status)

    def _handler(self, scope: Scope) -> str:
        route = getattr(scope.get("route"), "path", None)  # set by the router once it matched
        if route is None and scope["path"] in self._route_paths:  # refused before routing
            route = scope["path"]
        return route or "other"
