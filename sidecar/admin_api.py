"""Admin and fault-injection API: its own HTTP port, bound to 127.0.0.1 by default.

It is never part of a mesh route (the mesh only knows the serving ports), and faults can be
turned off entirely with `admin.allow_faults: false`.

    GET    /admin/state              pool state: level, actions, serving model, breakers, faults
    GET    /admin/events             Server-Sent Events: the state, then one JSON object per event
                                     (breaker transitions, draining)
    PUT    /admin/faults/{signal}    {"value": 0.97, "duration_s": 30}: override a reading
    PUT    /admin/faults/stall       {"value": 0.8, "duration_s": 20, "period_s": 1}: stop the
                                     primary model's engine processes for 80 % of every second
                                     (real slowness, as on an overloaded GPU)
    DELETE /admin/faults[/{signal}]  end injected faults
"""

from __future__ import annotations

import asyncio
import json
import math

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from .breakers import Signal
from .errors import BadRequest
from .faults import STALL
from . import internal_errors
from .pool import Pool
from .requests import json_body

SIGNALS = set(Signal.__args__)  # type: ignore[attr-defined]


def build_admin_app(pool: Pool) -> FastAPI:
    app = FastAPI(title="infermesh sidecar admin", docs_url=None, redoc_url=None, openapi_url=None)
    allow = pool.config.admin.allow_faults

    internal_errors.install(app, pool.metrics.registry, "admin")

    def err(status: int, msg: str, param: str | None = None) -> JSONResponse:
        return JSONResponse({"error": {"message": msg, "type": "invalid_request_error", "param": param, "code": status}},
                            status_code=status)

    @app.get("/admin/state")
    async def state():
        return pool.state()

    @app.get("/admin/events")
    async def events(request: Request):
        async def gen():
            with pool.events.watch() as q:
                # The current state first, so a watcher needs no separate GET.
                yield b"event: state\ndata: " + json.dumps(pool.state()).encode() + b"\n\n"
                while True:
                    try:
                        ev = await asyncio.wait_for(q.get(), timeout=15)
                        # Every event is sent as `transition` (drains too): what the control plane reads.
                        yield b"event: transition\ndata: " + json.dumps(ev.wire()).encode() + b"\n\n"
                    except asyncio.TimeoutError:
                        yield b": keep-alive\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.put("/admin/faults/{signal}")
    async def set_fault(signal: str, request: Request):
        if not allow:
            return err(403, "fault injection is disabled (admin.allow_faults: false)")
        if signal not in SIGNALS and signal != STALL:
            return err(404, f"unknown fault {signal!r}; one of {sorted(SIGNALS | {STALL})}")
        try:
            body = json_body(await request.body())
        except BadRequest as e:
            return err(400, e.message, e.param)
        if not isinstance(body, dict):
            return err(400, 'body must be an object: {"value": number, "duration_s": number}', "body")
        if "value" not in body:
            return err(400, "`value` is required", "value")
        numbers = {}
        for name, default in (("value", None), ("duration_s", 60.0), ("period_s", 1.0)):
            v = body.get(name, default)
            # JSON numbers only (bool is an int in Python; a string is not a number).
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                return err(400, f"`{name}` must be a finite number, got {json.dumps(v)[:40]}", name)
            numbers[name] = float(v)
        value, duration, period = numbers["value"], numbers["duration_s"], numbers["period_s"]
        if not (0 <= value <= 1e6):
            return err(400, "`value` must be in [0, 1e6]", "value")
        if not (0 < duration <= 3600):
            return err(400, "`duration_s` must be in (0, 3600]", "duration_s")
        if signal == STALL:
            if not (0 < value <= 0.95):
                return err(400, "stall: `value` (the stopped fraction) must be in (0, 0.95]", "value")
            if not (0.05 <= period <= 10):
                return err(400, "stall: `period_s` must be in [0.05, 10]", "period_s")
            if not pool.primary.pids:
                return err(409, "the primary model's engine processes are not known (not loaded yet?)")
            return {"signal": signal, **pool.faults.start_stall(pool.primary.pids, value, duration, period)}
        pool.faults.set(signal, value, duration)
        return {"signal": signal, "value": value, "duration_s": duration}

    @app.delete("/admin/faults")
    async def clear_all():
        pool.faults.clear()
        return {"cleared": "all"}

    @app.delete("/admin/faults/{signal}")
    async def clear_one(signal: str):
        pool.faults.clear(signal)
        return {"cleared": signal}

    return app
