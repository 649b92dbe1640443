"""What the control plane watches; each watcher only reports, the control plane rebuilds.

- `PolicyFileWatcher`: the policy file, by its stat signature. A valid edit is handed on; an
  invalid one is logged with its `file:line: field` reasons and the last good policy stays.
- `PoolWatcher`: one pool sidecar's (one replica's) admin event stream; `ReplicaLevels` turns
  the replicas' levels into the pool's. Its breaker actions give the pool's
  level; a pool that was seen and is then lost (the stream breaks, or it reports loading or
  draining) is DOWN until its sidecar is back and its serving front answers. A pool never seen
  yet keeps the plain routes: at start-up every pool is still loading and there is nothing
  better to send its traffic to.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable

from infermesh.settings import ACTION_ORDER

from .policy import LEVEL_DOWN, Policy, PolicyError, load_policy

log = logging.getLogger("infermesh.xds")


class PolicyFileWatcher:
    def __init__(self, path: Path, on_policy: Callable[[Policy], None]):
        self.path = path
        self.on_policy = on_policy
        self.policy: Policy | None = None
        """The last good policy."""
        self.rejections = 0
        self._sig: tuple | None = None

    def signature(self) -> tuple | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def load(self) -> bool:
        """Read and validate the file; a rejected one leaves the last good policy in use."""
        self._sig = self.signature()
        try:
            policy = load_policy(self.path)
        except PolicyError as e:
            self.rejections += 1
            log.error("policy rejected; keeping the last good config", extra={"problems": str(e), "path": str(self.path)})
            return False
        self.policy = policy
        self.on_policy(policy)
        return True

    def poll(self) -> bool:
        """Load the file if it changed since the last look; True if a new policy was handed on."""
        sig = self.signature()
        return sig is not None and sig != self._sig and self.load()

    async def run(self, interval: float = 0.1) -> None:
        while True:
            self.poll()
            await asyncio.sleep(interval)


def pool_level(event: dict) -> int:
    """A pool's level from one admin event: its breaker actions, or DOWN while not serving."""
    if event.get("ready") is False or event.get("draining"):
        return LEVEL_DOWN
    if "level" in event:
        return int(event["level"])
    return max((ACTION_ORDER[a] for a in event.get("pool_actions", [])), default=0)


class ReplicaLevels:
    """One pool level from the levels of its replicas' watchers: the least degraded replica's
    (Envoy's balancing and outlier detection keep traffic off the others), counting only
    replicas seen at least once. A pool with every seen replica DOWN is DOWN."""

    def __init__(self, on_level: Callable[[str, int], None]):
        self.on_level = on_level
        self.levels: dict[str, dict[int, int]] = {}

    def reporter(self, replica: int) -> Callable[[str, int], None]:
        """The `on_level` callback of one replica's PoolWatcher."""
        def report(pool: str, level: int) -> None:
            self.levels.setdefault(pool, {})[replica] = level
            self.on_level(pool, min(self.levels[pool].values()))
        return report


class PoolWatcher:
    def __init__(self, pool: str, admin_url: str, health_url: str, on_level: Callable[[str, int], None]):
        self.pool = pool
        self.admin_url = admin_url
        self.health_url = health_url
        """The sidecar's serving front's /health: 200 once it serves again."""
        self.on_level = on_level
        self.level: int | None = None
        """The last level reported; None while the pool was never seen."""

    def _set(self, level: int) -> None:
        if level != self.level:
            self.level = level
            self.on_level(self.pool, level)

    async def follow(self, lines: AsyncIterator[str], serving: Callable[[], Awaitable[bool]]) -> None:
        """Report the levels of one connection's event stream (SSE lines); return when it ends,
        or when a pool coming back from DOWN does not serve yet (look again on a new connection)."""
        async for line in lines:
            if not line.startswith("data: "):
                continue
            level = pool_level(json.loads(line[6:]))
            if level < LEVEL_DOWN and self.level == LEVEL_DOWN and not await serving():
                return
            self._set(level)

    def lost(self) -> None:
        """The stream ended or broke: a pool seen before is DOWN."""
        if self.level is not None:
            self._set(LEVEL_DOWN)

    async def run(self) -> None:
        import httpx

        # One client for the life of the watch: a new one per attempt costs a TLS context each,
        # and a sidecar that is loading is retried five times a second.
        async with httpx.AsyncClient(timeout=httpx.Timeout(5.0, read=60.0), trust_env=False) as client:
            async def serving(timeout: float = 30.0) -> bool:
                deadline = asyncio.get_running_loop().time() + timeout
                while asyncio.get_running_loop().time() < deadline:
                    try:
                        if (await client.get(self.health_url, timeout=1.0)).status_code == 200:
                            return True
                    except Exception:  # noqa: BLE001 — not up yet, whatever the error
                        pass
                    await asyncio.sleep(0.1)
                return False

            while True:
                try:
                    async with client.stream("GET", self.admin_url + "/admin/events") as r:
                        await self.follow(r.aiter_lines(), serving)
                except (httpx.HTTPError, OSError, ValueError):
                    pass  # the sidecar is gone, starting or restarting: retry
                self.lost()
                await asyncio.sleep(0.2)
