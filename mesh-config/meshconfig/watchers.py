"""What the control plane watches; each watcher only reports, the control plane rebuilds.

- `PolicyFileWatcher`: the policy file, by its stat signature, read once stable. A valid edit
  is handed on; anything else is logged with its `file:line: field` reasons, counted, and the
  last good policy stays; nothing in the file can end the watch.
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
import time
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable

from infermesh.settings import ACTION_ORDER

from .cp_metrics import ControlPlaneMetrics
from .policy import LEVEL_DOWN, Policy, PolicyError, decode_policy, file_signature, parse_policy, read_policy_bytes

log = logging.getLogger("infermesh.xds")

_NEVER = object()
"""No signature seen yet (distinct from None: a file found missing)."""


class PolicyFileWatcher:
    """Watches the policy file by its stat signature (device, inode, size, mtime, ctime) and hands
    each new valid policy on; whatever else the file holds is refused and the last good policy stays.

    Nothing in the file can stop the watch. Every failure to read or parse it (I/O, permission, a
    directory or FIFO, encoding, YAML syntax, depth, an alias bomb, size, validation) is a
    PolicyError naming `file:line: field`, logged and counted in
    `infermesh_policy_rejections_total{reason}`; a bug of ours while polling is logged with its
    traceback, counted as reason `internal`, and the next poll goes on. A refused file is not
    read again until its signature changes.

    A write in progress is never applied half-written. A change is read only once it is stable:
    - at once when the file's ctime is past its mtime: a metadata change came after the last
      write, which is what renaming a finished file into place (`mv`, `os.replace`, most
      editors' safe write) leaves; such a file is complete;
    - otherwise (written in place: `>`, `write_text`, an editor that overwrites) once its
      signature has not moved for `settle` seconds (its mtime that old, or that long seen
      unchanged), the pause an editor's or a script's writes do not leave between chunks;
    - and in every case only if its stat is the same before and after the read and the bytes
      read are its size (`read_policy_bytes`), so a write that resumes during the read is
      caught and the file is read again at the next poll.
    Comparing content hashes across two reads would also work but needs the same wait between
    the reads to mean anything, and reads the file twice; the stat says the same for free.
    A rename done within one tick of the kernel's file clock (a few ms) after the write shows
    no ctime gap and waits the settle interval like an in-place write.
    """

    def __init__(self, path: Path, on_policy: Callable[[Policy], None], metrics: ControlPlaneMetrics | None = None,
                 settle: float = 0.2, clock: Callable[[], float] = time.monotonic, wall_ns: Callable[[], int] = time.time_ns):
        self.path = path
        self.on_policy = on_policy
        self.metrics = metrics or ControlPlaneMetrics()
        self.settle = settle
        self.clock, self.wall_ns = clock, wall_ns
        self.policy: Policy | None = None
        """The last good policy."""
        self.rejections = 0
        self.last_error: PolicyError | None = None
        self._sig: tuple | None | object = _NEVER
        """The signature last read (good or refused); None for a file found missing."""
        self._pending: tuple | None | object = _NEVER
        self._pending_since = 0.0

    def signature(self) -> tuple | None:
        try:
            return file_signature(self.path.stat())
        except OSError:
            return None

    def settled(self, sig: tuple | None) -> bool:
        """Whether a changed file is ready to be read (see the class docstring)."""
        now = self.clock()
        if sig != self._pending:
            self._pending, self._pending_since = sig, now
        if now - self._pending_since >= self.settle:
            return True
        if sig is None:
            return False  # gone: a replace in progress, or deleted (refused once it stays gone)
        _, _, _, mtime_ns, ctime_ns = sig
        return ctime_ns > mtime_ns or self.wall_ns() - mtime_ns >= self.settle * 1e9

    def _read(self) -> tuple[Policy | Exception, tuple | None]:
        """The file's policy or why not, and the signature of what was read. Runs no callback,
        so it may run in a thread."""
        p = str(self.path)
        try:
            data, st = read_policy_bytes(p)
        except Exception as e:  # noqa: BLE001 — PolicyError, or a bug: either way an outcome
            return e, self.signature()
        try:
            return parse_policy(decode_policy(data, p), p), file_signature(st)
        except Exception as e:  # noqa: BLE001
            return e, file_signature(st)

    def _apply(self, outcome: Policy | Exception, sig: tuple | None) -> bool:
        if isinstance(outcome, PolicyError) and outcome.reason == "changed":
            self._pending = _NEVER  # a writer is at work: wait for it to settle again
            log.info("policy file changed while it was read; reading it again once it is still", extra={"path": str(self.path)})
            return False
        self._sig = sig
        if isinstance(outcome, Exception):
            self._reject(outcome)
            return False
        try:
            self.on_policy(outcome)
        except Exception as e:  # noqa: BLE001 — the control plane's bug must not end the watch
            self._reject(e)
            return False
        self.policy = outcome
        self.last_error = None
        self.metrics.policy_reloads.inc()
        return True

    def _reject(self, e: Exception) -> None:
        self.rejections += 1
        if isinstance(e, PolicyError) and e.reason != "internal":
            self.last_error = e
            self.metrics.policy_rejections.labels(e.reason).inc()
            log.error("policy rejected; keeping the last good config",
                      extra={"problems": str(e), "reason": e.reason, "path": str(self.path)})
            return
        self.metrics.policy_rejections.labels("internal").inc()
        log.error("policy could not be loaded (a bug); keeping the last good config", exc_info=e,
                  extra={"error": f"{type(e).__name__}: {e}", "path": str(self.path)})

    def load(self, attempts: int = 40) -> bool:
        """Read and validate the file now (a file being written is read again, up to `attempts`
        times 50 ms apart); a rejected one leaves the last good policy in use."""
        for _ in range(attempts):
            outcome, sig = self._read()
            if not (isinstance(outcome, PolicyError) and outcome.reason == "changed"):
                return self._apply(outcome, sig)
            time.sleep(0.05)
        return self._apply(outcome, sig)

    def _changed(self) -> bool:
        sig = self.signature()
        return sig != self._sig and self.settled(sig)

    def poll(self) -> bool:
        """Load the file if it changed since the last look and is stable; True if a new policy was handed on."""
        return self._changed() and self._apply(*self._read())

    async def poll_async(self) -> bool:
        """`poll`, with the read and parse in a thread: a large file does not stall the ADS streams."""
        return self._changed() and self._apply(*await asyncio.to_thread(self._read))

    async def run(self, interval: float = 0.1) -> None:
        while True:
            try:
                await self.poll_async()
            except Exception as e:  # noqa: BLE001 — one bad poll must not end the watch
                self.metrics.policy_rejections.labels("internal").inc()
                log.error("policy watch: a poll failed; watching on", exc_info=e, extra={"path": str(self.path)})
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
