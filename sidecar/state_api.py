"""The replica's pool state for the mesh, on the serving port: read-only, nothing to act on.

- `GET /infermesh/state` -> `{"pool", "instance", "level", "ready"}` with the
  `x-infermesh-pool-level` header. The filter probes it (proxy-wasm HTTP callouts on a timer)
  for pools that get no traffic; it exposes no fault, admin or model action, and nothing a
  client could use beyond what every response's headers already say to the mesh.
- `GET /infermesh/state?healthy_below=N` -> the same body, with status 200 while the replica is
  below level N and 503 from it up (`LEVEL_DOWN` while not ready or draining): Envoy's active
  health check of a pool with `when_degraded.spill_to` (envoy_resources.state_health_checks), so
  a replica at `at_level` leaves rotation and Envoy's priority failover spills to the next pool.
- Every response of the serving app carries `x-infermesh-pool-level` (refusals included: a
  replica shedding with 429/503 is the one whose level matters most), from this middleware.

`install(app, pool)` is the one call `http_api.build_app` makes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from infermesh.settings import LEVEL_DOWN

from .requests import decimal
from .response_headers import POOL_LEVEL_HEADER, pool_level, pool_level_value

if TYPE_CHECKING:
    from .pool import Pool

STATE_PATH = "/infermesh/state"
_HEADER = POOL_LEVEL_HEADER.encode()


class PoolLevelHeader:
    """ASGI middleware: adds the pool-level header to every response (no body buffering,
    streams untouched)."""

    def __init__(self, app, pool: "Pool"):
        self.app = app
        self.pool = pool

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_level(message):
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if not any(k.lower() == _HEADER for k, _ in headers):
                    headers.append((_HEADER, pool_level_value(self.pool).encode()))
                    message = dict(message, headers=headers)
            await send(message)

        await self.app(scope, receive, send_with_level)


def healthy_below(raw: str) -> int | None:
    """The health check's level bound, 1-LEVEL_DOWN, or None when it is not one."""
    n = decimal(raw, max_digits=2)  # ASCII digits: '²'.isdigit() is true, and int() refuses it
    return n if n is not None and 1 <= n <= LEVEL_DOWN else None


def install(app: FastAPI, pool: "Pool") -> None:
    """Register the state route and the header middleware on the serving app."""

    @app.get(STATE_PATH)
    async def state(request: Request) -> JSONResponse:
        cfg = pool.config
        level = pool_level(pool)
        body = {"pool": cfg.pool, "instance": cfg.instance, "level": level, "ready": pool.ready}
        status = 200
        raw = request.query_params.get("healthy_below")
        if raw is not None:
            below = healthy_below(raw)
            if below is None:
                return JSONResponse({"error": {"message": f"healthy_below: an integer 1-{LEVEL_DOWN}, got {raw!r}",
                                               "type": "invalid_request_error", "param": "healthy_below", "code": "invalid_value"}},
                                    status_code=400)
            status = 200 if level < below else 503
        return JSONResponse(body, status_code=status, headers={POOL_LEVEL_HEADER: pool_level_value(pool), "cache-control": "no-store"})

    app.add_middleware(PoolLevelHeader, pool=pool)
