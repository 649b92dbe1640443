"""The replica's pool state for the mesh, on the serving port: read-only, nothing to act on.

- `GET /infermesh/state` -> `{"pool", "instance", "level", "ready"}` with the
  `x-infermesh-pool-level` header. The filter probes it (proxy-wasm HTTP callouts on a timer)
  for pools that get no traffic; it exposes no fault, admin or model action, and nothing a
  client could use beyond what every response's headers already say to the mesh.
- Every response of the serving app carries `x-infermesh-pool-level` (refusals included: a
  replica shedding with 429/503 is the one whose level matters most), from this middleware.

`install(app, pool)` is the one call `http_api.build_app` makes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.responses import JSONResponse

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


def install(app: FastAPI, pool: "Pool") -> None:
    """Register the state route and the header middleware on the serving app."""

    @app.get(STATE_PATH)
    async def state() -> JSONResponse:
        cfg = pool.config
        body = {"pool": cfg.pool, "instance": cfg.instance, "level": pool_level(pool), "ready": pool.ready}
        return JSONResponse(body, headers={POOL_LEVEL_HEADER: pool_level_value(pool), "cache-control": "no-store"})

    app.add_middleware(PoolLevelHeader, pool=pool)
