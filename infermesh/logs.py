"""JSON logging for the long-running processes (the sidecar and the control plane): one object
per line on stderr, so a log collector reads the fields without a parser per component."""

from __future__ import annotations

import json
import logging
import sys

_STD_ATTRS = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, the static fields and any `extra=` fields."""

    def __init__(self, static: dict | None = None):
        super().__init__()
        self.static = static or {}

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **self.static,
        }
        out.update({k: v for k, v in vars(record).items() if k not in _STD_ATTRS})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(static: dict) -> None:
    """Route the `infermesh` loggers to stderr as JSON, each line carrying `static` (pool, component, …)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(static))
    root = logging.getLogger("infermesh")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    root.propagate = False
